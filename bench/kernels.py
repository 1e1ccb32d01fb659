"""Fused Triton kernels against torch eager and torch.compile, on a CUDA GPU.

    .venv/bin/python bench/kernels.py [--dtype bf16] [--skip-compile] [--skip-e2e]
    .venv/bin/python bench/kernels.py --smoke   (CPU, tiny shapes, Triton's interpreter)

For each op and a few realistic shapes (GPT-2 small .. 1.3B, seq 1024-2048) prints the forward
time of the Triton kernel, torch eager and torch.compile, and the Triton kernel's achieved
bandwidth next to the device's measured copy bandwidth (the ceiling for these memory-bound
ops; the goal is >= 70% of it). Then the end-to-end training step time of GPT-2 small with the
torch ops and with the fused ops. Needs CUDA: Triton's CPU interpreter is for correctness only.
"""

import argparse
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # Triton reads this when its kernels are defined (imported)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.fused_kernels import reference  # noqa: E402
from megatron.fused_kernels import triton_activations as acts  # noqa: E402
from megatron.fused_kernels import triton_cross_entropy as xent  # noqa: E402
from megatron.fused_kernels import triton_norms as norms  # noqa: E402
from megatron.fused_kernels import triton_softmax as softmax  # noqa: E402
from megatron.mpu import vocab_parallel_cross_entropy  # noqa: E402

DEVICE = torch.device("cpu" if "--smoke" in sys.argv else "cuda")
# (b, heads, s) of the softmax; (rows, hidden) of the norms and activations; (rows, vocab).
SHAPES = {
    "gpu": (
        ((8, 12, 1024), (4, 16, 2048), (2, 32, 2048)),
        ((8192, 768), (8192, 1024), (8192, 2048)),
        ((8192, 50304), (4096, 128000)),
    ),
    "smoke": (((1, 2, 16),), ((16, 32),), ((16, 64),)),
}


def timed(fn, iters: int = 20) -> float:
    """Median seconds of fn() after warm-up (CUDA events on the GPU, a clock on the CPU)."""
    if DEVICE.type != "cuda":  # --smoke: exercised, not measured
        iters = 1
    for _ in range(3 if DEVICE.type == "cuda" else 1):
        fn()
    times = []
    for _ in range(iters):
        if DEVICE.type != "cuda":
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def copy_bandwidth(dtype) -> float:
    n = 256 * 2**20 // 2 if DEVICE.type == "cuda" else 2**20
    x = torch.empty(n, dtype=dtype, device=DEVICE)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / t / 1e9


def cases(dtype, sizes):
    """(op, shape label, triton fn, torch fn, bytes moved by one forward)."""

    def r(*shape):
        return torch.randn(*shape, dtype=dtype, device=DEVICE)

    e = torch.finfo(dtype).bits // 8
    out = []
    softmax_shapes, row_shapes, vocab_shapes = sizes
    for b, h, s in softmax_shapes:
        x = r(b, h, s, s)
        out.append(
            (
                "causal softmax",
                f"b{b} h{h} s{s}",
                lambda x=x: softmax.scaled_upper_triang_masked_softmax(x, 0.125),
                lambda x=x: reference.torch_scaled_upper_triang_masked_softmax(x, 0.125),
                2 * x.numel() * e,
            )
        )
    for rows, hidden in row_shapes:
        x, res, w, bias = r(rows, hidden), r(rows, hidden), r(hidden), r(hidden)
        out.append(
            (
                "add + LayerNorm",
                f"{rows}x{hidden}",
                lambda x=x, res=res, w=w, b=bias: norms.fused_add_layer_norm(x, res, w, b, 1e-5),
                lambda x=x, res=res, w=w, b=bias: norms.torch_add_layer_norm(x, res, w, b, 1e-5),
                4 * x.numel() * e,
            )
        )
        out.append(
            (
                "add + RMSNorm",
                f"{rows}x{hidden}",
                lambda x=x, res=res, w=w: norms.fused_add_rms_norm(x, res, w, 1e-5),
                lambda x=x, res=res, w=w: norms.torch_add_rms_norm(x, res, w, 1e-5),
                4 * x.numel() * e,
            )
        )
        y, yb = r(rows, 4 * hidden), r(4 * hidden)
        out.append(
            (
                "bias + GeLU",
                f"{rows}x{4 * hidden}",
                lambda y=y, yb=yb: acts.bias_gelu(y, yb),
                lambda y=y, yb=yb: acts.torch_bias_gelu(y, yb),
                2 * y.numel() * e,
            )
        )
        z = r(rows, 2 * 4 * hidden)
        out.append(
            (
                "SwiGLU",
                f"{rows}x{2 * 4 * hidden}",
                lambda z=z: acts.swiglu(z),
                lambda z=z: acts.torch_swiglu(z),
                3 * z.numel() // 2 * e,
            )
        )
    for rows, vocab in vocab_shapes:
        logits = r(rows, vocab)
        target = torch.randint(0, vocab, (rows,), device=DEVICE)
        out.append(
            (
                "cross-entropy",
                f"{rows}x{vocab}",
                lambda lg=logits, t=target: xent.vocab_parallel_cross_entropy_fused(lg, t),
                lambda lg=logits, t=target: vocab_parallel_cross_entropy(lg, t),
                2 * logits.numel() * e,
            )
        )
    return out


