"""Fused kernels, ours and Liger-Kernel's, against torch eager and torch.compile, per pass.

    .venv/bin/python bench/kernels.py [--dtype bf16] [--ops norms,mlp] [--widths 768,1024,2048]
                                      [--skip-compile] [--skip-liger] [--skip-e2e]
    .venv/bin/python bench/kernels.py --smoke   (CPU, tiny shapes, Triton's interpreter, seconds)

Each op (bench/kernel_cases.py) at the GPT-2 small / medium / 1.3B widths (8192 rows, hidden
768 / 1024 / 2048, the MLP 4x that) and each pass alone: forward (recording autograd, as in
training), backward (from the saved tensors) and both. Times are GPU time: the median of
triton.testing.do_bench, which flushes the L2 cache before each run, so neither a warm cache
nor the CPU's launch cost counts; the CPU side is shown apart as "host us" (one forward +
backward call of ours, timed on the CPU while the GPU is busy: what CUDA graphs remove).
"% copy" = the op's minimum traffic (each input read once, each output written once; per op in
bench/kernel_cases.py) / time / the measured device-to-device copy bandwidth; the goal for the
memory-bound kernels is >= 70%. Ends with the GPT-2 small training step with torch ops, our
kernels, Liger's, and torch.compile per layer, then a HEADLINE line.
"""

import argparse
import math
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # Triton reads this when its kernels are defined (imported)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernel_cases import IMPLS, TRAFFIC, cases  # noqa: E402
from megatron.fused_kernels import liger  # noqa: E402

DEVICE = torch.device("cpu" if "--smoke" in sys.argv else "cuda")
PASSES = ("fwd", "bwd", "fwd+bwd")
SIZES = {
    "gpu": {
        "softmax": ((8, 12, 1024), (4, 16, 2048), (2, 32, 2048)),  # (b, heads, s)
        "rows": 8192,
        "hidden": (768, 1024, 2048),
        "vocab": ((8192, 50304), (4096, 128000)),  # (rows, vocab)
    },
    "smoke": {"softmax": ((1, 2, 16),), "rows": 16, "hidden": (32,), "vocab": ((16, 64),)},
}


def gpu_seconds(fn) -> float:
    """Median GPU seconds of fn() (do_bench: L2 flushed each run); on the CPU one timed run."""
    if DEVICE.type != "cuda":  # --smoke: exercised once, not measured
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5])
    return (ms[0] if isinstance(ms, (list, tuple)) else ms) / 1000


def host_us(fn, calls: int = 20) -> float:
    """CPU microseconds per fn() while the GPU is kept busy (launch cost alone)."""
    if DEVICE.type != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work ahead of the calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def copy_bandwidth(dtype) -> float:
    n = 256 * 2**20 // 2 if DEVICE.type == "cuda" else 2**20
    x = torch.empty(n, dtype=dtype, device=DEVICE)
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / gpu_seconds(lambda: y.copy_(x)) / 1e9


def pass_fns(fn, inputs) -> dict:
    """{pass: callable} for one implementation: forward, backward (retain_graph), both."""
    leaves = [t for t in inputs if t.requires_grad]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]

    def fwd():
        return fn(*inputs)

    def bwd():
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

    def both():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(out, leaves, grads, allow_unused=True)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


def measure(case, passes, notes: dict) -> list[dict]:
    """One row per pass: {impl: seconds or None}, host us of ours, bytes."""
    times = {p: {} for p in passes}
    host = float("nan")
    for impl in IMPLS:
        fn = case.impls[impl]
        if fn is None:
            continue
        try:
            fns = pass_fns(fn, case.inputs)
            for p in passes:
                times[p][impl] = _pass_seconds(fns, p, passes, times, impl, notes, case.op)
            if impl == "ours":
                host = host_us(fns["fwd+bwd"])
        except Exception as e:  # one failing implementation must not end the benchmark
            notes.setdefault(f"{impl} {case.op}", f"{type(e).__name__}: {str(e)[:160]}")
            for p in passes:
                times[p].pop(impl, None)
    return [
        {"op": case.op, "shape": case.shape, "pass": p, "t": times[p], "host": host}
        | {"bytes": case.bytes[p]}
        for p in passes
    ]


