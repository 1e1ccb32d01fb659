"""Compile every Triton kernel config (norms, activations, softmax) for a GPU, without a GPU.

    .venv/bin/python bench/kernel_compile.py [--arch 90] [--dtype bf16] [--first-only]

Triton's front end, LLVM and the bundled ptxas build each (kernel, config) the autotuner may
pick at the GPT-2 widths, exactly as the first call on an H100 would: an error here is an error
there, found on the CPU. Prints registers and spill bytes per config (cuobjdump's resource
usage), so configs that spill can be seen before any GPU time is spent.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("bench/kernel_compile.py compiles for the GPU: unset TRITON_INTERPRET")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron.fused_kernels import triton_activations as acts  # noqa: E402
from megatron.fused_kernels import triton_norms as norms  # noqa: E402
from megatron.fused_kernels import triton_softmax as softmax  # noqa: E402

# (label, autotuned kernel, {arg: type or constexpr value}, the prune function's kwargs)
# Types as Triton's signature strings; every int and pointer is taken as 16-divisible, as the
# runtime specializes them for the shapes benchmarked (768, 1024, 2048, 3072 ... 16384).


def _norm_cases(dtype, n_cols):
    p = f"*{dtype}"
    block = triton.next_power_of_2(n_cols)
    fwd = {
        **dict.fromkeys(("x_ptr", "r_ptr", "h_ptr", "w_ptr", "b_ptr", "y_ptr"), p),
        "mean_ptr": "*fp32",
        "rstd_ptr": "*fp32",
        "n_rows": "i32",
        "n_cols": "i32",
        "eps": "fp32",
    }
    bwd = {
        **dict.fromkeys(("dy_ptr", "h_ptr", "w_ptr", "dh_in_ptr", "dh_ptr"), p),
        **dict.fromkeys(("mean_ptr", "rstd_ptr", "dw_part_ptr", "db_part_ptr"), "*fp32"),
        **dict.fromkeys(("n_rows", "n_cols", "rows_per_program"), "i32"),
    }
    for rms in (False, True):
        name = "RMSNorm" if rms else "LayerNorm"
        flags = {"HAS_BIAS": not rms, "IS_RMS": rms, "BLOCK_N": block}
        yield f"add+{name} fwd", norms._norm_fwd_kernel, fwd, {**flags, "HAS_RESIDUAL": True}
        yield f"add+{name} bwd", norms._norm_bwd_kernel, bwd, {**flags, "HAS_DH_IN": True}


def _act_cases(dtype, n_cols):
    p = f"*{dtype}"
    block = {"BLOCK_C": min(triton.next_power_of_2(n_cols), acts.MAX_BLOCK)}
    fwd = {"x_ptr": p, "b_ptr": p, "y_ptr": p, "n_rows": "i32", "n_cols": "i32"}
    bwd = {**dict.fromkeys(("x_ptr", "b_ptr", "dy_ptr", "dx_ptr"), p), "db_part_ptr": "*fp32"}
    bwd.update(dict.fromkeys(("n_rows", "n_cols", "rows_per_program"), "i32"))
    yield "bias+GeLU fwd", acts._bias_gelu_fwd_kernel, fwd, {**block, "TANH": False}
    yield "bias+GeLU bwd", acts._bias_gelu_bwd_kernel, bwd, {**block, "TANH": False}
    sw = {"x_ptr": p, "y_ptr": p, "n_rows": "i32", "f": "i32"}
    yield "SwiGLU fwd", acts._swiglu_fwd_kernel, sw, block
    sw_bwd = {"x_ptr": p, "dy_ptr": p, "dx_ptr": p, "n_rows": "i32", "f": "i32"}
    yield "SwiGLU bwd", acts._swiglu_bwd_kernel, sw_bwd, block


def _softmax_cases(dtype, n_cols):
    """The causal softmax (plain triton.jit: one config, the module's launch heuristic)."""
    p = f"*{dtype}"
    block, warps = softmax._launch_config(n_cols)
    ints = ("n_cols", "sq", "heads", "m_stride_b", "m_stride_h", "m_stride_q", "m_stride_k")
    fwd = {"x_ptr": p, "y_ptr": p, "mask_ptr": p, **dict.fromkeys(ints, "i32")}
    fwd.update({"causal_offset": "i32", "scale": "fp32"})
    meta = {"BLOCK": block, "ONE_BLOCK": n_cols <= block}
    cfg = triton.Config({}, num_warps=warps)
    causal = {**meta, "HAS_MASK": False, "CAUSAL": True}
    yield "softmax fwd", softmax._softmax_fwd_kernel, fwd, causal, [cfg]
    bwd = {"y_ptr": p, "dy_ptr": p, "dx_ptr": p, "n_cols": "i32", "scale": "fp32"}
    yield "softmax bwd", softmax._softmax_bwd_kernel, bwd, meta, [cfg]


def _resources(cubin: bytes) -> str:
    """'REG:n STACK:n' of the kernel in `cubin`, from cuobjdump (bundled with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if not os.path.exists(tool):
        return "(no cuobjdump)"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"regs {found[1]:>3s} stack {found[2]:>4s}" if found else "(no resource line)"


def compile_config(kernel, signature, meta, cfg, target):
    """The compiled kernel of `kernel` (an Autotuner, or a plain JITFunction) for one config."""
    jit_fn = kernel.fn if hasattr(kernel, "configs") else kernel  # an Autotuner wraps it
    constants = {**meta, **cfg.kwargs}
    sig = {name: signature.get(name, "constexpr") for name in jit_fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(jit_fn.arg_names)
        if name in signature and (signature[name].startswith("*") or signature[name] == "i32")
    }
    src = ASTSource(fn=jit_fn, signature=sig, constexprs=constants, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=target, options=options)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--widths", default="768,1024,2048", help="hidden sizes (MLP: 4x)")
    p.add_argument("--first-only", action="store_true", help="one config per kernel and width")
    args = p.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for hidden in map(int, args.widths.split(",")):
        cases = [
            *((*case, None) for case in _norm_cases(args.dtype, hidden)),
            *((*case, None) for case in _act_cases(args.dtype, 4 * hidden)),
            *_softmax_cases(args.dtype, hidden),  # as a key length (768 .. 2048)
        ]
        for label, kernel, signature, meta, fixed in cases:
            configs = fixed or kernel.gpu_prune(kernel.gpu_configs, {}, **meta)
            for cfg in configs[:1] if args.first_only else configs:
                what = f"{label:16s} {hidden:6d} {cfg.kwargs} warps {cfg.num_warps:2d}"
                try:
                    compiled = compile_config(kernel, signature, meta, cfg, target)
                except Exception as e:  # report every failure, then exit non-zero
                    failures += 1
                    print(f"FAILED {what}: {type(e).__name__}: {e}", flush=True)
                    continue
                print(f"ok     {what}: {_resources(compiled.asm['cubin'])}", flush=True)
    print(f"{failures} configs failed to compile for sm_{args.arch}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
