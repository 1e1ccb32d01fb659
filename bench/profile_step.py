"""Where a training step's time goes: GPU kernels by category, and how busy the GPU is.

    python bench/profile_step.py [--layers 12 --hidden 768 --heads 12 --seq 1024 --batch 16]
                                 [--kernel torch_compile=true ...] [--steps 5] [--trace FILE]
    python bench/profile_step.py --smoke        (the CPU: a tiny shape, CPU ops)

Builds our single-process stack as bench/mfu.py does (GPTModel + DDP buffer + MegatronOptimizer,
bf16 on CUDA) with the KernelConfig fields given by `--kernel NAME=VALUE`, runs warm-up steps,
then profiles `--steps` steps with torch.profiler. Prints, per category (matmul, attention,
norm, activation, cross-entropy, optimizer, copies/elementwise, communication, other), the
device time per step and its share, then the 20 longest kernels, and the GPU busy fraction:
the summed kernel time over the wall time of a step. A busy fraction well under 100% means the
step is bound by the host (launch overhead, syncs): CUDA graphs or compilation help there;
near 100%, only faster or fewer kernels do.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.train_step import build_ours  # noqa: E402
from megatron.config.schema import KernelConfig, ModelConfig  # noqa: E402
from megatron.fused_kernels import select_ops  # noqa: E402

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


def parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def kernel_config(pairs: list[str]) -> KernelConfig:
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    kw = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"--kernel {pair}: KernelConfig has no field {name!r} ({fields})")
        kw[name] = parse_value(value)
    return KernelConfig(**kw)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--kernel", action="append", default=[], help="KernelConfig NAME=VALUE")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--trace", help="write a chrome trace here")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab = (
            2,
            64,
            4,
            32,
            2,
            1000,
        )
        args.warmup, args.steps = 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
        max_position_embeddings=args.seq,
        vocab_size=args.vocab,
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kernels = kernel_config(args.kernel)
    ops = select_ops(kernels, device)
    print(f"device {device}; {ops.describe()}; torch_compile={kernels.torch_compile}", flush=True)
    step = build_ours(cfg, device, dtype, ops=ops, torch_compile=kernels.torch_compile)
    g = torch.Generator().manual_seed(0)
    data = [
        tuple(
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
            for _ in range(2)
        )
        for _ in range(4)
    ]

    def batches():
        while True:
            yield from data

    it = batches()
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
