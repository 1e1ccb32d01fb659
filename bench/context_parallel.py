"""Context parallelism on gloo (CPU): activation memory per rank and step time against the
planner, how much of the ring's communication the attention hides, and ring attention's
blocks through the explicit math against the fused SDPA kernel.

    .venv/bin/python bench/context_parallel.py [--seq-lengths 2048 4096 8192 16384] [--cp 1 2 4]
        [--tables model blocks documents] [--doc-lengths 1024 128]

A small GPT (learned positions: the planner does not count RoPE's copies; fp32, no dropout)
runs forward + backward of one micro batch per sequence length at CP 1, 2 and 4 (CP gloo
ranks, one spawn per CP size). Per rank:

- activations: the bytes autograd keeps for backward (megatron.model.memory.SavedActivations),
  next to the planner's activation term (megatron.planning.memory, the CPU device of
  bench/plan_validation.py) and their difference;
- step: wall time of forward + backward (the median of --repeats), next to the planner's
  compute + cp_comm terms with the device's matmul rate calibrated on the CP 1 run of the
  shortest sequence;
- ring: the time the ring waited for its messages inside attention ("exposed"), and the time
  the same messages take alone (same sizes and count, nothing to compute): hidden share
  = 1 - exposed / alone.

The blocks table (at each CP of --cp above 1): one ring-attention forward + backward alone
(b 1, 8 heads of 64, fp32, no dropout; q, k, v of s / CP tokens per rank) with its blocks
through the explicit fp32 math (--attention-backend unfused) and through the fused SDPA kernel
(sdpa; on the CPU aten._scaled_dot_product_flash_attention_for_cpu): wall time (median of
--repeats, the slower rank) and peak bytes of the tensors allocated during it (the torch
profiler's memory events, the fuller rank; the inputs are allocated before).

The documents table: the same ring step with fused blocks, causal, and within packed documents
(--reset-attention-mask) of random lengths averaging each of --doc-lengths tokens, with the
masked blocks (chunk pairs partly inside a document) through the explicit fp32 math
(RingAttention(piecewise_documents=False), as before mpu/ring_pieces.py) and piecewise through
the fused kernel (the default), side by side: wall time (the slower rank), peak bytes (the
fuller rank), the piecewise step against causal, and how the blocks the causal ring computes
went (summed over ranks): fused (one document), masked, or skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.model.memory import SavedActivations  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu import context_parallel as cpm  # noqa: E402
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron.mpu.ring_documents import BlockKind, causal_kind  # noqa: E402
from megatron.planning.memory import Device, Layout, Training, per_rank_sequence  # noqa: E402
from megatron.planning.pipeline_memory import stage_activation_peak  # noqa: E402
from megatron.planning.timing import Hardware, cp_ring_seconds, layer_forward_flops  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=512,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
CPU = Device(mask_bytes=4, flash_attention=True)  # CPU SDPA without dropout keeps no scores
FP32 = Training(dtype_bytes=4)


class _RingClock:
    """Wraps the ring's wait so the time spent blocked on messages is summed."""

    def __init__(self):
        self.waited = 0.0
        self.messages = 0
        self._wait = cpm._wait

    def __enter__(self):
        def timed(requests):
            start = time.perf_counter()
            self._wait(requests)
            self.waited += time.perf_counter() - start
            self.messages += 1

        cpm._wait = timed
        return self

    def __exit__(self, *exc):
        cpm._wait = self._wait