def end_to_end(dtype, smoke: bool) -> list[tuple[str, float]]:
    import dataclasses

    from bench.train_step import build_ours
    from megatron.config.schema import KernelConfig, ModelConfig
    from megatron.fused_kernels import select_ops

    layers, hidden, heads, seq, vocab, batch = (
        (2, 32, 4, 16, 128, 2) if smoke else (12, 768, 12, 1024, 50257, 8)
    )
    cfg = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=vocab,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    tokens = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    rows = []
    kernels = KernelConfig()
    for label, k in (
        ("torch ops (SDPA)", kernels),
        (
            "fused ops (SDPA + Triton norms/GeLU/CE)",
            dataclasses.replace(kernels, cross_entropy_loss_fusion=True),
        ),
        ("torch.compile per layer", dataclasses.replace(kernels, torch_compile=True)),
    ):
        if smoke and k.torch_compile:
            print("  (smoke: torch.compile per layer skipped: inductor takes minutes on a CPU)")
            continue
        ops = select_ops(k, DEVICE)
        step = build_ours(cfg, DEVICE, dtype, ops=ops, torch_compile=k.torch_compile)

        def batches():
            while True:
                yield tokens, tokens

        it = batches()
        rows.append((label, timed(lambda step=step, it=it: step(it), iters=10)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit(
            "bench/kernels.py needs a CUDA GPU (the kernels' correctness tests run on the CPU "
            "under TRITON_INTERPRET=1: make test; --smoke runs this script there at tiny sizes)."
        )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # On the CPU inductor's C++ codegen takes minutes: "eager" still runs dynamo's capture.
    backend = "eager" if args.smoke else "inductor"
    peak = copy_bandwidth(dtype)
    name = "CPU (smoke: figures mean nothing)" if args.smoke else torch.cuda.get_device_name()
    print(f"device: {name}  copy bandwidth: {peak:.0f} GB/s  dtype: {args.dtype}\n")
    print(
        f"{'op':16s} {'shape':20s} | {'triton ms':>9s} {'eager ms':>9s} {'compile ms':>10s}"
        f" | {'triton GB/s':>11s} {'% of copy':>9s}"
    )
    worst = None
    for op, shape, fused, eager, nbytes in cases(dtype, SHAPES["smoke" if args.smoke else "gpu"]):
        t_fused, t_eager = timed(fused), timed(eager)
        t_comp = float("nan") if args.skip_compile else timed(torch.compile(eager, backend=backend))
        bw = nbytes / t_fused / 1e9
        share = 100 * bw / peak
        if worst is None or share < worst[0]:
            worst = (share, f"{op} {shape}")
        print(
            f"{op:16s} {shape:20s} | {1000 * t_fused:9.3f} {1000 * t_eager:9.3f} "
            f"{1000 * t_comp:10.3f} | {bw:11.0f} {share:8.0f}%"
        )
    e2e = ""
    if not args.skip_e2e:
        what = "a 2-layer toy GPT" if args.smoke else "GPT-2 small, batch 8 x 1024"
        print(f"\nend to end: {what}, training step")
        rows = end_to_end(dtype, args.smoke)
        for label, seconds in rows:
            print(f"  {label:45s} {1000 * seconds:8.1f} ms")
        e2e = "; step " + ", ".join(f"{label} {1000 * t:.1f} ms" for label, t in rows)
    print(f"HEADLINE slowest kernel {worst[1]} at {worst[0]:.0f}% of copy bandwidth{e2e}")


if __name__ == "__main__":
    main()
