"""One block of ring attention: out = softmax(q k^T scale) v of a query chunk over one key chunk,
with the rows' log-sum-exp, and the block's gradients given the *final* output and LSE.

With the final LSE of a row (over every key block of the ring), P = exp(q k^T scale - LSE) is the
block's share of the whole softmax, and D = rowsum(dout * out) with the final out is flash
attention's correction term, so dS = P (dout v^T - D) and each block's dq, dk, dv add up to
the gradient of the whole row. Two implementations of that contract:

- `math`: explicit fp32 matmul + softmax on any device and dtype. It materialises the block's
  (s_q, s_k) scores. Dropout masks are drawn from the device's default generator (whose state
  the caller forked) and redrawn in backward from the state saved per block. It alone takes an
  arbitrary keep mask (documents under context parallelism, mpu/ring_documents.py); a row the
  mask leaves no key gets LSE -inf and output 0, and no NaN in forward or backward.
- fused: PyTorch's SDPA kernels that return the LSE and, in backward, recompute the
  probabilities from it (flash attention's contract; no score matrix is kept). Inputs stay in
  the model dtype, LSEs are fp32 (natural log, (b, h, s_q)); a causal block is the diagonal
  (s_q == s_k, the same positions), where the kernels' top-left causal mask is the right one.
  `cpu-flash`: aten._scaled_dot_product_flash_attention_for_cpu, fp32/bf16/fp16, no dropout
  (a block with dropout runs the math). CUDA `flash` (fp16/bf16) and `efficient` (also fp32):
  dropout from the philox seed and offset the forward returns, passed back to the backward
  kernel, so backward replays the forward's masks exactly.

`select_blocks` picks one once per (preference, device, dtype, head size): each fused candidate
is run on a small block against the math first, and one that fails or disagrees is passed over
with a warning (as megatron.fused_kernels does with its Triton kernels).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from megatron.mpu.random import default_generator

_HALF = (torch.float16, torch.bfloat16)
BACKENDS = ("auto", "fused", "math")

# ---- math: explicit fp32 attention with its log-sum-exp ----


def _scores(q, k, scale: float, causal: bool, keep=None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, h, sq, sk)
    if causal:  # the diagonal block: query i sees keys <= i
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if keep is not None:  # (b, 1, sq, sk), True where query i may see key j: documents
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A row that sees no key of a (masked) block has LSE -inf and probabilities all 0: with 0
    in its place, exp(s - lse) = exp(-inf) = 0 rather than exp(-inf + inf) = NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _keep(shape, p: float, generator, device) -> torch.Tensor:
    """Dropout's keep mask scaled by 1 / (1 - p), drawn from `generator` (replayed in backward)."""
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return (u >= p).to(torch.float32) / (1.0 - p)


def _block_forward(q, k, v, scale, causal, p, generator, keep=None):
    """out = dropout(softmax(q k^T scale)) v of one block, and the rows' log-sum-exp (-inf, with
    out 0, for a row that `keep` leaves no key)."""
    s = _scores(q, k, scale, causal, keep)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    probs = torch.exp(s - _finite(lse).unsqueeze(-1))
    if p > 0.0:
        probs = probs * _keep(probs.shape, p, generator, q.device)
    return torch.matmul(probs, v), lse


def _block_backward(q, k, v, dout, lse, delta, scale, causal, p, generator, keep=None):
    """Gradients of one block given the *final* log-sum-exp of the rows (so the probabilities
    are those of the whole softmax) and delta = rowsum(dout * out) (flash attention's D)."""
    s = _scores(q, k, scale, causal, keep)
    probs = torch.exp(s - _finite(lse).unsqueeze(-1))  # (b, h, sq, sk)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    if p > 0.0:
        keep = _keep(probs.shape, p, generator, q.device)
        dv = torch.matmul((probs * keep).transpose(-1, -2), dout)
        dp = dp * keep
    else:
        dv = torch.matmul(probs.transpose(-1, -2), dout)
    ds = probs * (dp - delta.unsqueeze(-1)) * scale
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


