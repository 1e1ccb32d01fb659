"""Fused kernels, chosen once at model build: Triton where it can run, exact torch elsewhere.

Megatron's fused CUDA kernels (scaled masked softmax, layer norm, bias-GeLU) are the first thing
its users fail to build. Here nothing is built at install time: the Triton kernels JIT-compile
on a CUDA device (or run in Triton's interpreter on the CPU when TRITON_INTERPRET=1 is set, which
is how the tests exercise them), and every op has a plain torch implementation with the same
math that is used everywhere else and serves as the reference.

Ops: the attention core (`--attention-backend sdpa|fused|unfused`; fused = Triton scaled causal
softmax, or scaled masked softmax under a document mask), residual-add + LayerNorm/RMSNorm,
bias + GeLU, SwiGLU, and a vocab-parallel cross-entropy that never materializes fp32 logits
(on by default where it runs); `--cross-entropy-fusion-impl linear` fuses the output layer into
the cross-entropy over chunks of tokens (megatron.mpu.linear_cross_entropy), its elementwise
part through the same Triton kernels when the cross-entropy above is Triton. `--kernel-library
liger` takes the norms and SwiGLU from Liger-Kernel instead (liger.py). Under --torch-compile
only the cross-entropy stays Triton: the other ops are left to Inductor, which fuses them with
their neighbours.

A kernel that fails its self-check (a compile or launch error, or a disagreement with its torch
twin) falls back to torch with a warning; under strict mode (`select_ops(..., strict=True)`, or
MEGATRON_KERNELS_STRICT=1 in the environment, which reaches the trainer's processes too) it
raises instead, chained to the original error: what tests and benchmarks that expect the
compiled kernels use, so a fallback cannot pass for a measurement.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from megatron.config.schema_kernels import KernelConfig
from megatron.fused_kernels import liger, reference


def triton_available(device: torch.device) -> bool:
    """Triton is installed and can run here: a CUDA device, or its CPU interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class FusedOps:
    """The implementation picked for each op ("triton": ours, "liger": Liger-Kernel's, or
    "torch"), plus the attention path."""

    attention_backend: str = "sdpa"  # sdpa | fused | unfused
    softmax: str = "torch"
    add_norm: str = "torch"
    bias_gelu: str = "torch"
    swiglu: str = "torch"
    cross_entropy: str = "torch"
    # --bias-dropout-fusion: "compile" (each block's bias + dropout + residual add as one
    # torch.compile'd function, see megatron.model.transformer) or "torch" (separate ops).
    bias_dropout_add: str = "torch"
    # --cross-entropy-fusion-impl: "native" (the logits, then the cross-entropy above) or
    # "linear" (output layer + cross-entropy over chunks of tokens, no (tokens, V/p) logits).
    cross_entropy_fusion_impl: str = "native"
    # Precision modes (KernelConfig), not implementations: --attention-softmax-in-fp32 and
    # --fp16-lm-cross-entropy (loss in the logits' dtype instead of fp32).
    softmax_in_fp32: bool = False
    fp16_lm_cross_entropy: bool = False
    # --sdpa-backend: the kernel SDPA runs (megatron.model.attention.sdpa); "auto": cudnn first.
    sdpa_backend: str = "auto"
    # --torch-compile: the chunks run compiled, so the norms, activations and softmax stay
    # torch ops that Inductor fuses with their neighbours (a Triton call would be opaque to it).
    compiled: bool = False
    # add + LayerNorm where it differs from add_norm (which then serves RMSNorm only): the
    # dispatch keeps torch's LayerNorm where our kernel measured slower (SLOWER_THAN_TORCH).
    add_layer_norm_impl: str | None = None

    def add_norm_impl(self, rms: bool) -> str:
        """The implementation of residual add + the model's norm (RMSNorm or LayerNorm)."""
        if rms or self.add_layer_norm_impl is None:
            return self.add_norm
        return self.add_layer_norm_impl

    def describe(self) -> str:
        linear = " (fused with the output layer, in chunks of tokens)"
        linear = linear if self.cross_entropy_fusion_impl == "linear" else ""
        attn = {
            "sdpa": f"torch SDPA ({self.sdpa_backend})",
            "unfused": "torch matmul + softmax",
            "fused": f"matmul + {self.softmax} scaled causal softmax",
        }[self.attention_backend]
        compiled = "; torch.compile fuses the torch ops" if self.compiled else ""
        layer_norm = ""
        if self.add_layer_norm_impl not in (None, self.add_norm):
            layer_norm = f" (LayerNorm: {self.add_layer_norm_impl}, measured faster here)"
        return (
            f"fused kernels: attention = {attn}; add+norm = {self.add_norm}{layer_norm}; "
            f"bias+gelu = {self.bias_gelu}; swiglu = {self.swiglu}; "
            f"cross-entropy = {self.cross_entropy}{linear}; "
            f"bias+dropout+add = {self.bias_dropout_add}{compiled}"
        )

    # --- the ops themselves ---

    def causal_softmax(self, scores: torch.Tensor, scale: float) -> torch.Tensor:
        if self.softmax == "triton" and self.attention_backend == "fused":
            from megatron.fused_kernels.triton_softmax import scaled_upper_triang_masked_softmax

            return scaled_upper_triang_masked_softmax(scores, scale)
        return reference.torch_scaled_upper_triang_masked_softmax(scores, scale)

    def masked_softmax(self, scores: torch.Tensor, keep: torch.Tensor, scale: float):
        """softmax(scale x scores) over the keys where `keep` (bool, broadcastable to scores,
        e.g. (b, 1, s_q, s_k)) is True: the fused backend's Triton scaled masked softmax, else
        the same math in torch."""
        if self.softmax == "triton" and self.attention_backend == "fused":
            from megatron.fused_kernels.triton_softmax import scaled_masked_softmax

            return scaled_masked_softmax(scores, ~keep, scale)
        return reference.torch_scaled_masked_softmax(scores, keep, scale)

    # The next three run only where dispatch chose a kernel (add_norm / bias_gelu != "torch");
    # the torch path keeps the model's plain `x + residual; norm(x)` and `gelu(linear(x))`.

    def add_layer_norm(self, x, residual, weight, bias, eps):
        if self.add_norm == "liger":
            return liger.add_layer_norm(x, residual, weight, bias, eps)
        from megatron.fused_kernels.triton_norms import fused_add_layer_norm

        return fused_add_layer_norm(x, residual, weight, bias, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if self.add_norm == "liger":
            return liger.add_rms_norm(x, residual, weight, eps)
        from megatron.fused_kernels.triton_norms import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps)

    def gelu_with_bias(self, x, bias, approximate: str = "none"):
        from megatron.fused_kernels.triton_activations import bias_gelu

        return bias_gelu(x, bias, approximate)

    def swiglu_act(self, x):
        if self.swiglu == "liger":
            return liger.swiglu(x)
        if self.swiglu == "triton":
            from megatron.fused_kernels.triton_activations import swiglu

            return swiglu(x)
        return reference.torch_swiglu(x)

    def vocab_cross_entropy(self, logits, target, group):
        if self.cross_entropy == "triton":
            from megatron.fused_kernels.triton_cross_entropy import (
                vocab_parallel_cross_entropy_fused,
            )

            # Under --torch-compile the kernel runs between graphs, as it is (one graph break
            # at the end of the chunk), not traced into them.
            return _outside_graphs(vocab_parallel_cross_entropy_fused)(logits, target, group)
        from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(
            logits, target, group, upcast=not self.fp16_lm_cross_entropy
        )

    def linear_cross_entropy(self, x, weight, target, group, sequence_parallel, num_valid):
        """--cross-entropy-fusion-impl linear: per-token loss of x's logits against `weight`
        (this rank's vocab slice), chunk by chunk; the chunks' elementwise part in Triton where
        the cross-entropy is."""
        from megatron.mpu.linear_cross_entropy import (
            TORCH_CHUNK_OPS,
            linear_vocab_parallel_cross_entropy,
        )

        chunk_ops = TORCH_CHUNK_OPS
        if self.cross_entropy == "triton":
            from megatron.fused_kernels.triton_linear_cross_entropy import TRITON_CHUNK_OPS

            chunk_ops = TRITON_CHUNK_OPS
        return linear_vocab_parallel_cross_entropy(
            x,
            weight,
            target,
            group,
            sequence_parallel=sequence_parallel,
            num_valid=num_valid,
            ops=chunk_ops,
        )


