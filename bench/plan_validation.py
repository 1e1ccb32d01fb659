"""Check the planner against real runs: every layout it ranks for a small GPT on 8 gloo ranks.

    .venv/bin/python bench/plan_validation.py          # the README table (minutes on 2 cores)
    .venv/bin/python bench/plan_validation.py --quick  # micro batch 1, no recompute variants

One spawn of 8 CPU ranks: each first calibrates the time model on itself while all 8 run
(matmul FLOP/s, the fixed cost of a layer's forward + backward, gloo all-reduce latency and
bandwidth), then trains every layout for a few steps with the native backend and measures:

    parameters / gradients / optimizer   bytes of the model's weights, of the DDP fp32 gradient
                                         buffer, of the optimizer's masters and state after a step
    activations                          the peak, over the step, of the bytes autograd holds for
                                         backward (saved-tensor hooks, each storage counted once
                                         while any saved reference to it lives): every micro
                                         batch in flight in the pipeline, as the schedule keeps them
    step time                            mean of the steps after the first

and compares them with megatron.planning's predictions for the same rank (its pipeline stage).
Not measured here (predicted only): full recompute's working set in backward (torch's
checkpoint rebuilds it outside the hooks), the pipeline's send buffers, the framework overhead
(CUDA only), the distributed optimizer / ZeRO.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.path.pardir))

WORLD = 8


def base_config():
    from megatron.config.schema import MegatronConfig, ModelConfig
    from megatron.config.schema_optimizer import OptimizerConfig
    from megatron.config.schema_training import TrainingConfig

    model = ModelConfig(
        num_layers=8, hidden_size=64, num_attention_heads=8, seq_length=64, vocab_size=500
    )
    training = TrainingConfig(global_batch_size=8, train_iters=3, num_workers=0)
    return MegatronConfig(model=model, training=training, optimizer=OptimizerConfig(lr=1e-4))


def cpu_device(cfg):
    """CPU keeps dropout masks in the activation dtype and runs SDPA's math path (with the
    score matrix) when attention dropout is on."""
    from megatron.planning.memory import Device

    return Device(mask_bytes=4, flash_attention=cfg.model.attention_dropout == 0)


def _calibrate(rank: int) -> dict[str, float]:
    """Time model inputs, measured while all ranks run the same thing (as in training)."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(128, 64), torch.randn(64, 256)
    dist.barrier()
    start, n = time.perf_counter(), 200
    for _ in range(n):
        a @ b
    flops = 2 * 128 * 64 * 256 * n / (time.perf_counter() - start)
    small = torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(small)
    latency = (time.perf_counter() - start) / 20
    big = torch.zeros(1 << 18)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big)
    seconds = (time.perf_counter() - start) / 5 - latency
    gbps = 2 * (WORLD - 1) / WORLD * big.nbytes / max(seconds, 1e-6) / 1e9
    return {"flops": flops, "latency": latency, "gbps": gbps, "layer": _layer_cost()}


def _layer_cost() -> float:
    """The fixed cost of one transformer layer's forward + backward (a layer of width 8)."""
    import torch

    from megatron.config.schema import ModelConfig
    from megatron.model.context import BuildContext
    from megatron.model.transformer import TransformerLayer

    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=2)
    layer = TransformerLayer(cfg, BuildContext())
    x = torch.randn(1, 2, 8, requires_grad=True)
    start, n = time.perf_counter(), 30
    for _ in range(n):
        layer(x).sum().backward()
    return (time.perf_counter() - start) / n


def _state_bytes(backend) -> dict[str, int]:
    """Weights, the fp32 gradient buffer, the optimizer's masters and state (after a step)."""
    model, opt = backend.model, backend.optimizer.optimizer
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        p.numel() * p.element_size()
        for g in opt.param_groups
        for p in g["params"]
        if p.untyped_storage().data_ptr() not in own  # fp32 masters of half weights
    )
    for s in opt.state.values():
        state += sum(v.numel() * v.element_size() for v in s.values() if hasattr(v, "numel"))
    return {"parameters": params, "gradients": model.grad_buffer.nbytes, "optimizer": state}


def _run_layout(cfg, lay, steps: int) -> dict:
    import torch

    from megatron.initialize import Runtime, set_random_seeds
    from megatron.model.memory import LiveActivations
    from megatron.models.gpt.train import forward_step, model_provider
    from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron.training.step import NativeBackend
    from megatron.training.timers import Timers

    state = initialize_model_parallel(
        lay.tp,
        lay.pp,
        cfg.parallel.virtual_pipeline_size(cfg.model.num_layers),
        sequence_parallel=lay.sequence_parallel,
    )
    rt = Runtime(state, torch.device("cpu"), set_random_seeds(1234, state, torch.device("cpu")))
    backend = NativeBackend(cfg, rt, forward_step, model_provider(cfg))
    gen = torch.Generator().manual_seed(0)
    m = cfg.model

    def batches():
        while True:
            yield {
                "text": torch.randint(
                    0, m.vocab_size, (lay.micro_batch, m.seq_length + 1), generator=gen
                )
            }

    data, timers, seconds = batches(), Timers(), []
    saved = LiveActivations(backend.model.parameters())
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        with saved:
            backend.train_step(data, lay.num_micro_batches, timers)
        seconds.append(time.perf_counter() - start)
    out = {"stage": state.pp_rank, "activations": saved.peak, **_state_bytes(backend)}
    out["seconds"] = sum(seconds[1:]) / max(1, len(seconds) - 1)
    destroy_model_parallel(state)
    return out


