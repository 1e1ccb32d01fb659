"""The chunked linear + cross-entropy (megatron.mpu.linear_cross_entropy) against the unfused
output layer + vocab-parallel cross-entropy: per-token loss, dX and dW at TP = 1 (fp32, bf16,
padding), at TP = 2 with and without sequence parallelism against one process, and no
(tokens, vocab) tensor created on the way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron import mpu
from megatron.mpu.linear_cross_entropy import chunk_rows, linear_vocab_parallel_cross_entropy
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed

B, S, H, VOCAB, PADDED = 3, 8, 16, 45, 48  # 24 tokens; rows 45.. of the output layer are padding


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g).to(dtype)
    w = (torch.randn(PADDED, H, generator=g) * 0.5).to(dtype)
    target = torch.randint(0, VOCAB, (B, S), generator=g)
    dloss = torch.rand(B, S, generator=g)  # as lm_loss's mask / count hands down
    dloss[0, :3] = 0.0  # masked tokens
    return x, w, target, dloss


def _unfused(x, w, target, num_valid, group=None):
    z = F.linear(x, w)  # (b, s, V/p)
    if num_valid < z.size(-1):
        z[..., num_valid:] = float("-inf")
    return mpu.vocab_parallel_cross_entropy(z, target, group)


def _run(fn, x, w, target, dloss):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(x, w)
    (loss * dloss).sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize(
    "dtype,tol",
    [(torch.float32, dict(rtol=1e-5, atol=1e-6)), (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))],
)
@pytest.mark.parametrize("rows", [None, 5, 24])
def test_tp1_equals_the_unfused_loss_and_gradients(dtype, tol, rows):
    x, w, target, dloss = _inputs(dtype)
    ref = _run(lambda x, w: _unfused(x, w, target, VOCAB), x, w, target, dloss)
    out = _run(
        lambda x, w: linear_vocab_parallel_cross_entropy(x, w, target, num_valid=VOCAB, rows=rows),
        x,
        w,
        target,
        dloss,
    )
    assert out[0].dtype == torch.float32 and out[0].shape == (B, S)
    assert out[1].dtype == dtype and out[2].dtype == dtype
    for name, got, want in zip(("loss", "dx", "dw"), out, ref, strict=True):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")
    assert not out[2][VOCAB:].any(), "padding rows of the output layer got gradient"
    assert not out[1][0, :3].any(), "a masked token (dloss 0) got gradient"


def test_padding_columns_take_no_softmax_mass():
    x, w, target, _ = _inputs(torch.float64)
    padded = linear_vocab_parallel_cross_entropy(x, w, target, num_valid=VOCAB, rows=7)
    unpadded = linear_vocab_parallel_cross_entropy(x, w[:VOCAB], target, rows=7)
    torch.testing.assert_close(padded, unpadded, rtol=1e-12, atol=1e-12)
    unmasked = linear_vocab_parallel_cross_entropy(x, w, target, rows=7)
    assert (unmasked > padded).all(), "without the mask the padding would take mass"


def test_chunk_rows_fit_the_budget_in_multiples_of_128():
    assert chunk_rows(16384, 50304) == 2560  # 512 MiB of fp32 logits at GPT-2's vocab
    assert chunk_rows(16384, 50304 // 8) % 128 == 0
    assert chunk_rows(100, 50304) == 100  # never more than the tokens
    assert chunk_rows(10**6, 10**8) == 128  # never fewer than 128 rows


class _LargestTensor(TorchDispatchMode):
    """The largest numel among the tensors every op returns, by dtype (backward included)."""

    def __init__(self):
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_by_vocab_tensor_is_created(dtype):
    g = torch.Generator().manual_seed(1)
    tokens, vocab, h, rows = 256, 512, 8, 32
    x = torch.randn(tokens, h, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, h, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)

    def largest(fn):
        x.grad = w.grad = None
        with _LargestTensor() as seen:
            fn().mean().backward()
        return max(seen.largest.values())

    unfused = largest(lambda: _unfused(x, w, target, vocab))
    assert unfused >= tokens * vocab, "the tracker must see the unfused path's logits"
    fused = largest(
        lambda: linear_vocab_parallel_cross_entropy(x, w, target, num_valid=vocab, rows=rows)
    )
    assert fused <= rows * vocab, f"a tensor of {fused} elements; a chunk has {rows * vocab}"


# ---- TP = 2, with and without sequence parallelism, against one process ----


def _tp_worker(rank, world):
    x, w, target, dloss = _inputs(torch.float64, seed=3)
    ref_loss, ref_dx, ref_dw = _run(lambda x, w: _unfused(x, w, target, VOCAB), x, w, target, dloss)
    state = initialize_model_parallel(world, 1)
    group, local = state.tp_group, PADDED // world
    num_valid = max(0, min(local, VOCAB - rank * local))  # rank 1 holds the padding
    w_local = mpu.shard(w, 0, rank, world)
    for sp in (False, True):
        x_in = mpu.sequence_slice(x, group) if sp else x

        def fused(x_, w_, sp=sp):
            x_ = x_ if sp else mpu.copy_to_tensor_model_parallel_region(x_, group)
            return linear_vocab_parallel_cross_entropy(
                x_, w_, target, group, sequence_parallel=sp, num_valid=num_valid, rows=5
            )

        loss, dx, dw = _run(fused, x_in, w_local, target, dloss)
        what = f"rank {rank} sequence parallel {sp}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12, msg=what)
        want_dx = mpu.sequence_slice(ref_dx, group) if sp else ref_dx
        torch.testing.assert_close(dx, want_dx, rtol=1e-10, atol=1e-12, msg=what)
        torch.testing.assert_close(dw, mpu.shard(ref_dw, 0, rank, world), rtol=1e-10, atol=1e-12)
    destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_tp2_and_sequence_parallel_equal_one_process():
    assert run_distributed(_tp_worker, 2) == [True, True]