def _pass_seconds(fns, p, passes, times, impl, notes, op) -> float:
    """The pass's time; a backward that cannot run twice on one graph (it overwrites its saved
    tensors, as the torch vocab-parallel cross-entropy does) is timed as (fwd+bwd) - fwd."""
    try:
        return gpu_seconds(fns[p])
    except RuntimeError as e:
        if p != "bwd" or "inplace" not in str(e) or "fwd" not in passes:
            raise
    both = gpu_seconds(fns["fwd+bwd"])
    notes[f"{impl} {op} bwd"] = "timed as (fwd+bwd) - fwd: its backward reuses saved tensors"
    return max(both - times["fwd"][impl], 0.0)


def fmt_row(row, peak) -> str:
    t = row["t"]
    ms = [f"{1000 * t[i]:8.3f}" if i in t else f"{'-':>8s}" for i in IMPLS]
    pct = [f"{share(row, i, peak):6.0f}%" if i in t else f"{'-':>7s}" for i in IMPLS]
    host = "" if math.isnan(row["host"]) else f"{row['host']:8.0f}"
    label = f"{row['op']:15s} {row['shape']:13s} {row['pass']:7s}"
    return f"{label} | {' '.join(ms)} | {' '.join(pct)} | {host}"


def share(row, impl, peak) -> float:
    return 100 * row["bytes"] / row["t"][impl] / 1e9 / peak


def header() -> str:
    names = " ".join(f"{i:>8s}" for i in IMPLS)
    pcts = " ".join(f"{i[:6]:>7s}" for i in IMPLS)
    return f"{'op':15s} {'shape':13s} {'pass':7s} | {names} | {pcts} | host us\n" + (
        f"{'':37s} | {'ms':^35s} | {'% of copy bandwidth':^31s} | ours"
    )


def end_to_end(dtype, smoke: bool, with_liger: bool) -> list[tuple[str, float]]:
    import dataclasses

    from bench.train_step import build_ours
    from megatron.config.schema import ModelConfig
    from megatron.config.schema_kernels import KernelConfig
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
    base = KernelConfig()
    fused = dataclasses.replace(base, cross_entropy_loss_fusion=True)
    torch_ops = dataclasses.replace(
        base, layer_norm_fusion=False, bias_gelu_fusion=False, bias_swiglu_fusion=False
    )
    variants = [
        ("torch ops (SDPA)", torch_ops),
        ("our kernels (SDPA + Triton norms/GeLU/CE)", fused),
        # inductor's own kernels for the norms and GeLU: the alternative to ours, not mixed in
        ("torch.compile per layer (torch ops)", dataclasses.replace(torch_ops, torch_compile=True)),
    ]
    if with_liger and smoke:  # Liger's norms do not run in Triton's interpreter
        print("  (smoke: the Liger step skipped: its norm kernels need a GPU)")
    elif with_liger:
        liger_cfg = dataclasses.replace(fused, kernel_library="liger")
        variants.insert(2, ("Liger kernels (+ our GeLU/CE)", liger_cfg))
    rows = []
    for label, k in variants:
        if smoke and k.torch_compile:
            print("  (smoke: torch.compile per layer skipped: inductor takes minutes on a CPU)")
            continue
        ops = select_ops(k, DEVICE, follow_table=False)  # each label's own kernels
        step = build_ours(cfg, DEVICE, dtype, ops=ops, torch_compile=k.torch_compile)
        batches = iter(lambda: (tokens, tokens), None)
        if not smoke:
            step(batches)  # warm-up: compiles and autotunes
            torch.cuda.synchronize()
        times = []
        for _ in range(1 if smoke else 10):
            start = time.perf_counter()
            step(batches)
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append((f"{label} [{ops.describe().split(': ', 1)[1]}]", statistics.median(times)))
    return rows


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--ops",
        default="softmax,norms,mlp,cross_entropy",
        help="comma-separated op groups: softmax, norms (add + LayerNorm / RMSNorm), mlp "
        "(bias + GeLU, SwiGLU), cross_entropy (default: all)",
    )
    p.add_argument("--widths", default=None, help="hidden sizes (default: 768,1024,2048)")
    p.add_argument("--passes", default=",".join(PASSES), help="fwd, bwd, fwd+bwd (default all)")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile column")
    p.add_argument("--skip-liger", action="store_true", help="no Liger-Kernel column / step")
    p.add_argument("--skip-e2e", action="store_true", help="no GPT-2 small training step")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    return p.parse_args()


