"""Pipeline bubble per schedule against the simulator and theory, and activation memory with
and without recompute.

    .venv/bin/python bench/pipeline.py [--stages 4 --micro-batches 4 8 16 --ms 4] [--real H]
        [--skip-bubble] [--skip-memory] [--recompute {selective,full}]
    .venv/bin/python bench/pipeline.py --overlap [--hidden 64 --iters 4]

1. Bubble: the real schedule executor (megatron.training.pipeline) on P gloo ranks, for each
   --pipeline-schedule (1f1b, interleaved V=2, zb-h1, zbv, dualpipev), driving model chunks
   whose forward, input backward and weight backward each sleep t ms per micro batch and stage
   (split over the chunks; a backward with no W of its own sleeps both). Sleeping uses no CPU,
   so even a 2-core machine measures the schedule itself, not the contention of P ranks of real
   compute on two cores (`--real H`: real GEMMs through the model's linear, one thread per
   rank, which then measures the cores' contention too). Per rank: idle = 1 - (its forward +
   backward + W time) / step time,
   next to the simulator's idle fraction for the same lists and costs (megatron.schedules.sim)
   and the textbook bubble ((P - 1) / (M + P - 1) for 1F1B, ...; "-" where none is published).
   Each action also pays a fixed cost (the sleep's overshoot, a gloo message, Python: about a
   millisecond on a busy 2-core machine) that the simulator does not: the measured idle sits
   above the simulated by about that over t, more for the V schedules' half-size chunks;
   `--ms 20` brings them closer.
2. Activation peak per schedule and stage: one real training step of a tiny GPT (8 layers,
   h 32, s 16, micro batch 2, M = 16 / DP, fp32) on P gloo ranks through pretrain() and the
   schedule executor, each rank's peak of what it holds for backward (autograd's saved tensors
   plus the zero-bubble W queue, each storage once: megatron.model.memory.LiveActivations),
   next to the planner's `activations` term for that stage
   (megatron.planning.pipeline_memory.stage_activation_peak) and their difference
   (tests/helpers/pipeline_memory.py; `--recompute` for full or selective recompute).
3. Memory: bytes of activations kept for backward during one forward of a GPT (counted with
   autograd's saved-tensor hooks, so it works on any device), for no / selective / full
   recompute.
3. `--overlap`: DualPipeV's forward / backward pairs overlapped (megatron.mpu.overlap: one
   micro batch's MoE all-to-alls behind another's compute) against the same pairs run in turn
   (--no-overlap-moe-expert-parallel-comm): a tiny MoE GPT trained on 4 gloo ranks (PP 2 x EP 2),
   ms per step after a warm-up step, each setting run twice alternately, best kept; the
   hand-overs per step, and what one hand-over costs alone (two threads passing the turn).
   What gloo on a 2-core machine can show: that the pairs run, how often they hand over, and
   what the second thread costs. What it cannot: the gain, which needs the
   all-to-all to move on links and engines of its own (NCCL's stream beside the compute
   stream) while the other micro batch computes; here 4 ranks share 2 cores, gloo's own
   threads compete with the compute, and loopback all-to-alls take microseconds.
"""

import argparse
import io
import os
import re
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import mpu  # noqa: E402
from megatron.config.cli import parse_args  # noqa: E402
from megatron.config.rules import validate  # noqa: E402
from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.config.schema_recompute import RecomputeConfig  # noqa: E402
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu import overlap  # noqa: E402
from megatron.mpu.layers import local_linear  # noqa: E402
from megatron.mpu.parallel_state import initialize_model_parallel  # noqa: E402
from megatron.schedules.registry import V_SHAPED  # noqa: E402
from megatron.schedules.sim import simulate, textbook_bubble  # noqa: E402
from megatron.training.loop import pretrain  # noqa: E402
from megatron.training.pipeline import forward_backward_pipelining  # noqa: E402
from megatron.training.timers import Timers  # noqa: E402
from tests.helpers import pipeline_memory  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.helpers.training import counting_corpus, flags  # noqa: E402