def _alone(state, cfg: ModelConfig, messages: int) -> float:
    """Seconds the ring's messages take with nothing to compute: K/V blocks (2, b, g, c, d)."""
    if state.cp_size == 1:
        return 0.0
    ring = cpm.RingAttention(state).ring
    block = torch.zeros(2, 1, cfg.query_groups, cfg.seq_length // state.cp_size, cfg.head_dim)
    torch.distributed.barrier(group=state.cp_group)
    start = time.perf_counter()
    for _ in range(messages):
        _, requests = ring.exchange(block, 0)
        for r in requests:
            r.wait()
    return time.perf_counter() - start


def _one(state, seq: int, repeats: int) -> dict:
    cfg = dataclasses.replace(MODEL, seq_length=seq)
    model = GPTModel(cfg, BuildContext(state, seed=1))
    g = torch.Generator().manual_seed(seq)
    text = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g)
    tokens, labels = (
        cpm.context_parallel_slice(t, state.cp_rank, state.cp_size)
        for t in (text[:, :-1], text[:, 1:])
    )
    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(tokens, labels=labels).mean()
    loss.backward()
    times, clock = [], _RingClock()
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        start = time.perf_counter()
        with clock:
            model(tokens, labels=labels).mean().backward()
        times.append(time.perf_counter() - start)
    per_step = clock.messages // repeats
    alone = _alone(state, cfg, per_step * repeats) / repeats
    return {
        "activations": saved.bytes,
        "step_s": statistics.median(times),
        "exposed_s": clock.waited / repeats,
        "alone_s": alone,
    }


def _worker(rank, world, seqs, repeats):
    torch.manual_seed(0)
    state = initialize_model_parallel(1, context_parallel_size=world)
    out = {seq: _one(state, seq, repeats) for seq in seqs}
    destroy_model_parallel(state)
    return out


BLOCK_HEADS, BLOCK_HEAD_DIM = 8, 64