def main():
    args = parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit(
            "bench/kernels.py needs a CUDA GPU (the kernels' correctness tests run on the CPU "
            "under TRITON_INTERPRET=1: make test; --smoke runs this script there at tiny sizes)."
        )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    sizes = dict(SIZES["smoke" if args.smoke else "gpu"])
    if args.widths:
        sizes["hidden"] = tuple(int(w) for w in args.widths.split(","))
    with_liger = not args.skip_liger and liger.missing_reason() is None
    # On the CPU inductor's C++ codegen takes minutes: "eager" still runs dynamo's capture.
    backend = None if args.skip_compile else ("eager" if args.smoke else "inductor")
    peak = copy_bandwidth(dtype)
    name = "CPU (smoke: figures mean nothing)" if args.smoke else torch.cuda.get_device_name()
    print(f"device: {name}  copy bandwidth: {peak:.0f} GB/s  dtype: {args.dtype}")
    if not with_liger:
        print(
            f"liger column empty: {'--skip-liger' if args.skip_liger else liger.missing_reason()}"
        )
    passes = [p for p in PASSES if p in args.passes.split(",")]
    rows, notes = [], {}
    ops = set(args.ops.split(","))
    for case in cases(dtype, DEVICE, sizes, ops, backend, with_liger):
        for row in measure(case, passes, notes):
            rows.append(row)
            print(fmt_row(row, peak), file=sys.stderr, flush=True)
    print(f"\n% of copy bandwidth counts each pass's minimum traffic:\n{TRAFFIC}")
    print(header())
    for row in rows:
        print(fmt_row(row, peak))
    for what, why in notes.items():
        print(f"note: {what} did not run: {why}")
    summary(rows, peak, args, dtype, with_liger)


def worst_by_op(rows, peak) -> None:
    """The final table: per op and pass, each implementation's lowest % of copy bandwidth over
    the shapes (the number the goal is about)."""
    print(f"\n{'op':15s} {'pass':7s} | lowest % of copy bandwidth over the shapes")
    print(f"{'':23s} | " + " ".join(f"{i:>8s}" for i in IMPLS))
    keys = dict.fromkeys((r["op"], r["pass"]) for r in rows)
    for op, p in keys:
        group = [r for r in rows if (r["op"], r["pass"]) == (op, p)]
        cells = []
        for impl in IMPLS:
            shares = [share(r, impl, peak) for r in group if impl in r["t"]]
            cells.append(f"{min(shares):7.0f}%" if shares else f"{'-':>8s}")
        print(f"{op:15s} {p:7s} | {' '.join(cells)}")


def summary(rows, peak, args, dtype, with_liger):
    worst_by_op(rows, peak)
    ours = [r for r in rows if "ours" in r["t"]]
    worst = min(ours, key=lambda r: share(r, "ours", peak), default=None)
    slower = [
        f"{r['op']} {r['shape']} {r['pass']}"
        for r in ours
        if any(r["t"][i] < r["t"]["ours"] for i in ("eager", "compile") if i in r["t"])
    ]
    print(f"ours slower than eager or compile in {len(slower)} of {len(ours)} rows", end="")
    print(f": {'; '.join(slower[:12])}{' ...' if len(slower) > 12 else ''}" if slower else "")
    e2e = ""
    if not args.skip_e2e:
        what = "a 2-layer toy GPT" if args.smoke else "GPT-2 small, batch 8 x 1024"
        print(f"\nend to end: {what}, training step")
        steps = end_to_end(dtype, args.smoke, with_liger)
        for label, seconds in steps:
            print(f"  {1000 * seconds:8.1f} ms  {label}")
        e2e = "; step " + ", ".join(f"{lb.split(' [')[0]} {1000 * t:.1f} ms" for lb, t in steps)
    if worst is None:
        print(f"HEADLINE no kernel of ours measured{e2e}")
        return
    print(
        f"HEADLINE slowest kernel of ours {worst['op']} {worst['shape']} {worst['pass']} at "
        f"{share(worst, 'ours', peak):.0f}% of copy bandwidth; ours slower than eager/compile "
        f"in {len(slower)}/{len(ours)} rows{e2e}"
    )


if __name__ == "__main__":
    main()