SHAPE = (1, 4, 8)


class _Sleep(torch.autograd.Function):
    """Forward t, input backward t, weight backward t (queued for a W when the chunk holds a
    weight-gradient split, megatron.mpu.weight_grad)."""

    @staticmethod
    def forward(ctx, x, w, seconds, owner):  # owner: (parameter, split) or None
        ctx.seconds, ctx.owner = seconds, owner
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        seconds, weight_grad = ctx.seconds, grad.sum().reshape(1)

        def weight():
            time.sleep(seconds)
            return weight_grad

        if ctx.owner is not None:
            param, split = ctx.owner
            split.queue_weight_grad(param, weight)
            return grad, None, None, None
        return grad, weight(), None, None


class SleepChunk(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.w, self.seconds, self._input = nn.Parameter(torch.ones(1)), seconds, None
        self.weight_grad_split = None  # given by a zero-bubble schedule (as to the linears)

    def set_input_tensor(self, x):
        self._input = x

    def forward(self):
        x = self._input if self._input is not None else torch.ones(SHAPE, requires_grad=True)
        if self.weight_grad_split is not None:
            owner = (self.w, self.weight_grad_split)
            return _Sleep.apply(x, self.w.detach(), self.seconds, owner)
        return _Sleep.apply(x, self.w, self.seconds, None)


class MatmulChunk(nn.Module):
    """Real compute: x (rows, h) -> x W^T, W of h x h (forward one GEMM, B one, W one: as the
    sleeping chunk's three equal parts); through megatron.mpu.layers.local_linear, so a
    zero-bubble schedule splits its weight gradient as in the model's linears."""

    def __init__(self, hidden: int, rows: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden) / hidden**0.5)
        self.rows, self._input = rows, None
        self.weight_grad_split = None  # given by a zero-bubble schedule (as to the linears)

    def set_input_tensor(self, x):
        self._input = x

    def forward(self):
        x = self._input
        if x is None:
            x = torch.randn(SHAPE[0], self.rows, self.w.size(0), requires_grad=True)
        return local_linear(x, self.w, split=self.weight_grad_split)


def _chunk(ms: float, V: int, real: int | None) -> nn.Module:
    return SleepChunk(ms / 1000 / V) if real is None else MatmulChunk(real, 256 // V)


def _loss(out):
    loss = out.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, chunk):
    next(data_iterator)
    return chunk(), _loss


SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
_COMPUTE = ("forward-compute", "backward-compute", "backward-weight-compute")
_COMPUTE += ("forward-backward-overlap",)  # dualpipev's pairs, when overlapped