TORCH_OPS = FusedOps()
_OPAQUE = {}


def _outside_graphs(fn):
    """`fn` as torch.compile runs it: eagerly, between graphs (torch.compiler.disable, made
    once per function)."""
    if fn not in _OPAQUE:
        _OPAQUE[fn] = torch.compiler.disable(fn)
    return _OPAQUE[fn]


STRICT_ENV = "MEGATRON_KERNELS_STRICT"
_REFUSED = f"strict mode (strict=True or {STRICT_ENV}=1) refuses the torch fallback"


def strict_from_env() -> bool:
    """MEGATRON_KERNELS_STRICT: 1 = a Triton kernel that fails its check raises (default 0)."""
    value = os.environ.get(STRICT_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{STRICT_ENV}={value!r}: use 1 (raise) or 0 (warn and use torch)")
    return value == "1"


# Where our Triton kernel measured slower than torch's own ops on a CUDA GPU, forward + backward
# (bench/kernels.py on one H100, 2026-11-26, ../shared/gpu-runs/2026-11-26-h100-wave4): add +
# LayerNorm 0.767 ms against eager's 0.189 at 8192 x 768 (0.648 against 0.202 at 8192 x 2048),
# bias + GeLU 0.597 against 0.196 at 8192 x 3072 (0.601 against 0.470 at 8192 x 8192). Our add +
# RMSNorm (0.660 against 0.914) and SwiGLU (0.350 against 0.430) were faster and stay. The
# dispatch follows the table: on CUDA these ops run torch's unless `follow_table=False` (the
# CUDA tests of the kernels themselves).
SLOWER_THAN_TORCH = {"cuda": frozenset({"add_layer_norm", "bias_gelu"})}


def select_ops(
    cfg: KernelConfig,
    device: torch.device | str,
    *,
    strict: bool | None = None,
    follow_table: bool = True,
) -> FusedOps:
    """Pick each op's implementation from the device, --kernel-library and the --no-*-fusion
    flags: the library's kernel, else ours, else torch (each kernel passing its self-check). A
    kernel failing its check falls back with a warning, or raises when `strict` (default:
    MEGATRON_KERNELS_STRICT)."""
    device = torch.device(device)
    strict = strict_from_env() if strict is None else strict
    triton = triton_available(device)
    if cfg.kernel_library == "liger":
        _check_liger(device)
    if cfg.attention_backend == "fused" and not triton:
        raise ValueError(
            "--attention-backend fused needs Triton on a CUDA device (or TRITON_INTERPRET=1 on "
            "the CPU). Fix: pip install triton, or use --attention-backend sdpa"
        )

    eager = not cfg.torch_compile  # compiled: Inductor fuses these ops itself
    # The ops our kernel measured slower at are not even checked (a check compiles and, on a GPU,
    # autotunes): add + LayerNorm keeps its kernel only for RMSNorm models, decided per layer.
    slower = SLOWER_THAN_TORCH.get(device.type, frozenset()) if follow_table else frozenset()
    wanted = {
        "softmax": cfg.masked_softmax_fusion and eager,
        "add_norm": cfg.layer_norm_fusion and eager,
        "bias_gelu": cfg.bias_gelu_fusion and eager and "bias_gelu" not in slower,
        "swiglu": cfg.bias_swiglu_fusion and eager,
        # --fp16-lm-cross-entropy asks for the loss in the logits' dtype: the torch one
        "cross_entropy": cfg.cross_entropy_loss_fusion and not cfg.fp16_lm_cross_entropy,
    }
    chosen = {}
    for op, enabled in wanted.items():
        candidates = ["triton"] if enabled and triton else []
        if cfg.kernel_library == "liger" and op in liger.OPS and candidates:
            candidates.insert(0, "liger")
        chosen[op] = next((c for c in candidates if _self_check(op, device, c, strict)), "torch")
    layer_norm = "torch" if "add_layer_norm" in slower and chosen["add_norm"] == "triton" else None
    if cfg.attention_backend == "fused" and eager and chosen["softmax"] != "triton":
        if cfg.masked_softmax_fusion:
            raise RuntimeError(
                "--attention-backend fused: the Triton softmax failed its check "
                "on this device (see the warning). Fix: --attention-backend sdpa"
            )
    return FusedOps(
        attention_backend=cfg.attention_backend,
        softmax_in_fp32=cfg.attention_softmax_in_fp32,
        fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
        bias_dropout_add="compile" if cfg.bias_dropout_fusion else "torch",
        cross_entropy_fusion_impl=cfg.cross_entropy_fusion_impl,
        sdpa_backend=cfg.sdpa_backend,
        compiled=cfg.torch_compile,
        add_layer_norm_impl=layer_norm,
        **chosen,
    )


def _check_liger(device: torch.device) -> None:
    reason = liger.missing_reason()
    if reason is not None:
        raise ValueError(reason)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--kernel-library liger runs Liger-Kernel's Triton kernels, which need a CUDA "
            f"device (this run is on {device}). Fix: --kernel-library ours (the torch ops run "
            "here), or TRITON_INTERPRET=1 to run Triton's CPU interpreter"
        )


def _self_check(op: str, device: torch.device, impl: str = "triton", strict: bool = False) -> bool:
    """Run the op's `impl` kernel ("triton": ours, or "liger") once on a small input against
    its torch twin; False (with a warning) if it fails to compile or disagrees, so a bad kernel
    never silently trains a model (the next implementation in line is checked instead).
    Strict: raise instead, from the original error."""
    import warnings

    from megatron.fused_kernels import checks

    name = {"triton": "Triton", "liger": "Liger-Kernel's"}[impl]
    fallback = "ours" if impl == "liger" else "the torch implementation"
    try:
        ok = checks.CHECKS[impl][op](device)
    except Exception as e:  # a compile or launch failure: fall back, never crash the run
        problem = f"{name} {op} kernel unavailable on {device} ({type(e).__name__}: {e})"
        if strict:
            raise RuntimeError(f"{problem}; {_REFUSED}") from e
        warnings.warn(f"{problem}; using {fallback}", stacklevel=3)
        return False
    if not ok:
        problem = f"{name} {op} kernel disagrees with torch on {device}"
        if strict:
            raise RuntimeError(f"{problem}; {_REFUSED}")
        warnings.warn(f"{problem}; using {fallback}", stacklevel=3)
    return ok