def _peak_bytes(fn) -> int:
    """Peak bytes of the CPU tensors allocated inside fn() alive at once (the torch profiler's
    memory events: + size at each allocation, - at each free, summed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0))


def _fresh(*tensors) -> None:
    """No gradients left from the step before; the ranks start together."""
    for t in tensors:
        t.grad = None
    torch.distributed.barrier()


def _median_seconds(step, tensors, repeats: int) -> float:
    """Median wall time of step() after a warm-up (the fused kernel's check against the math)."""
    step()
    times = []
    for _ in range(repeats):
        _fresh(*tensors)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    _fresh(*tensors)
    return statistics.median(times)


def _time_and_peak(ring, q, k, v, dout, repeats: int) -> tuple[float, int]:
    """(median seconds, peak bytes) of ring(q, k, v).backward(dout)."""

    def step():
        ring(q, k, v).backward(dout)

    return _median_seconds(step, (q, k, v), repeats), _peak_bytes(step)


def _blocks_worker(rank, world, seqs, repeats):
    """{(seq, backend): (seconds, peak bytes)} of one ring forward + backward on this rank."""
    state = initialize_model_parallel(1, context_parallel_size=world)
    out = {}
    for seq in seqs:
        g = torch.Generator().manual_seed(seq + rank)
        shape = (1, BLOCK_HEADS, seq // world, BLOCK_HEAD_DIM)  # (b, h, 2c, d) of this rank
        q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in "qkv")
        dout = torch.randn(shape, generator=g)
        for backend in ("math", "fused"):
            ring = cpm.RingAttention(state, backend)
            out[seq, backend] = _time_and_peak(ring, q, k, v, dout, repeats)
    destroy_model_parallel(state)
    return out


def _ring_runs(head: str, cps, worker, *args):
    """Print the table's head, then (CP, each rank's results of worker) for each CP > 1."""
    print(head)
    print("-" * len(head))
    for cp in [c for c in cps if c > 1]:
        yield cp, run_distributed(worker, cp, *args, timeout=3600)


def _blocks_table(seqs, cps, repeats) -> None:
    head = (
        f"{'seq':>6} {'CP':>3} {'math s':>8} {'fused s':>8} {'speedup':>8} "
        f"{'math peak MiB':>13} {'fused peak MiB':>14} {'ratio':>6}"
    )
    for cp, ranks in _ring_runs(head, cps, _blocks_worker, seqs, repeats):
        for seq in seqs:
            (tm, pm), (tf, pf) = (
                (max(r[seq, b][0] for r in ranks), max(r[seq, b][1] for r in ranks))
                for b in ("math", "fused")
            )
            print(
                f"{seq:>6} {cp:>3} {tm:>8.3f} {tf:>8.3f} {tm / tf:>7.2f}x "
                f"{pm / 2**20:>13.1f} {pf / 2**20:>14.1f} {pm / pf:>5.1f}x"
            )


def _packed_ids(seq: int, mean: int, seed: int) -> torch.Tensor:
    """(1, seq) document ids of packed documents of lengths uniform in [1, 2 mean - 1]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * mean, (seq,), generator=g)  # more than enough documents
    ids = torch.repeat_interleave(torch.arange(seq), lengths)[:seq]
    return ids.unsqueeze(0)


def _block_counts(documents, rank: int, cp: int) -> dict[str, int]:
    """How the blocks a causal ring computes on `rank` run under `documents` (None: causal)."""
    counts = {"fused": 0, "masked": 0, "skipped": 0}
    names = {BlockKind.SKIP: "skipped", BlockKind.MASKED: "masked"}
    for i in cpm.chunk_ids(rank, cp):
        for j in range(i + 1):
            kind = causal_kind(i, j) if documents is None else documents.kind(i, j)
            counts[names.get(kind, "fused")] += 1
    return counts


def _ring_step(ring, q, k, v, dout, documents) -> None:
    ring(q, k, v, documents=documents).backward(dout)


def _documents_worker(rank, world, seqs, means, repeats):
    """{(seq, mean or None, masked blocks' path): (seconds, peak bytes, block counts)} of one
    fused ring step on this rank: causal (mean None), and within documents with the masked
    blocks through the fp32 math or piecewise through the fused kernel."""
    state = initialize_model_parallel(1, context_parallel_size=world)
    rings = {
        "math": cpm.RingAttention(state, "fused", piecewise_documents=False),
        "pieces": cpm.RingAttention(state, "fused"),
    }
    out = {}
    for seq in seqs:
        g = torch.Generator().manual_seed(seq + rank)
        shape = (1, BLOCK_HEADS, seq // world, BLOCK_HEAD_DIM)  # (b, h, 2c, d) of this rank
        q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in "qkv")
        dout = torch.randn(shape, generator=g)
        for mean in (None, *means):
            docs = None
            if mean is not None:
                ids = cpm.context_parallel_slice(_packed_ids(seq, mean, seq), rank, world)
                docs = cpm.gather_documents(ids, state)
            for path in ("pieces",) if mean is None else ("math", "pieces"):
                step = functools.partial(_ring_step, rings[path], q, k, v, dout, docs)
                seconds = _median_seconds(step, (q, k, v), repeats)
                out[seq, mean, path] = (
                    seconds,
                    _peak_bytes(step),
                    _block_counts(docs, rank, world),
                )
                _fresh(q, k, v)
    destroy_model_parallel(state)
    return out


def _documents_table(seqs, cps, means, repeats) -> None:
    head = (
        f"{'seq':>6} {'CP':>3} {'doc len':>8} {'math s':>8} {'pieces s':>8} {'speedup':>8} "
        f"{'math MiB':>9} {'pieces MiB':>10} {'vs causal':>9} {'fused':>6} {'masked':>7} "
        f"{'skipped':>8}"
    )
    for cp, ranks in _ring_runs(head, cps, _documents_worker, seqs, means, repeats):
        for seq in seqs:
            causal = max(r[seq, None, "pieces"][0] for r in ranks)
            for mean in (None, *means):
                paths = ("pieces",) if mean is None else ("math", "pieces")
                (tm, pm), (tp, pp) = (
                    (max(r[seq, mean, x][0] for r in ranks), max(r[seq, mean, x][1] for r in ranks))
                    for x in (paths[0], paths[-1])
                )
                counts = ranks[0][seq, mean, "pieces"][2]
                n = {k: sum(r[seq, mean, "pieces"][2][k] for r in ranks) for k in counts}
                label = "causal" if mean is None else str(mean)
                print(
                    f"{seq:>6} {cp:>3} {label:>8} {tm:>8.3f} {tp:>8.3f} {tm / tp:>7.2f}x "
                    f"{pm / 2**20:>9.1f} {pp / 2**20:>10.1f} {tp / causal:>8.2f}x "
                    f"{n['fused']:>6} {n['masked']:>7} {n['skipped']:>8}"
                )


def predicted_activations(seq: int, cp: int) -> int:
    m = dataclasses.replace(MODEL, seq_length=seq)
    lay = Layout(1, 1, 1, 1, 1, cp=cp)
    return stage_activation_peak(per_rank_sequence(m, lay), lay, FP32, CPU, 0)["activations"]


def predicted_step(seq: int, cp: int, hw: Hardware) -> float:
    m = dataclasses.replace(MODEL, seq_length=seq)
    mat, core = layer_forward_flops(m, 1)
    head = 2.0 * seq * m.hidden_size * m.padded_vocab_size(1)
    compute = 3 * (m.num_layers * (mat + core) + head) / cp / hw.flops_per_s
    ring = cp_ring_seconds(m, Layout(1, 1, 1, 1, 1, cp=cp), FP32, hw)["exposed"]
    return compute + m.num_layers * ring


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=2, help="timed steps per point (median)")
    p.add_argument(
        "--tables",
        nargs="+",
        choices=("model", "blocks", "documents"),
        default=["model", "blocks"],
        help="model: the GPT against the planner; blocks: ring attention, math vs fused blocks; "
        "documents: ring attention within packed documents vs causal",
    )
    p.add_argument(
        "--doc-lengths",
        type=int,
        nargs="+",
        default=[1024, 128],
        help="mean document lengths (tokens) of the documents table",
    )
    args = p.parse_args(argv)
    tables = {
        "model": lambda: _model_table(args),
        "blocks": lambda: _blocks_table(args.seq_lengths, args.cp, args.repeats),
        "documents": lambda: _documents_table(
            args.seq_lengths, args.cp, args.doc_lengths, args.repeats
        ),
    }
    for i, name in enumerate(n for n in tables if n in args.tables):
        if i:
            print()
        tables[name]()
    return 0


def _model_table(args) -> None:
    runs = {
        cp: run_distributed(_worker, cp, args.seq_lengths, args.repeats, timeout=3600)
        for cp in args.cp
    }
    # calibrate the matmul rate on CP 1 (or the smallest CP) of the shortest sequence
    cp0, s0 = min(args.cp), min(args.seq_lengths)
    hw = Hardware(peak_tflops=1.0, matmul_efficiency=1.0, latency_s=0.0)
    scale = predicted_step(s0, cp0, hw) / runs[cp0][0][s0]["step_s"]
    hw = dataclasses.replace(hw, peak_tflops=scale)
    head = (
        f"{'seq':>6} {'CP':>3} {'act MiB/rank':>12} {'planner':>8} {'diff':>7} "
        f"{'step s':>8} {'planner':>8} {'ring alone s':>12} {'exposed s':>10} {'hidden':>7}"
    )
    print(head)
    print("-" * len(head))
    for seq in args.seq_lengths:
        for cp in args.cp:
            r = max(runs[cp], key=lambda x: x[seq]["activations"])[seq]  # the fullest rank
            pred = predicted_activations(seq, cp)
            diff = (r["activations"] - pred) / pred * 100
            hidden = 1 - r["exposed_s"] / r["alone_s"] if r["alone_s"] else float("nan")
            print(
                f"{seq:>6} {cp:>3} {r['activations'] / 2**20:>12.2f} {pred / 2**20:>8.2f} "
                f"{diff:>6.2f}% {r['step_s']:>8.3f} {predicted_step(seq, cp, hw):>8.3f} "
                f"{r['alone_s']:>12.4f} {r['exposed_s']:>10.4f} {hidden * 100:>6.1f}%"
            )


if __name__ == "__main__":
    sys.exit(main())