class MathBlocks:
    """Explicit fp32 math (see the module docstring); the fallback on every device."""

    name = "math"
    dropout = True

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def forward(self, q, k, v, scale: float, causal: bool, p: float, keep=None):
        """(out, lse, replay): replay is the generator state its dropout masks start from.
        `keep` (b, 1, sq, sk) bool: the pairs a document mask allows (the math alone takes
        one)."""
        generator = default_generator(q.device)
        replay = generator.get_state() if p > 0.0 else None
        out, lse = _block_forward(q, k, v, scale, causal, p, generator, keep)
        return out, lse, replay

    def backward(self, q, k, v, dout, out, lse, scale, causal, p, replay, keep=None):
        delta = (dout * out).sum(-1)  # (b, h, sq)
        generator = default_generator(q.device)
        args = (q, k, v, dout, lse, delta, scale, causal, p, generator, keep)
        if replay is None:
            return _block_backward(*args)
        current = generator.get_state()
        generator.set_state(replay)
        try:
            return _block_backward(*args)
        finally:
            generator.set_state(current)


# ---- fused: PyTorch's SDPA kernels that return the LSE ----


class _FusedBlocks:
    """Common ground of the fused kernels: inputs in the model dtype, fp32 LSE. Each kernel
    names the dtypes it takes; which devices it runs on is PyTorch's to say (an op with no
    kernel for the device raises NotImplementedError in the choice's check, and the next is
    tried). Nothing fused for the device and dtype (float64, say): the explicit math."""

    name = ""
    dropout = False
    dtypes: tuple[torch.dtype, ...] = ()

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype


