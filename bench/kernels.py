"""Fused Triton kernels against torch eager and torch.compile, on a CUDA GPU.

    .venv/bin/python bench/kernels.py [--dtype bf16] [--skip-compile] [--skip-e2e]

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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.fused_kernels import reference  # noqa: E402
from megatron.fused_kernels import triton_activations as acts  # noqa: E402
from megatron.fused_kernels import triton_cross_entropy as xent  # noqa: E402
from megatron.fused_kernels import triton_norms as norms  # noqa: E402
from megatron.fused_kernels import triton_softmax as softmax  # noqa: E402
from megatron.mpu import vocab_parallel_cross_entropy  # noqa: E402


def timed(fn, iters: int = 20) -> float:
    """Median seconds of fn() on the GPU (CUDA events, after warm-up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def copy_bandwidth(dtype) -> float:
    x = torch.empty(256 * 2**20 // 2, dtype=dtype, device="cuda")
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / t / 1e9


def cases(dtype):
    """(op, shape label, triton fn, torch fn, bytes moved by one forward)."""

    def r(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda")

    e = torch.finfo(dtype).bits // 8
    out = []
    for b, h, s in ((8, 12, 1024), (4, 16, 2048), (2, 32, 2048)):
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
    for rows, hidden in ((8192, 768), (8192, 1024), (8192, 2048)):
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
    for rows, vocab in ((8192, 50304), (4096, 128000)):
        logits = r(rows, vocab)
        target = torch.randint(0, vocab, (rows,), device="cuda")
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


def end_to_end(dtype) -> list[tuple[str, float]]:
    import dataclasses

    from bench.train_step import build_ours
    from megatron.config.schema import KernelConfig, ModelConfig
    from megatron.fused_kernels import select_ops

    cfg = ModelConfig(
        num_layers=12,
        hidden_size=768,
        num_attention_heads=12,
        seq_length=1024,
        vocab_size=50257,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    tokens = torch.randint(0, 50257, (8, 1024), device="cuda")
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
        ops = select_ops(k, torch.device("cuda"))
        step = build_ours(cfg, torch.device("cuda"), dtype, ops=ops, torch_compile=k.torch_compile)

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
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench/kernels.py needs a CUDA GPU (the kernels' correctness tests run on the CPU "
            "under TRITON_INTERPRET=1: make test)."
        )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    peak = copy_bandwidth(dtype)
    print(
        f"device: {torch.cuda.get_device_name()}  copy bandwidth: {peak:.0f} GB/s  "
        f"dtype: {args.dtype}\n"
    )
    print(
        f"{'op':16s} {'shape':20s} | {'triton ms':>9s} {'eager ms':>9s} {'compile ms':>10s}"
        f" | {'triton GB/s':>11s} {'% of copy':>9s}"
    )
    for op, shape, fused, eager, nbytes in cases(dtype):
        t_fused, t_eager = timed(fused), timed(eager)
        t_comp = float("nan") if args.skip_compile else timed(torch.compile(eager))
        bw = nbytes / t_fused / 1e9
        print(
            f"{op:16s} {shape:20s} | {1000 * t_fused:9.3f} {1000 * t_eager:9.3f} "
            f"{1000 * t_comp:10.3f} | {bw:11.0f} {100 * bw / peak:8.0f}%"
        )
    if not args.skip_e2e:
        print("\nend to end: GPT-2 small, batch 8 x 1024, training step")
        for label, seconds in end_to_end(dtype):
            print(f"  {label:45s} {1000 * seconds:8.1f} ms")


if __name__ == "__main__":
    main()
