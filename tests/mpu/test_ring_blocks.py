"""Ring attention's blocks (mpu/ring_blocks.py): the explicit math against autograd, the CPU
flash kernel against the math (forward out and LSE, backward dq/dk/dv from the final out and
LSE of a row split over blocks, as the ring uses them), and how the implementation is chosen.
The CUDA kernels get the same checks in tests/gpu/test_cuda.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron.mpu import ring_blocks as rb
from tests.helpers.attention import two_block_row

CPU = torch.device("cpu")


def test_block_backward_matches_autograd_with_dropout():
    """The math's per-block gradient formulas (from the final log-sum-exp, dropout replayed from
    the generator state) against autograd through the block's forward, diagonal and full."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64)
    for causal in (True, False):
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        state = g.get_state()
        out, lse = rb._block_forward(qa, ka, va, 0.5, causal, 0.3, g)
        out.backward(dout)
        g.set_state(state)
        delta = (dout * out.detach()).sum(-1)
        dq, dk, dv = rb._block_backward(q, k, v, dout, lse.detach(), delta, 0.5, causal, 0.3, g)
        for mine, ref in ((dq, qa.grad), (dk, ka.grad), (dv, va.grad)):
            torch.testing.assert_close(mine.to(ref.dtype), ref)


def test_math_blocks_replay_dropout_and_leave_the_generator_where_it_was():
    """MathBlocks.backward redraws the forward's masks from the state saved per block and
    puts the default generator back; the two blocks' masks differ."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(4))
    torch.manual_seed(9)
    out1, lse1, replay1 = rb.MATH.forward(q, k, v, 0.5, True, 0.4)
    out2, _, replay2 = rb.MATH.forward(q, k, v, 0.5, True, 0.4)
    assert not torch.equal(out1, out2), "two blocks drew the same dropout mask"
    after = torch.get_rng_state()
    first = rb.MATH.backward(q, k, v, dout, out1, lse1, 0.5, True, 0.4, replay1)
    again = rb.MATH.backward(q, k, v, dout, out1, lse1, 0.5, True, 0.4, replay1)
    assert torch.equal(torch.get_rng_state(), after)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cpu_flash_blocks_equal_the_math_in_fp32(kv_heads):
    """The fused CPU kernel per block (full and diagonal) against the explicit math and against
    autograd through SDPA over the whole row: out, LSE, dq, dk, dv in fp32 (GQA: K/V expanded
    per group as the ring does, their gradients summed back)."""
    g = torch.Generator().manual_seed(5)
    b, h, c, d = 2, 4, 12, 16
    q = torch.randn(b, h, c, d, generator=g)
    k, v = (torch.randn(b, kv_heads, 2 * c, d, generator=g) for _ in "kv")
    dout = torch.randn(b, h, c, d, generator=g)
    rep = h // kv_heads
    ke, ve = (t.repeat_interleave(rep, 1) for t in (k, v))
    fused = rb.select_blocks("fused", CPU, torch.float32, d)
    assert fused.name == "cpu-flash"
    mine = two_block_row(fused, q, ke, ve, dout, c)
    ref = two_block_row(rb.MATH, q, ke, ve, dout, c)
    for what, a, r in zip(("out", "lse", "dq", "dk", "dv"), mine, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=what)
    # the whole row through autograd: the later c queries of 2c positions, causal
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    keep = torch.ones(c, 2 * c, dtype=torch.bool).tril(c)
    out = F.scaled_dot_product_attention(
        qa, ka.repeat_interleave(rep, 1), va.repeat_interleave(rep, 1), attn_mask=keep
    )
    out.backward(dout)
    torch.testing.assert_close(mine[0], out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[2], qa.grad, rtol=1e-5, atol=1e-5)
    for got, want in ((mine[3], ka.grad), (mine[4], va.grad)):
        summed = got.view(b, kv_heads, rep, 2 * c, d).sum(2)
        torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-5)


def test_cpu_flash_blocks_in_bf16_stay_close_to_the_math():
    g = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(1, 2, 16, 32, generator=g) for _ in "qo")
    k, v = (torch.randn(1, 2, 32, 32, generator=g) for _ in "kv")
    low = [t.bfloat16() for t in (q, k, v, dout)]
    mine = two_block_row(rb.select_blocks("fused", CPU, torch.bfloat16, 32), *low, 16)
    ref = two_block_row(rb.MATH, *low, 16)
    for what, a, r in zip(("out", "lse", "dq", "dk", "dv"), mine, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=3e-2, atol=3e-2, msg=what)


def test_the_block_backend_is_chosen_by_device_and_dtype(monkeypatch):
    assert rb.select_blocks("auto", CPU, torch.float32, 64).name == "cpu-flash"
    assert rb.select_blocks("auto", CPU, torch.bfloat16, 64).name == "cpu-flash"
    assert rb.select_blocks("math", CPU, torch.float32, 64) is rb.MATH
    assert rb.select_blocks("auto", CPU, torch.float64, 64) is rb.MATH  # no float64 kernel
    with pytest.raises(ValueError, match="no fused attention kernel.*--attention-backend unfused"):
        rb.select_blocks("fused", CPU, torch.float64, 64)
    with pytest.raises(ValueError, match="expected one of"):
        rb.select_blocks("flash", CPU, torch.float32, 64)
    # PyTorch says where a kernel runs: the CUDA kernels, tried on the CPU, are passed over
    # without a warning (they have no CPU implementation), and the choice is the math.
    monkeypatch.setattr(rb, "FUSED_KERNELS", (rb.CudaFlashBlocks(), rb.CudaEfficientBlocks()))
    rb.select_blocks.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert rb.select_blocks("auto", CPU, torch.float32, 64) is rb.MATH
        with pytest.raises(ValueError, match="flash: no torch.float32; efficient: none on cpu"):
            rb.select_blocks("fused", CPU, torch.float32, 64)
    finally:
        rb.select_blocks.cache_clear()


def test_the_chosen_blocks_are_logged_once(capsys):
    rb.select_blocks.cache_clear()
    for _ in range(2):
        rb.select_blocks("auto", CPU, torch.float32, 32)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ring attention blocks" in ln]
    assert lines == [
        "> ring attention blocks: cpu-flash (cpu, torch.float32, head size 32; asked for auto)"
    ]


class _OffByOnePercent(rb.CpuFlashBlocks):
    name = "broken"

    def forward(self, q, k, v, scale, causal, p):
        out, lse, replay = super().forward(q, k, v, scale, causal, p)
        return out * 1.01, lse, replay


def test_a_kernel_that_disagrees_with_the_math_is_passed_over_with_a_warning(monkeypatch):
    monkeypatch.setattr(rb, "FUSED_KERNELS", (_OffByOnePercent(),))
    rb.select_blocks.cache_clear()
    try:
        with pytest.warns(UserWarning, match="broken kernel failed its check.*out differs"):
            assert rb.select_blocks("auto", CPU, torch.float32, 16) is rb.MATH
        with pytest.raises(ValueError, match="broken: out differs"):
            rb.select_blocks("fused", CPU, torch.float32, 16)
    finally:
        rb.select_blocks.cache_clear()


def test_the_check_draws_nothing_from_the_global_generator():
    rb.select_blocks.cache_clear()
    before = torch.get_rng_state()
    rb.select_blocks("auto", CPU, torch.float32, 24)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_block_kernels_are_called_as_torch_declares_them(kernel):
    """The CUDA kernels' calls on meta tensors (torch's shape functions, no GPU needed): the
    outputs unpacked as declared, the efficient kernel's LSE cut to the real rows and padded back
    for its backward. Their numbers are checked on a GPU in tests/gpu/test_cuda.py."""
    blocks = {b.name: b for b in rb.FUSED_KERNELS}[kernel]
    q = torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(2, 4, 56, 64, device="meta", dtype=torch.bfloat16)
    out, lse, replay = rb.block_step(blocks, q, k, v, 0.125, False, 0.1)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = blocks.backward(q, k, v, torch.empty_like(q), out, lse, 0.125, False, 0.1, replay)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
