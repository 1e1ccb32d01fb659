"""Rank the parallel layouts of a GPT for a cluster: predicted memory per GPU, step time, MFU.

    python tools/plan_parallel.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 1024 --vocab-size 50304 --global-batch-size 512 --bf16 \
        --world-size 8 --gpus-per-node 8 --gpu-memory 32 --peak-tflops 125
    python tools/plan_parallel.py -c examples/configs/gpt3_1.3b_dp.yaml --world-size 16 ...

Takes every training flag (or a run config) for the model, batch and precision; every layout
the training rules accept is listed (megatron/planning), those that fit first, fastest first.
Context parallelism is enumerated too (--context-parallel-size N fixes it). Exit 1 with the
smallest fix when no layout is valid or none fits. With no arguments it plans EXAMPLE (the
first command above) and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.path.pardir))

from megatron.config.cli import build_parser, resolve  # noqa: E402
from megatron.config.declare import ConfigError  # noqa: E402
from megatron.planning.auto import given_schedule  # noqa: E402
from megatron.planning.enumerate import Search, best_plan  # noqa: E402
from megatron.planning.memory import Device, GiB  # noqa: E402
from megatron.planning.timing import Hardware  # noqa: E402
from megatron.schedules.registry import Names, is_default  # noqa: E402

# The first command of the module doc: a 1.3B GPT on one node of 8 32-GiB GPUs.
EXAMPLE = (
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 "
    "--vocab-size 50304 --global-batch-size 512 --bf16 "
    "--world-size 8 --gpus-per-node 8 --gpu-memory 32 --peak-tflops 125"
).split()


def _parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.description = __doc__.split("\n")[0]
    g = parser.add_argument_group("planner")
    g.add_argument("--world-size", type=int, required=True, help="GPUs in the job")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (8)")
    g.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU, e.g. 80")
    g.add_argument("--matmul-efficiency", type=float, default=0.55, help="achieved / peak (0.55)")
    g.add_argument("--intra-node-bandwidth", type=float, default=240.0, help="GB/s (240)")
    g.add_argument("--inter-node-bandwidth", type=float, default=23.0, help="GB/s per GPU (23)")
    g.add_argument("--framework-overhead", type=float, default=1.0, help="GiB per GPU (1.0)")
    g.add_argument("--top", type=int, default=15, help="rows of the table (15; 0: all)")
    g.add_argument(
        "--pipeline-schedules",
        nargs="+",
        default=[],
        choices=Names(lambda s: not is_default(s)),
        help="zero-bubble schedules to try too at PP > 1 (--pipeline-schedule given: only it)",
    )
    return parser


def _table(ranked, top: int) -> str:
    head = f"{'#':>3} {'layout':<34} {'GiB/GPU':>8} {'fits':>4} {'step s':>9} {'MFU':>6}  limit"
    rows = [head, "-" * len(head)]
    for i, p in enumerate(ranked[: top or None], 1):
        rows.append(
            f"{i:>3} {p.layout.describe():<34} {p.memory.total / GiB:>8.2f} "
            f"{'yes' if p.fits else 'no':>4} {p.step_s:>9.3f} {p.mfu * 100:>5.1f}%  {p.limit}"
        )
    return "\n".join(rows)


def _terms(p) -> str:
    mem = "  ".join(f"{k} {v / GiB:.2f}" for k, v in p.memory.terms.items())
    time = "  ".join(f"{k} {v:.3f}" for k, v in p.time.items())
    return f"memory GiB (stage {p.memory.stage}): {mem}\ntime s: {time}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(
            "No model given: planning the example, a 1.3B GPT on 8 GPUs of 32 GiB:\n"
            f"  python tools/plan_parallel.py {' '.join(EXAMPLE)}\n"
            "Give your model's flags (or -c RUN.yaml), --world-size and --gpu-memory; "
            "--help lists every flag.\n"
        )
        argv = EXAMPLE
    ns = _parser().parse_args(argv)
    try:
        cfg = resolve(ns, ns.world_size)
        if cfg.model.vocab_size is None:
            raise ConfigError("--vocab-size: the planner needs it (it builds no tokenizer)")
        hw = Hardware(
            peak_tflops=cfg.logging.peak_tflops or Hardware.peak_tflops,
            matmul_efficiency=ns.matmul_efficiency,
            intra_node_gbps=ns.intra_node_bandwidth,
            inter_node_gbps=ns.inter_node_bandwidth,
            gpus_per_node=ns.gpus_per_node,
        )
        device = Device(overhead_bytes=int(ns.framework_overhead * GiB))
        cp = cfg.parallel.context_parallel_size  # given: fixed; else CP is enumerated
        search = Search(ns.world_size, ns.gpu_memory, hw, device)
        search = dataclasses.replace(search, schedules=tuple(ns.pipeline_schedules))
        search = dataclasses.replace(search, **given_schedule(cfg))
        if cp > 1:
            search = dataclasses.replace(search, context_parallel=(cp,))
        best, ranked = best_plan(cfg, search)
    except ValueError as e:  # ConfigError and PlanError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_table(ranked, ns.top))
    print(f"\nbest: {best.layout.describe()}\n{_terms(best)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
