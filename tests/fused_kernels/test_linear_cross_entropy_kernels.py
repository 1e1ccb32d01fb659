"""The chunked linear + cross-entropy's Triton elementwise part (run in Triton's CPU interpreter)
gives the torch chunk ops' loss and gradients: alone, at TP = 2 with a rank that holds only
vocab padding, and through the whole GPT (--cross-entropy-fusion-impl linear with
--cross-entropy-loss-fusion) against the unfused torch path."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the fused kernels need Triton (its interpreter on CPU)")

pytestmark = pytest.mark.triton  # keeps TRITON_INTERPRET=1 (see conftest)

from megatron import mpu  # noqa: E402
from megatron.config.schema import ModelConfig  # noqa: E402
from megatron.config.schema_kernels import KernelConfig  # noqa: E402
from megatron.fused_kernels import select_ops  # noqa: E402
from megatron.fused_kernels import triton_cross_entropy as ce  # noqa: E402
from megatron.fused_kernels.triton_linear_cross_entropy import TRITON_CHUNK_OPS  # noqa: E402
from megatron.model.context import BuildContext  # noqa: E402
from megatron.models.gpt.model import GPTModel  # noqa: E402
from megatron.mpu.linear_cross_entropy import (  # noqa: E402
    TORCH_CHUNK_OPS,
    linear_vocab_parallel_cross_entropy,
)
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(ce, "MAX_BLOCK", 32)  # rows of 45 columns take two loop steps


def _loss_and_grads(ops, x, w, target, dloss, num_valid, group=None, rows=5):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    x_in = mpu.copy_to_tensor_model_parallel_region(x, group)
    loss = linear_vocab_parallel_cross_entropy(
        x_in, w, target, group, num_valid=num_valid, rows=rows, ops=ops
    )
    (loss * dloss).sum().backward()
    return loss.detach(), x.grad, w.grad


def _inputs(dtype, vocab, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 16, generator=g).to(dtype)
    w = (torch.randn(padded, 16, generator=g) * 0.5).to(dtype)
    target = torch.randint(0, vocab, (3, 7), generator=g)
    return x, w, target, torch.rand(3, 7, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_chunk_ops_equal_the_torch_ones(dtype):
    x, w, target, dloss = _inputs(dtype, vocab=45, padded=48)
    ref = _loss_and_grads(TORCH_CHUNK_OPS, x, w, target, dloss, num_valid=45)
    out = _loss_and_grads(TRITON_CHUNK_OPS, x, w, target, dloss, num_valid=45)
    for name, got, want in zip(("loss", "dx", "dw"), out, ref, strict=True):
        torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
    assert not out[2][45:].any(), "padding rows of the output layer got gradient"


def _padding_rank_worker(rank, world):
    x, w, target, dloss = _inputs(torch.float32, vocab=20, padded=48, seed=4)
    ref = _loss_and_grads(TORCH_CHUNK_OPS, x, w, target, dloss, num_valid=20)
    state = initialize_model_parallel(world, 1)
    local = 48 // world
    num_valid = max(0, min(local, 20 - rank * local))  # rank 1: padding only
    w_local = mpu.shard(w, 0, rank, world)
    for ops in (TORCH_CHUNK_OPS, TRITON_CHUNK_OPS):
        loss, dx, dw = _loss_and_grads(
            ops, x, w_local, target, dloss, num_valid, group=state.tp_group
        )
        what = f"{ops.name} chunk ops, rank {rank}"
        torch.testing.assert_close(loss, ref[0], **TOL[torch.float32], msg=what)
        torch.testing.assert_close(dx, ref[1], **TOL[torch.float32], msg=what)
        torch.testing.assert_close(dw, mpu.shard(ref[2], 0, rank, world), **TOL[torch.float32])
    destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_tp2_with_a_rank_of_padding_only_equals_one_process():
    assert run_distributed(_padding_rank_worker, 2) == [True, True]


@pytest.mark.parametrize("untied", [False, True])
def test_gpt_through_the_triton_linear_cross_entropy_equals_the_torch_path(untied):
    shape = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=12)
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    cfg = ModelConfig(  # vocab 60 padded to 64
        **shape, **no_dropout, vocab_size=60, make_vocab_size_divisible_by=16,
        untie_embeddings_and_output_weights=untied,
    )  # fmt: skip
    kernels = KernelConfig(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear")
    kernels = dataclasses.replace(kernels, layer_norm_fusion=False, bias_gelu_fusion=False)
    ops = select_ops(kernels, "cpu")
    assert ops.cross_entropy == "triton" and "fused with the output layer" in ops.describe()
    tokens = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    results = []
    for model_ops in (None, ops):
        model = GPTModel(cfg, BuildContext(seed=5, ops=model_ops))
        loss = model(tokens, labels=tokens)
        loss.mean().backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)