def _worker(rank: int, world: int, layouts, steps: int):
    import torch

    torch.manual_seed(0)
    calibration = _calibrate(rank)
    cfg, results = base_config(), []
    from megatron.planning.enumerate import candidate

    start = time.perf_counter()
    for i, lay in enumerate(layouts):
        results.append(_run_layout(candidate(cfg, world, lay), lay, steps))
        if rank == 0:
            elapsed = time.perf_counter() - start
            print(f"[{elapsed:6.0f} s] {i + 1}/{len(layouts)} {lay.describe()}", file=sys.stderr)
    return calibration, results


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


MEASURED = ("parameters", "gradients", "optimizer", "activations")


def _hardware(calibrations):
    from megatron.planning.timing import Hardware

    def median(key):
        values = sorted(c[key] for c in calibrations)
        return values[len(values) // 2]

    gbps = median("gbps")
    return Hardware(
        peak_tflops=median("flops") / 1e12,
        matmul_efficiency=1.0,
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
        memory_gbps=10.0,
        gpus_per_node=WORLD,
        latency_s=median("latency"),
        layer_overhead_s=median("layer"),
    )


def compare(cfg, layouts, runs, hw) -> list[dict]:
    """One row per layout: the worst rank's memory error, predicted vs measured step time."""
    from megatron.planning.enumerate import training_of
    from megatron.planning.pipeline_memory import stage_memory
    from megatron.planning.timing import step_time

    t, dev, rows = training_of(cfg), cpu_device(cfg), []
    for i, lay in enumerate(layouts):
        worst, peak_pred, peak_meas = 0.0, 0, 0
        for rank_runs in runs:
            got = rank_runs[i]
            pred = stage_memory(cfg.model, lay, t, dev, got["stage"])
            p, g = sum(pred[k] for k in MEASURED), sum(got[k] for k in MEASURED)
            worst = max(worst, abs(p - g) / g)
            peak_pred, peak_meas = max(peak_pred, p), max(peak_meas, g)
        rows.append(
            {
                "layout": lay.describe(),
                "pred_mib": peak_pred / 2**20,
                "meas_mib": peak_meas / 2**20,
                "worst_err": worst,
                "pred_s": sum(step_time(cfg.model, lay, t, hw).values()),
                "meas_s": max(r[i]["seconds"] for r in runs),
            }
        )
    return rows


def select_layouts(cfg, quick: bool, everything: bool):
    """Every layout the planner ranks (--all); by default every TP x PP x V x SP layout at
    micro batch 1 without recompute, and for each TP x PP also micro batch 2, selective and
    full recompute one at a time (--quick: only the former)."""
    from megatron.planning.enumerate import Search, layouts

    search = Search(WORLD, 1e9, micro_batches=(1, 2), recompute=(None, "selective", "full"))
    found = layouts(cfg, search)[0]
    if everything:
        return found

    def plain(x):
        return x.micro_batch == 1 and x.recompute is None

    def variant(x):
        one_change = (x.micro_batch == 2) != (x.recompute is not None)
        return x.vp is None and not x.sequence_parallel and one_change

    return [x for x in found if plain(x) or (not quick and variant(x))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="micro batch 1, no recompute")
    parser.add_argument("--all", action="store_true", help="every layout (slow on 2 cores)")
    parser.add_argument("--steps", type=int, default=2, help="steps per layout (2)")
    parser.add_argument("--save", metavar="JSON", help="also write the measurements here")
    parser.add_argument("--load", metavar="JSON", help="predict for saved measurements, no runs")
    args = parser.parse_args(argv)
    from megatron.planning.memory import Layout
    from tests.helpers.distributed import run_distributed

    cfg = base_config()
    layouts = select_layouts(cfg, args.quick, args.all)
    if args.load:  # re-predict for measurements saved by an earlier run
        with open(args.load) as f:
            saved = json.load(f)
        layouts, results, elapsed = [Layout(**x) for x in saved["layouts"]], saved["results"], 0.0
    else:
        start = time.perf_counter()
        results = run_distributed(_worker, WORLD, layouts, args.steps, timeout=3600)
        elapsed = time.perf_counter() - start
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"layouts": [dataclasses.asdict(x) for x in layouts], "results": results}, f)
    hw = _hardware([r[0] for r in results])
    rows = compare(cfg, layouts, [r[1] for r in results], hw)
    print("| layout | predicted MiB | measured MiB | worst rank error | predicted s | measured s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['layout']} | {r['pred_mib']:.2f} | {r['meas_mib']:.2f} | "
            f"{r['worst_err'] * 100:.2f}% | {r['pred_s']:.3f} | {r['meas_s']:.3f} |"
        )
    rho = spearman([r["pred_s"] for r in rows], [r["meas_s"] for r in rows])
    worst = max(r["worst_err"] for r in rows)
    print(
        f"\n{len(rows)} layouts on {WORLD} gloo ranks in {elapsed:.0f} s; "
        f"memory: worst error {worst * 100:.2f}% over every rank of every layout; step time: "
        f"Spearman rank correlation {rho:.3f} (calibrated: {hw.peak_tflops * 1e3:.1f} GFLOP/s per "
        f"rank, layer cost {hw.layer_overhead_s * 1e3:.2f} ms, all-reduce "
        f"{hw.latency_s * 1e3:.2f} ms + {hw.intra_node_gbps:.2f} GB/s)"
    )
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
