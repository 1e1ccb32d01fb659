"""--cross-entropy-fusion-impl linear on a GPU, at GPT-2's vocabulary and a 1.3B micro batch of
tokens (8 x 2048): the chunked output layer + cross-entropy (torch chunk ops, and the compiled
Triton ones) gives the unfused loss and gradients in bf16, and its peak memory stays far below
the unfused path's, whose bf16 logits and fp32 copy alone take 4.9 GB.
`MEGATRON_TEST_DEVICE=cuda pytest tests/gpu/test_cuda_linear_cross_entropy.py`; skipped on
the CPU (tests/mpu/test_linear_cross_entropy.py runs the same code there)."""

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.config.schema_kernels import KernelConfig
from megatron.fused_kernels import select_ops

TOKENS, HIDDEN, VOCAB, PADDED = 8 * 2048, 768, 50257, 50304
TOL = 2e-2  # bf16: max error relative to the largest reference value


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    w = torch.randn(PADDED, HIDDEN, generator=g) * 0.05
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    dloss = (torch.rand(TOKENS, generator=g) > 0.1).float() / TOKENS  # a masked mean
    bf16 = {"device": device, "dtype": torch.bfloat16}
    return x.to(**bf16), w.to(**bf16), target.to(device), dloss.to(device)


def _unfused(x, w, target):
    z = F.linear(x, w)  # (tokens, V): the logits the linear path never builds
    z[:, VOCAB:] = float("-inf")
    return mpu.vocab_parallel_cross_entropy(z, target)


def _run(fn, x, w, dloss):
    """(loss, dx, dw, peak bytes above what was allocated before, ms) of forward + backward,
    the second time (the first compiles what it needs)."""
    for _ in range(2):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(x_, w_)
        (loss * dloss).sum().backward()
        end.record()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return loss.detach(), x_.grad, w_.grad, peak, start.elapsed_time(end)


def _assert_close_rel(got, want, what):
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= TOL * scale, f"{what}: max error {err:.3g} > {TOL} x {scale:.3g}"


@pytest.mark.parametrize("chunk_ops", ["torch", "triton"])
def test_linear_cross_entropy_on_the_gpu_matches_and_saves_the_logits(test_device, chunk_ops):
    if test_device.type != "cuda":
        pytest.skip("CUDA only: peak GPU memory (MEGATRON_TEST_DEVICE=cuda runs it)")
    if chunk_ops == "triton":
        pytest.importorskip("triton", reason="Triton is not installed")
    kernels = KernelConfig(
        cross_entropy_fusion_impl="linear", cross_entropy_loss_fusion=chunk_ops == "triton"
    )
    ops = select_ops(kernels, test_device)
    assert ops.cross_entropy == ("triton" if chunk_ops == "triton" else "torch"), ops.describe()
    x, w, target, dloss = _inputs(test_device)
    ref = _run(lambda x, w: _unfused(x, w, target), x, w, dloss)

    def fused(x, w):
        return ops.linear_cross_entropy(x, w, target, None, False, VOCAB)

    out = _run(fused, x, w, dloss)
    for name, got, want in zip(("loss", "dx", "dw"), out[:3], ref[:3], strict=True):
        _assert_close_rel(got, want, f"{name} ({chunk_ops} chunk ops)")
    assert not out[2][VOCAB:].any(), "padding rows got gradient"
    gib = 2**30
    print(
        f"fused linear + cross-entropy, {TOKENS} tokens x V {PADDED}, h {HIDDEN}, bf16, forward + "
        f"backward: unfused {ref[4]:.2f} ms, peak {ref[3] / gib:.2f} GiB; linear ({chunk_ops} "
        f"chunk ops) {out[4]:.2f} ms, peak {out[3] / gib:.2f} GiB"
    )
    logits_fp32 = 4 * TOKENS * PADDED
    assert out[3] < ref[3] - logits_fp32, (
        f"linear peak {out[3] / gib:.2f} GiB vs unfused {ref[3] / gib:.2f} GiB: it should save "
        f"at least the fp32 logits ({logits_fp32 / gib:.2f} GiB)"
    )