def _bubble_worker(rank, world, micro_batches, ms, real=None):
    """(schedule, M, step seconds, this rank's busy seconds) for every schedule and M."""
    torch.set_num_threads(1)
    timers, data, out = Timers(1), iter(range(10**9)), []
    for schedule, V in SCHEDULES:
        v_shape = schedule in V_SHAPED
        state = initialize_model_parallel(1, world, V if V > 1 else None, pipeline_v=v_shape)
        model = nn.ModuleList(_chunk(ms, V, real) for _ in range(V))
        shape = SHAPE if real is None else (SHAPE[0], 256 // V, real)
        for M in micro_batches:
            best = None
            for _ in range(2):  # the first step warms up
                timers.pop_elapsed()
                torch.distributed.barrier()
                start = time.perf_counter()
                forward_backward_pipelining(
                    _forward_step, data, model, M, state=state, shape=shape,
                    dtype=torch.float32, timers=timers, schedule=schedule,
                )  # fmt: skip
                step = time.perf_counter() - start
                elapsed = timers.pop_elapsed()
                busy = sum(elapsed.get(name, 0.0) for name in _COMPUTE)
                best = (step, busy) if best is None or step < best[0] else best
            out.append((schedule, M, *best))
    return out


def bench_bubble(P: int, Ms: list[int], ms: float, real: int | None = None) -> list[tuple]:
    """Rows (schedule, M, step ms, measured idle per rank, simulated idle per rank, theory)."""
    per_rank = run_distributed(_bubble_worker, P, Ms, ms, real)
    rows = []
    for i, (schedule, M, _, _) in enumerate(per_rank[0]):
        step = max(ranks[i][2] for ranks in per_rank)
        idle = [1 - ranks[i][3] / step for ranks in per_rank]
        V = dict(SCHEDULES)[schedule]
        sim = simulate(schedule, P, M, V).bubble
        rows.append((schedule, M, 1000 * step, idle, sim, textbook_bubble(schedule, P, M, V)))
    return rows


def bench_stage_peaks(P: int, recompute: str | None) -> list[tuple]:
    """Rows (schedule, stage, measured bytes, planned bytes): one step per schedule, P ranks."""
    extra = ["--recompute-granularity", recompute] if recompute else []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = counting_corpus(tmp)
        schedules = pipeline_memory.SCHEDULES
        argvs = [pipeline_memory.case_flags(prefix, s, P, *extra) for s in schedules]
        per_rank = run_distributed(pipeline_memory.measure_peaks, P, argvs)
    rows = []
    for i, schedule in enumerate(schedules):
        for results in per_rank:
            stage, measured = results[i]
            planned = pipeline_memory.planned_peak(argvs[i], P, stage)
            rows.append((schedule, stage, measured, planned))
    return rows


def _print_stage_peaks(P: int, recompute: str | None) -> None:
    what = f"recompute {recompute}" if recompute else "no recompute"
    print(f"\nactivation peak per stage over one step, PP {P}, {what} (KiB)")
    print(f"{'schedule':12s} {'stage':>5s} | {'measured':>9s} | {'planner':>9s} | {'diff':>7s}")
    for schedule, stage, measured, planned in bench_stage_peaks(P, recompute):
        diff = (planned - measured) / measured
        print(
            f"{schedule:12s} {stage:5d} | {measured / 1024:9.1f} | {planned / 1024:9.1f} | "
            f"{diff:+7.2%}"
        )


def _saved_bytes(cfg: ModelConfig, recompute: RecomputeConfig, batch: int) -> int:
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 1)
    model = parallelize(
        GPTModel(cfg, BuildContext(rng_tracker=tracker)), mpu.single_process_state(), recompute
    )
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length))
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return total[0]