class CpuFlashBlocks(_FusedBlocks):
    name, dtypes = "cpu-flash", (torch.float32, *_HALF)

    def forward(self, q, k, v, scale, causal, p):
        if p > 0.0:  # the CPU kernel has no dropout; the ring runs such blocks in the math
            raise ValueError("the CPU flash kernel does not support dropout")
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = op(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None

    def backward(self, q, k, v, dout, out, lse, scale, causal, p, replay):
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        return op(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


class CudaFlashBlocks(_FusedBlocks):
    name, dropout, dtypes = "flash", True, _HALF

    def forward(self, q, k, v, scale, causal, p):
        op = torch.ops.aten._scaled_dot_product_flash_attention
        out, lse, *_, seed, offset, _ = op(q, k, v, p, causal, False, scale=scale)
        return out, lse, (seed, offset)

    def backward(self, q, k, v, dout, out, lse, scale, causal, p, replay):
        seed, offset = replay
        op = torch.ops.aten._scaled_dot_product_flash_attention_backward
        # no cumulative sequence lengths: dense (b, h, s, d) batches
        return op(
            dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), p, causal, seed, offset,
            scale=scale,
        )  # fmt: skip


class CudaEfficientBlocks(_FusedBlocks):
    name, dropout, dtypes = "efficient", True, (torch.float32, *_HALF)

    def forward(self, q, k, v, scale, causal, p):
        op = torch.ops.aten._scaled_dot_product_efficient_attention
        out, lse, seed, offset = op(q, k, v, None, True, p, causal, scale=scale)
        # the kernel's LSE has its rows padded to a multiple of 32: keep the real ones, and
        # the padded width for the backward kernel
        return out, lse[..., : q.size(2)], (seed, offset, lse.size(-1))

    def backward(self, q, k, v, dout, out, lse, scale, causal, p, replay):
        seed, offset, width = replay
        lse = F.pad(lse, (0, width - lse.size(-1)))  # (b, h, width) as the forward gave it
        op = torch.ops.aten._scaled_dot_product_efficient_attention_backward
        dq, dk, dv, _ = op(
            dout, q, k, v, None, out, lse, seed, offset, p, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv


MATH = MathBlocks()
# Every fused kernel, in order of preference where several serve a device.
FUSED_KERNELS = (CpuFlashBlocks(), CudaFlashBlocks(), CudaEfficientBlocks())


def block_step(blocks, q, k, v, scale, causal, p, keep=None):
    """One block's forward through `blocks`; (out, fp32 lse, what its backward needs). A `keep`
    mask (b, 1, sq, sk) goes to the math only: the fused kernels that return the LSE take
    none."""
    if keep is None:
        out, lse, replay = blocks.forward(q, k, v, scale, causal, p)
    else:
        out, lse, replay = blocks.forward(q, k, v, scale, causal, p, keep=keep)
    return out, lse.float(), replay


# ---- choosing once ----


@functools.cache
def select_blocks(preference: str, device: torch.device, dtype: torch.dtype, head_dim: int):
    """The block implementation for `preference` ("auto": the first fused kernel of the device
    that handles `dtype` and agrees with the math on a small block, else the math; "fused":
    that kernel or a ValueError; "math": the explicit math). The choice is logged once (rank
    0), as Megatron-core logs its attention backend."""
    blocks = _select(preference, device, dtype, head_dim)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f"> ring attention blocks: {blocks.name} ({device.type}, {dtype}, head size "
            f"{head_dim}; asked for {preference})",
            flush=True,
        )
    return blocks


def _select(preference: str, device: torch.device, dtype: torch.dtype, head_dim: int):
    if preference not in BACKENDS:
        raise ValueError(f"ring attention backend {preference!r}: expected one of {BACKENDS}")
    if preference == "math":
        return MATH
    problems = []
    for blocks in FUSED_KERNELS:
        if dtype not in blocks.dtypes:
            problems.append(f"{blocks.name}: no {dtype}")
            continue
        try:
            problem = _self_check(blocks, device, dtype, head_dim)
        except NotImplementedError:  # PyTorch has no such kernel for this device: no warning
            problems.append(f"{blocks.name}: none on {device.type}")
            continue
        if problem is None:
            return blocks
        problems.append(f"{blocks.name}: {problem}")
        if preference == "auto":
            warnings.warn(
                f"ring attention: the {blocks.name} kernel failed its check on {device} "
                f"({problem}); trying the next, else the explicit math",
                stacklevel=2,
            )
    if preference == "fused":
        why = "; ".join(problems)
        raise ValueError(
            f"no fused attention kernel for ring attention on {device} in {dtype} ({why}). "
            "Fix: --attention-backend unfused (explicit fp32 math)"
        )
    return MATH


def _self_check(blocks, device, dtype, head_dim: int) -> str | None:
    """Forward (out, LSE) and backward of `blocks` on a 40-token block against the math, causal
    and not; None when they agree, else what went wrong."""
    g = torch.Generator().manual_seed(0)  # never the global streams: training stays as it was
    q, k, v, dout = (torch.randn(1, 2, 40, head_dim, generator=g) for _ in range(4))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = 1.0 / math.sqrt(head_dim)
    try:
        for causal in (True, False):
            low = [t.to(device, dtype) for t in (q, k, v, dout)]
            ref = [t.to(device, torch.float32) for t in low]
            out, lse, replay = block_step(blocks, *low[:3], scale, causal, 0.0)
            ref_out, ref_lse, _ = block_step(MATH, *ref[:3], scale, causal, 0.0)
            grads = blocks.backward(*low, out, lse, scale, causal, 0.0, replay)
            ref_grads = MATH.backward(*ref, ref_out, ref_lse, scale, causal, 0.0, None)
            pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads, strict=True)]
            for what, (mine, want) in zip(("out", "lse", "dq", "dk", "dv"), pairs, strict=True):
                err = (mine.float() - want).abs().max().item()
                if not err <= tol * max(1.0, want.abs().max().item()):
                    return f"{what} differs by {err:.3g} (causal={causal})"
    except NotImplementedError:  # no kernel for the device (a RuntimeError): the caller's case
        raise
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None
