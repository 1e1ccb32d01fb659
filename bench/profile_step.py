"""Where a training step's time goes: GPU kernels by category, and how busy the GPU is.

    python bench/profile_step.py [--shape gpt2-small-b16] [--flags='--torch-compile ...']
                                 [--steps 5] [--trace FILE]
    python bench/profile_step.py --smoke        (the CPU: a tiny shape, CPU ops)

Builds the trainer's own step as bench/mfu.py does (pretrain_gpt2.py's parser and
build_backend, bf16) with the extra trainer flags of `--flags`, runs warm-up steps,
then profiles `--steps` steps with torch.profiler. Prints, per category (matmul, attention,
norm, activation, cross-entropy, optimizer, copies/elementwise, communication, other), the
device time per step and its share, then the 20 longest kernels, and the GPU busy fraction:
the summed kernel time over the wall time of a step. A busy fraction well under 100% means the
step is bound by the host (launch overhead, syncs): CUDA graphs or compilation help there;
near 100%, only faster or fewer kernels do.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# First match wins: (category, substrings of a kernel's lower-cased name).
CATEGORIES = [
    ("communication", ("nccl", "allreduce", "all_reduce", "gloo")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn", "efficient_attention")),
    (
        "cross-entropy",
        ("cross_entropy", "nll_loss", "log_softmax", "logsumexp", "row_max", "sum_exp"),
    ),
    ("optimizer", ("adam", "foreach", "multi_tensor", "clip", "norm_kernel", "amp_")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "mm_", "addmm", "bmm")),
    ("norm", ("layer_norm", "layernorm", "rms", "_norm")),
    ("activation", ("gelu", "swiglu", "silu")),
    ("copies/elementwise", ("copy", "elementwise", "fill", "cat", "index", "triton_", "memcpy")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def device_events(prof, device: torch.device):
    """(name, microseconds) of each kernel (CUDA) or top-level op (CPU) the profiler saw."""
    out = []
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type == torch.autograd.DeviceType.CUDA:
                out.append((e.name, e.device_time))
        elif e.cpu_parent is None:
            out.append((e.name, e.cpu_time))
    return out


def report(events, steps: int, wall_s: float) -> None:
    by_cat, by_name = defaultdict(float), defaultdict(float)
    for name, us in events:
        by_cat[category(name)] += us / steps
        by_name[name] += us / steps
    busy = sum(by_cat.values())
    step_ms = 1000 * wall_s / steps
    print(f"\nstep wall {step_ms:.2f} ms; kernels {busy / 1000:.2f} ms per step", flush=True)
    print(f"{'category':22s} {'ms/step':>9s} {'share':>7s}")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"{cat:22s} {us / 1000:9.3f} {100 * us / max(busy, 1e-9):6.1f}%")
    print("\nlongest kernels (ms per step):")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {us / 1000:8.3f}  {category(name):18s} {name[:110]}")
    print(
        f"HEADLINE busy {100 * busy / 1000 / step_ms:.0f}% of a {step_ms:.1f} ms step; top: "
        + ", ".join(
            f"{c} {us / 1000:.1f} ms" for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])[:4]
        )
    )


def build(shape_name: str, flags: str, device: torch.device, steps: int):
    """The trainer's own step (bench/mfu_ours.py: the flags go through pretrain_gpt2.py's
    parser and build_backend) and an endless iterator over the shape's batches."""
    from bench.mfu_common import SHAPES, batch_iterator
    from bench.mfu_ours import build_step, parse_config, shape_argv

    shape = SHAPES[shape_name]
    cfg = parse_config(shape_argv(shape, steps) + shlex.split(flags))
    step, _, note = build_step(cfg, device)

    return step, batch_iterator(shape, device), note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpt2-small-b16", help="a shape of bench/mfu_common.py")
    p.add_argument("--flags", default="", help="pretrain_gpt2.py flags, e.g. '--torch-compile'")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--trace", help="write a chrome trace here")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny shape")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.warmup, args.steps = "tiny", 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    step, it, note = build(args.shape, args.flags, device, args.warmup + args.steps)
    print(f"device {device}; {args.shape}; flags: {args.flags or '(defaults)'}; {note}", flush=True)
    for _ in range(args.warmup):
        step(it)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            step(it)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    if args.trace:
        prof.export_chrome_trace(args.trace)
    report(device_events(prof, device), args.steps, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