def bench_memory() -> list[tuple]:
    base = ModelConfig(
        num_layers=8,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=256,
        vocab_size=8192,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    rows = []
    for label, kw in (
        ("no recompute", {}),
        ("selective (attention core)", {"granularity": "selective"}),
        ("full, uniform, 1 layer", {"granularity": "full"}),
        ("full, uniform, 4 layers", {"granularity": "full", "num_layers": 4}),
    ):
        rows.append((label, _saved_bytes(base, RecomputeConfig(**kw), batch=4) / 2**20))
    return rows


_SETTINGS = (("overlapped", []), ("in turn", ["--no-overlap-moe-expert-parallel-comm"]))
_STEP_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _overlap_worker(rank, world, argv):
    """{setting: (best ms per step after the first, hand-overs per step)} on this rank."""
    torch.set_num_threads(1)
    best = {}
    for _ in range(2):
        for label, extra in _SETTINGS:
            cfg = parse_args([*argv, *extra], world_size=world)
            validate(cfg, "train-gpt")
            out, before = io.StringIO(), overlap.counts()["hand_overs"]
            result = pretrain(cfg, out=out)
            steps = [float(ms) for ms in _STEP_MS.findall(out.getvalue())][1:]
            hand_overs = (overlap.counts()["hand_overs"] - before) / result.iteration
            if steps and (label not in best or min(steps) < best[label][0]):
                best[label] = (min(steps), hand_overs)
    return best


def hand_over_us(n: int = 2000) -> float:
    """Microseconds per hand-over of a pair whose sides do nothing else (one process)."""

    pairs = overlap.PairOverlap()

    def side():
        for _ in range(n):
            pairs.hand_over()

    start = time.perf_counter()
    pairs.run(side, side)
    return 1e6 * (time.perf_counter() - start) / (2 * n)


def bench_overlap(hidden: int, iters: int) -> dict:
    """dualpipev at PP 2 x EP 2 (4 gloo ranks), 4 MoE layers, pairs overlapped and in turn."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = flags(counting_corpus(tmp), iters=iters)
        for name, value in (("--hidden-size", hidden), ("--seq-length", 64), ("--num-layers", 4)):
            argv[argv.index(name) + 1] = str(value)
        argv += ["--num-experts", "4", "--moe-router-topk", "2"]
        argv += ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
        argv += ["--pipeline-schedule", "dualpipev", "--micro-batch-size", "1"]
        argv[argv.index("--global-batch-size") + 1] = "16"
        per_rank = run_distributed(_overlap_worker, 4, argv)
    return next(r for r in per_rank if r)  # the last stage logs the step time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--ms", type=float, default=4.0, help="F (= B = W) ms per micro batch, stage")
    p.add_argument(
        "--real",
        type=int,
        metavar="H",
        help="real compute instead of sleeping: chunks of 256 x H times H x H GEMMs, one "
        "thread per rank (the P ranks then share this machine's cores)",
    )
    p.add_argument("--skip-bubble", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument(
        "--recompute",
        choices=("selective", "full"),
        help="the activation-peak table with --recompute-granularity (uniform, 1 layer)",
    )
    p.add_argument("--overlap", action="store_true", help="only the dualpipev overlap table")
    p.add_argument("--hidden", type=int, default=64, help="--overlap: the MoE GPT's width")
    p.add_argument("--iters", type=int, default=4, help="--overlap: steps per run")
    args = p.parse_args()
    if args.overlap:
        print("dualpipev, PP 2 x EP 2 on 4 gloo ranks, MoE GPT 4 layers x 4 experts top-2, "
              f"h {args.hidden}, s 64, 8 micro batches of 1 per DP rank")  # fmt: skip
        print(f"{'pairs':12s} | {'ms per step':>11s} | {'hand-overs per step':>19s}")
        for label, (ms, hand_overs) in bench_overlap(args.hidden, args.iters).items():
            print(f"{label:12s} | {ms:11.1f} | {hand_overs:19.0f}")
        print(f"one hand-over alone (no compute, one process): {hand_over_us():.0f} us")
        return
    if not args.skip_bubble:
        _print_bubble(args)
    if args.skip_memory:
        return
    _print_stage_peaks(args.stages, args.recompute)
    print(f"\n{'activation memory (GPT L8 h256 s256 b4, fp32)':48s} | saved for backward")
    for label, mib in bench_memory():
        print(f"{label:48s} | {mib:8.1f} MiB")


def _print_bubble(args) -> None:
    what = f"{args.ms} ms sleeps" if args.real is None else f"256 x {args.real} GEMMs"
    print(f"P = {args.stages}, F = B = W = {what} per micro batch and stage, gloo")
    print(
        f"{'schedule':12s} {'M':>3s} | {'step ms':>8s} | {'idle per rank, measured':>27s} | "
        f"{'idle per rank, simulated':>27s} | {'textbook':>8s}"
    )
    for schedule, M, step, idle, sim, theory in bench_bubble(
        args.stages, args.micro_batches, args.ms, args.real
    ):
        measured = " ".join(f"{x:.3f}" for x in idle)
        simulated = " ".join(f"{x:.3f}" for x in sim)
        book = "-" if theory is None else f"{theory:.3f}"
        print(
            f"{schedule:12s} {M:3d} | {step:8.1f} | {measured:>27s} | {simulated:>27s} | {book:>8s}"
        )


if __name__ == "__main__":
    main()
