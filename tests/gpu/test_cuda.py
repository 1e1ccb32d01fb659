"""The single-process paths on a GPU: `MEGATRON_TEST_DEVICE=cuda pytest tests/gpu/test_cuda.py`
(bench/gpu_check.sh) runs them on cuda:0; with the default (cpu) the same tests run on the CPU
where that means something, and the CUDA-only ones (compiled Triton kernels, NCCL) skip saying
why. Covered: the GPT forward and backward in fp32/bf16/fp16 against a float64 reference, the
TP layers at TP = 1, fp16 loss scaling, checkpoint save and load with the device RNG, generation
with the KV cache, evaluation, export to Hugging Face, every Triton kernel compiled against its
torch reference, the whole GPT through the kernels, ring attention's blocks through the CUDA
flash / memory-efficient kernels against the explicit math (and their dropout replayed), the
MoE GPT (EP = TP = 1) against a float64 reference with grouped and looped experts and the
grouped GEMM's path on the device, and one-rank runs of pretrain_gpt2.py (NCCL on a GPU) with
and without --deepspeed, and with MoE, resumed from their checkpoint.

Do not run this module in one pytest process with the kernel tests of the CPU suite on a GPU:
they set TRITON_INTERPRET=1 when imported, and kernels defined then stay interpreted.
"""

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron import mpu
from megatron.checkpoint.resharding import load_full_state
from megatron.checkpoint.rng_state import rng_state_dict, set_rng_state
from megatron.config.schema import ModelConfig
from megatron.config.schema_kernels import KernelConfig
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.fused_kernels import TORCH_OPS, select_ops
from megatron.inference.engine import InferenceModel
from megatron.inference.evaluation import evaluate_loose_json
from megatron.inference.generation import SamplingParams, generate
from megatron.model import moe, router
from megatron.model.context import BuildContext
from megatron.model.moe import set_moe_loss_scale
from megatron.models.gpt.model import GPTModel, build_model
from megatron.mpu import ring_blocks
from megatron.optim.plain import plain_optimizer
from tests.helpers.attention import two_block_row
from tests.helpers.checkpoints import _write_checkpoint
from tests.helpers.models import LLAMA as LLAMA_LAYER
from tests.helpers.models import tiny_gpt
from tests.helpers.paths import MMAP, ROOT
from tests.helpers.reference_gpt import RefGPT, load_from_megatron
from tests.helpers.training import flags

GPT2 = tiny_gpt(num_attention_heads=4, seq_length=32, make_vocab_size_divisible_by=16)
LLAMA = dataclasses.replace(GPT2, **LLAMA_LAYER, num_query_groups=2)
VARIANTS = {"gpt2": GPT2, "llama": LLAMA}
VOCAB_ROWS = ("embedding.word_embeddings.weight", "head.output_layer.weight")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Max error relative to the largest reference value: the rounding of each precision over two
# layers (fp32: accumulation order; half: a few units of 2^-11 (fp16) or 2^-8 (bf16) per op).
TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def needs_cuda(device: torch.device, why: str) -> None:
    if device.type != "cuda":
        pytest.skip(f"CUDA only: {why} (MEGATRON_TEST_DEVICE=cuda runs it)")


def assert_close_rel(actual, expected, tol, what):
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    err = (actual - expected).abs().max()
    scale = expected.abs().max().clamp_min(1e-6)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def batch(cfg, device, n=3):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (n, cfg.seq_length), generator=g)
    return tokens.to(device), labels.to(device)


# --- the model in each precision --------------------------------------------------------------


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("precision", list(DTYPES))
def test_gpt_forward_backward_matches_float64_reference(test_device, variant, precision):
    cfg, dtype = VARIANTS[variant], DTYPES[precision]
    model = GPTModel(cfg, BuildContext(seed=3, device=test_device, dtype=dtype))
    ref = RefGPT(cfg).double()
    load_from_megatron(ref, model)
    tokens, labels = batch(cfg, test_device)
    logits = model(tokens)
    assert logits.device == tokens.device and logits.dtype == dtype
    assert torch.isinf(logits[..., cfg.vocab_size :]).all(), "padding logits must be masked"
    ref_loss = ref(tokens.cpu(), labels.cpu())
    assert_close_rel(logits[..., : cfg.vocab_size], ref(tokens.cpu()), TOL[dtype], "logits")
    loss = model(tokens, labels=labels)
    assert_close_rel(loss, ref_loss, TOL[dtype], "per-token loss")
    loss.float().mean().backward()
    ref_loss.mean().backward()
    assert_close_rel(
        model.embedding.word_embeddings.weight.grad[: cfg.vocab_size],
        ref.wte.weight.grad,
        4 * TOL[dtype],
        "embedding grad",
    )
    assert_close_rel(
        model.layers["0"].self_attention.dense.weight.grad,
        ref.blocks[0].o.weight.grad,
        4 * TOL[dtype],
        "attention output grad",
    )


def test_tp_layers_at_tp1_are_plain_linear_and_embedding(test_device):
    col = mpu.ColumnParallelLinear(16, 24, device=test_device)
    row = mpu.RowParallelLinear(24, 16, device=test_device)
    emb = mpu.VocabParallelEmbedding(50, 16, device=test_device)
    tokens = torch.randint(0, 50, (2, 5), device=test_device)
    x = emb(tokens)
    torch.testing.assert_close(x, F.embedding(tokens, emb.weight))
    y = row(col(x))
    expected = F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.device == x.device for p in col.parameters())


# --- loss scaling, checkpoint state ---------------------------------------------------------


@pytest.mark.slow  # over a second on 2 cores
def test_fp16_overflow_skips_the_step_and_halves_the_loss_scale(test_device):
    model = GPTModel(GPT2, BuildContext(seed=3, device=test_device, dtype=torch.half))
    opt = plain_optimizer(
        model,
        OptimizerConfig(lr=1e-3, initial_loss_scale=2.0**16, hysteresis=1),
        params_dtype=torch.half,
        state=mpu.single_process_state(),
        clip_grad=1.0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    tokens, labels = batch(GPT2, test_device)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    opt.scale_loss(model(tokens, labels=labels).float().mean()).backward()
    for p in model.parameters():
        p.main_grad.add_(p.grad.float())
    next(model.parameters()).main_grad[0] = float("inf")
    updated, norm = opt.step()
    assert not updated and norm is None and opt.loss_scale == 2.0**15
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    for p in model.parameters():
        p.main_grad.zero_().add_(p.grad.float())
    updated, norm = opt.step()
    assert updated and norm is not None and opt.loss_scale == 2.0**15
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_rng_state_round_trips_on_the_device(test_device):
    state = rng_state_dict(test_device)
    assert (state["cuda"] is not None) == (test_device.type == "cuda")
    first = torch.rand(4, device=test_device)
    set_rng_state(state, test_device)
    torch.testing.assert_close(torch.rand(4, device=test_device), first, rtol=0, atol=0)


def test_a_cpu_checkpoint_resumed_on_a_gpu_names_the_rng_flag():
    from megatron.checkpoint.storage import CheckpointError

    saved_on_cpu = rng_state_dict("cpu")
    with pytest.raises(CheckpointError, match="--no-load-rng"):
        set_rng_state(saved_on_cpu, torch.device("cuda", 0))  # refused before touching CUDA


@pytest.mark.slow  # over a second on 2 cores
def test_checkpoint_save_load_and_hf_export_on_the_device(test_device, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the HF export needs transformers")
    from megatron.models.gpt.hf import to_hf

    model = GPTModel(GPT2, BuildContext(seed=7, device=test_device))
    _write_checkpoint(tmp_path / "ckpt", model, GPT2, tp=1, pp=1)
    state, args = load_full_state(str(tmp_path / "ckpt"))
    loaded = build_model(GPT2, BuildContext(seed=0))
    pad = GPT2.padded_vocab_size(1) - GPT2.vocab_size  # the full state holds the real vocab
    state_padded = {k: F.pad(v, (0, 0, 0, pad)) if k in VOCAB_ROWS else v for k, v in state.items()}
    loaded.load_state_dict(state_padded, strict=True)
    loaded = loaded.to(test_device)
    tokens, _ = batch(GPT2, test_device)
    with torch.no_grad():
        ours = model(tokens)[..., : GPT2.vocab_size]
        torch.testing.assert_close(loaded(tokens)[..., : GPT2.vocab_size], ours)
        assert to_hf(state, args, str(tmp_path / "hf")) == "gpt2"
        hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
        hf = hf.to(test_device).eval()
        torch.testing.assert_close(hf(tokens).logits, ours, rtol=1e-4, atol=1e-4)


# --- inference --------------------------------------------------------------------------------


def _engine(cfg, device, dtype=torch.float32):
    state = mpu.single_process_state()
    chunks = build_model(cfg, BuildContext(state, seed=3, device=device, dtype=dtype))
    return InferenceModel(chunks, state, cfg.vocab_size, cfg.hidden_size)


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kv_cache_generation_equals_recomputing_the_prefix(test_device, variant):
    engine = _engine(VARIANTS[variant], test_device)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
    for params in (SamplingParams(8, greedy=True), SamplingParams(8, top_p=0.9, seed=4)):
        cached = generate(engine, prompts, params, use_cache=True)
        assert cached == generate(engine, prompts, params, use_cache=False)
        assert [len(c) - len(p) for c, p in zip(cached, prompts, strict=True)] == [8] * 3


@pytest.mark.slow  # over a second on 2 cores
def test_evaluation_on_the_device_equals_the_cpu(test_device):
    from megatron.data.tokenizers import build_tokenizer

    cfg = ModelConfig(**{**GPT2.__dict__, "vocab_size": 8192, "seq_length": 16})
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=MMAP / "vocab.json", merge_file=MMAP / "merges.txt"
    )
    docs = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world."]
    here = evaluate_loose_json(_engine(cfg, test_device), tok, docs, 16, 8, 2)
    cpu = evaluate_loose_json(_engine(cfg, torch.device("cpu")), tok, docs, 16, 8, 2)
    assert here["num_scored"] == cpu["num_scored"] > 0
    assert here["loss"] == pytest.approx(cpu["loss"], rel=1e-4)


# --- ring attention's blocks through the CUDA SDPA kernels (mpu/ring_blocks.py) ---------------
# Context parallelism needs 2+ ranks; its blocks are checked here in one process: the fused
# kernels against the explicit math on a row split over two key blocks, as the ring merges them.

_RING_KERNELS = [("flash", "bf16"), ("flash", "fp16"), ("efficient", "fp32"), ("efficient", "bf16")]


def _ring_kernel(device, name):
    needs_cuda(device, "the flash / memory-efficient SDPA kernels are CUDA kernels")
    if name == "flash" and not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("this torch build has no flash attention kernel")
    return {b.name: b for b in ring_blocks.FUSED_KERNELS}[name]


@pytest.mark.parametrize("kernel,precision", _RING_KERNELS)
def test_ring_attention_cuda_blocks_equal_the_math(test_device, kernel, precision):
    blocks, dtype = _ring_kernel(test_device, kernel), DTYPES[precision]
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(2, 4, 40, 64, generator=g) for _ in "qo")  # 40: not a multiple of 32
    k, v = (torch.randn(2, 4, 80, 64, generator=g) for _ in "kv")
    inputs = [t.to(test_device, dtype) for t in (q, k, v, dout)]
    mine = two_block_row(blocks, *inputs, 40)
    ref = two_block_row(ring_blocks.MATH, *inputs, 40)  # fp32 math on the same rounded inputs
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for what, a, r in zip(("out", "lse", "dq", "dk", "dv"), mine, ref, strict=True):
        assert_close_rel(a, r, tol, f"{kernel} {precision} {what}")


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_ring_attention_cuda_blocks_replay_their_dropout(test_device, kernel):
    """A block with dropout, backward from the philox seed/offset its forward returned: the
    same output and gradients as autograd through SDPA's own kernel with the same seed."""
    blocks = _ring_kernel(test_device, kernel)
    g = torch.Generator().manual_seed(8)
    q, k, v, dout = (torch.randn(2, 4, 48, 64, generator=g) for _ in range(4))
    q, k, v, dout = (t.to(test_device, torch.bfloat16) for t in (q, k, v, dout))
    scale, p = 0.125, 0.3
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for causal in (True, False):
        torch.manual_seed(21)
        out, lse, replay = blocks.forward(q, k, v, scale, causal, p)
        grads = blocks.backward(q, k, v, dout, out, lse.float(), scale, causal, p, replay)
        torch.manual_seed(21)
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend[kernel]):
            ref = F.scaled_dot_product_attention(
                qa, ka, va, dropout_p=p, is_causal=causal, scale=scale
            )
        ref.backward(dout)
        no_dropout, _, _ = blocks.forward(q, k, v, scale, causal, 0.0)
        assert not torch.allclose(out, no_dropout), "dropout 0.3 must change the output"
        torch.testing.assert_close(out, ref.detach(), msg=f"{kernel} causal={causal} out")
        for name, mine, want in zip("qkv", grads, (qa.grad, ka.grad, va.grad), strict=True):
            torch.testing.assert_close(mine, want, msg=f"{kernel} causal={causal} d{name}")


def test_ring_attention_picks_a_fused_kernel_on_cuda(test_device):
    needs_cuda(test_device, "which CUDA kernel ring attention's blocks use")
    select = ring_blocks.select_blocks
    assert select("auto", test_device, torch.float32, 64).name == "efficient"
    flash = torch.backends.cuda.is_flash_attention_available()
    ampere = torch.cuda.get_device_capability(test_device) >= (8, 0)
    expected = "flash" if flash and ampere else "efficient"
    assert select("auto", test_device, torch.bfloat16, 64).name == expected


# --- Triton kernels, compiled -----------------------------------------------------------------


# Every Triton op on: the softmax through the fused attention backend, the cross-entropy opt-in.
FUSED_KERNELS = KernelConfig(attention_backend="fused", cross_entropy_loss_fusion=True)


def _kernel_modules():
    from megatron.fused_kernels import (
        triton_activations,
        triton_cross_entropy,
        triton_norms,
        triton_softmax,
    )

    return triton_softmax, triton_norms, triton_activations, triton_cross_entropy


def test_triton_kernels_are_compiled_not_interpreted(test_device):
    needs_cuda(test_device, "Triton compiles for a GPU; on the CPU test_fused_kernels.py runs "
               "the same kernels in Triton's interpreter")  # fmt: skip
    pytest.importorskip("triton", reason="Triton is not installed")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert os.environ.get("TRITON_INTERPRET") != "1", "TRITON_INTERPRET=1 is set"
    kernels = {
        f"{m.__name__}.{name}": v
        for m in _kernel_modules()
        for name, v in vars(m).items()
        if isinstance(v, (JITFunction, InterpretedFunction))
    }
    assert len(kernels) >= 4, kernels
    interpreted = [k for k, v in kernels.items() if isinstance(v, InterpretedFunction)]
    assert not interpreted, f"defined under TRITON_INTERPRET=1: {interpreted}"
    # Each op passes its self-check on the device: strict mode raises the check's own error
    # (a compile failure, a disagreement) instead of warning and falling back to torch.
    fused = select_ops(FUSED_KERNELS, test_device, strict=True, follow_table=False)
    picked = (fused.softmax, fused.add_norm, fused.bias_gelu, fused.swiglu, fused.cross_entropy)
    assert picked == ("triton",) * 5, fused.describe()


def _kernel_cases(device, dtype):
    sm, norms, acts, ce = _kernel_modules()
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    rows, hidden, vocab = 64, 1000, 5000  # rows over one block, ragged last block
    x, res, w, b = r(rows, hidden), r(rows, hidden), r(hidden), r(hidden)
    target = torch.randint(0, vocab, (rows,), generator=g).to(device)
    return {
        "causal softmax": (
            lambda s: sm.scaled_upper_triang_masked_softmax(s, 0.125),
            lambda s: sm.torch_scaled_upper_triang_masked_softmax(s, 0.125),
            [r(2, 3, 300, 300)],
        ),
        "add + LayerNorm": (
            lambda *a: norms.fused_add_layer_norm(*a, 1e-5),
            lambda *a: norms.torch_add_layer_norm(*a, 1e-5),
            [x, res, w, b],
        ),
        "add + RMSNorm": (
            lambda *a: norms.fused_add_rms_norm(*a, 1e-5),
            lambda *a: norms.torch_add_rms_norm(*a, 1e-5),
            [x, res, w],
        ),
        "bias + GeLU": (acts.bias_gelu, acts.torch_bias_gelu, [x, b]),
        "SwiGLU": (acts.swiglu, acts.torch_swiglu, [r(rows, 2 * hidden)]),
        "cross-entropy": (
            lambda lg: ce.vocab_parallel_cross_entropy_fused(lg, target),
            lambda lg: mpu.vocab_parallel_cross_entropy(lg.float(), target),
            [r(rows, vocab)],
        ),
    }


def _run(fn, inputs, upstream=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if upstream is None:
        g = torch.Generator().manual_seed(1)
        upstream = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, upstream)
    return outs, [t.grad for t in leaves], upstream


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_compiled_triton_kernels_match_their_torch_references(test_device, precision):
    needs_cuda(test_device, "compiled Triton kernels (the CPU interpreter: test_fused_kernels.py)")
    pytest.importorskip("triton", reason="Triton is not installed")
    dtype = DTYPES[precision]
    for name, (kernel, reference, inputs) in _kernel_cases(test_device, dtype).items():
        outs, grads, upstream = _run(kernel, inputs)
        wide = [t.double() for t in inputs]
        ref_outs, ref_grads, _ = _run(reference, wide, [u.double() for u in upstream])
        for i, (o, ro) in enumerate(zip(outs, ref_outs, strict=True)):
            assert o.dtype == (torch.float32 if name == "cross-entropy" else dtype), name
            assert_close_rel(o, ro, TOL[dtype] / 2, f"{name} output {i} ({precision})")
        for i, (gr, rg) in enumerate(zip(grads, ref_grads, strict=True)):
            assert_close_rel(gr, rg, TOL[dtype] / 2, f"{name} grad of input {i} ({precision})")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_whole_gpt_through_the_compiled_kernels(test_device, variant):
    needs_cuda(test_device, "compiled Triton kernels (the CPU interpreter: test_fused_model.py)")
    pytest.importorskip("triton", reason="Triton is not installed")
    cfg = VARIANTS[variant]
    fused = select_ops(FUSED_KERNELS, test_device, strict=True, follow_table=False)
    picked = (fused.softmax, fused.add_norm, fused.bias_gelu, fused.swiglu, fused.cross_entropy)
    assert picked == ("triton",) * 5, fused.describe()
    tokens, labels = batch(cfg, test_device)
    results = []
    for ops in (TORCH_OPS, fused):
        model = GPTModel(cfg, BuildContext(seed=3, device=test_device, ops=ops))
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    (loss0, grads0), (loss1, grads1) = results
    assert_close_rel(loss1, loss0, 1e-4, "loss")
    for name in grads0:
        assert_close_rel(grads1[name], grads0[name], 1e-3, f"grad of {name}")


# --- mixture of experts (EP = 1, TP = 1: the multi-rank paths need several GPUs) ------------

MOE = {
    "gelu": ModelConfig(
        **{**GPT2.__dict__, "num_experts": 4, "moe_ffn_hidden_size": 96, "moe_z_loss_coeff": 1e-3}
    ),
    "swiglu-shared": ModelConfig(
        **{
            **LLAMA.__dict__,
            "num_experts": 4,
            "moe_ffn_hidden_size": 64,
            "moe_shared_expert_intermediate_size": 32,
            "moe_shared_expert_gate": True,
        }
    ),
}
MOE_AUX = 0.01  # the load-balancing loss joins the backward pass (training mode)


class _Routing:
    """Stands in for router.route (softmax routers): `record` keeps each call's chosen experts
    (T, k); `replay` returns them in the same order, with this model's probabilities for them,
    so a float64 reference takes the device's discrete choices (a near tie may fall either
    way in bf16) and counts how many of its own choices agree."""

    def __init__(self, real):
        self.real, self.chosen, self.agree, self.total = real, [], 0, 0

    def record(self, logits, m, expert_bias=None):
        probs, experts, scores = self.real(logits, m, expert_bias)
        self.chosen.append(experts.detach().cpu())
        return probs, experts, scores

    def replay(self, logits, m, expert_bias=None):
        _, own, scores = self.real(logits, m, expert_bias)
        experts = self.chosen.pop(0).to(logits.device)
        self.agree += int((own.sort(1).values == experts.sort(1).values).all(1).sum())
        self.total += experts.size(0)
        return torch.softmax(logits.gather(1, experts), dim=-1), experts, scores


def _moe_model(cfg, device, dtype=torch.float32, grouped=False):
    model = GPTModel(
        cfg, BuildContext(seed=3, device=device, dtype=dtype, moe_grouped_gemm=grouped)
    )
    set_moe_loss_scale(model, 1.0)
    return model


def _moe_grads(model):
    layer = model.layers["0"].mlp
    grads = {
        "embedding": model.embedding.word_embeddings.weight.grad,
        "router": layer.router.weight.grad,
        "expert weight1": layer.experts.weight1.grad,
        "expert weight2": layer.experts.weight2.grad,
    }
    if layer.shared_expert is not None:
        grads["shared expert"] = layer.shared_expert.dense_4h_to_h.weight.grad
    return grads


@pytest.mark.parametrize("experts", ["grouped", "looped"])
@pytest.mark.parametrize("variant", list(MOE))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_gpt_forward_backward_matches_float64_reference(
    test_device, monkeypatch, variant, precision, experts
):
    """The MoE GPT on the device against the same weights in float64 on the CPU (looped
    experts there, whose per-token math tests/model/test_moe.py checks): logits, the loss, and
    gradients that include the aux and z losses'. The reference follows the device's routing."""
    cfg, dtype = MOE[variant], DTYPES[precision]
    cfg = ModelConfig(**{**cfg.__dict__, "moe_aux_loss_coeff": MOE_AUX})
    model = _moe_model(cfg, test_device, dtype, grouped=experts == "grouped")
    ref = _moe_model(cfg, torch.device("cpu"), torch.float64)
    ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
    tokens, labels = batch(cfg, test_device)
    routing = _Routing(router.route)
    monkeypatch.setattr(router, "route", routing.record)
    logits = model(tokens)
    loss = model(tokens, labels=labels)
    loss.float().mean().backward()
    monkeypatch.setattr(router, "route", routing.replay)
    ref_logits = ref(tokens.cpu())
    ref_loss = ref(tokens.cpu(), labels=labels.cpu())
    ref_loss.mean().backward()
    assert not routing.chosen and routing.total == 2 * 2 * tokens.numel()  # 2 runs x 2 layers
    agreement = routing.agree / routing.total
    assert agreement >= (0.97 if dtype == torch.float32 else 0.85), f"routing {agreement:.1%}"
    assert logits.dtype == dtype and logits.device == tokens.device
    vocab = cfg.vocab_size
    assert_close_rel(logits[..., :vocab], ref_logits[..., :vocab], TOL[dtype], "logits")
    assert_close_rel(loss, ref_loss, TOL[dtype], "per-token loss")
    ref_grads = _moe_grads(ref)
    for name, grad in _moe_grads(model).items():
        assert grad is not None and grad.device == tokens.device, name
        want = ref_grads[name][:vocab] if name == "embedding" else ref_grads[name]
        got = grad[:vocab] if name == "embedding" else grad
        assert_close_rel(got, want, 4 * TOL[dtype], f"{name} grad ({experts}, {precision})")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_grouped_experts_equal_the_loop_on_the_device(
    test_device, monkeypatch, record_property, precision
):
    """One MoE layer, the same input and weights: --moe-grouped-gemm (on the path that
    grouped_gemm_path names for this device and dtype, asserted by counting the calls) equals
    the loop over experts, output and gradients. The path goes into the JUnit XML."""
    dtype = DTYPES[precision]
    path = moe.grouped_gemm_path(test_device, dtype)
    record_property("moe_grouped_gemm_path", f"{test_device} {precision}: {path}")
    if test_device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        hopper = torch.cuda.get_device_capability(test_device)[0] in (9, 10)
        assert (path == "torch._grouped_mm") == (hopper and dtype == torch.bfloat16), path
    calls = {"torch._grouped_mm": 0, "padded bmm": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    if hasattr(torch, "_grouped_mm"):
        monkeypatch.setattr(torch, "_grouped_mm", counted("torch._grouped_mm", torch._grouped_mm))
    monkeypatch.setattr(moe, "padded_bmm", counted("padded bmm", moe.padded_bmm))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 32, 64, generator=g).to(test_device, dtype)
    dout = torch.randn(3, 32, 64, generator=g).to(test_device, dtype)
    results = []
    for grouped in (False, True):
        layer = _moe_model(MOE["swiglu-shared"], test_device, dtype, grouped).layers["0"].mlp
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.backward(dout)
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append((out.detach(), xi.grad, grads))
    assert calls[path] == 2 and sum(calls.values()) == 2, f"{path} expected: {calls}"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    (out0, dx0, grads0), (out1, dx1, grads1) = results
    assert_close_rel(out1, out0, tol, f"output ({path})")
    assert_close_rel(dx1, dx0, tol, f"input grad ({path})")
    for name, grad in grads0.items():
        assert_close_rel(grads1[name], grad, tol, f"grad of {name} ({path})")


# --- pretrain_gpt2.py, one rank ---------------------------------------------------------------


_LAUNCHER = ("TRITON_INTERPRET", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _pretrain(device, corpus, save, *extra, iters=6, precision=None):
    """pretrain_gpt2.py as a user starts it on one device: NCCL and bf16 on a GPU, gloo and
    fp32 on the CPU; (stdout, the logged losses)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    precision = precision or (["--bf16"] if device.type == "cuda" else [])
    argv = flags(corpus, *precision, "--distributed-backend", backend, *extra, iters=iters)
    cmd = [sys.executable, "pretrain_gpt2.py", *argv, "--save", str(save), "--save-interval", "3"]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER}
    env["CUDA_VISIBLE_DEVICES"] = str(device.index or 0) if device.type == "cuda" else ""
    if device.type == "cuda":  # a kernel failing its check stops the run, not a silent fallback
        env["MEGATRON_KERNELS_STRICT"] = "1"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr}"
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", done.stdout)]
    assert losses and all(map(lambda v: v == v and v < 1e4, losses)), done.stdout[-2000:]
    return done.stdout, losses


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "deepspeed"])
def test_pretrain_gpt2_one_rank_trains_saves_and_resumes(
    test_device,
    data_prefix,
    tmp_path,
    backend,
):
    extra = []
    if backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            pytest.skip("DeepSpeed is not installed (bench/gpu_check.sh installs it)")
        extra = ["--deepspeed", "--zero-stage", "1"]
    out, losses = _pretrain(test_device, data_prefix, tmp_path / "ck", *extra, iters=6)
    assert losses[-1] < losses[0], "the toy corpus is learnable: the loss must fall"
    if test_device.type == "cuda":
        assert "MFU:" in out and "tokens per second:" in out
    # Resume from iteration 6 for 2 more: the checkpoint (weights, optimizer, device RNG) loads.
    load = ["--load", str(tmp_path / "ck")]
    out, more = _pretrain(test_device, data_prefix, tmp_path / "ck", *extra, *load, iters=8)
    assert re.search(r"iteration\s+7/\s*8", out) and len(more) == 2, out[-2000:]


@pytest.mark.slow
def test_pretrain_gpt2_fp16_loss_scale_falls_from_its_initial_value(
    test_device,
    data_prefix,
    tmp_path,
):
    needs_cuda(test_device, "fp16 training is for GPUs (the CPU suite covers fp16 on gloo ranks)")
    scale = ["--initial-loss-scale", str(2.0**40), "--hysteresis", "1"]
    out, _ = _pretrain(test_device, data_prefix, tmp_path / "ck", *scale, precision=["--fp16"])
    scales = [float(x) for x in re.findall(r"loss scale: ([0-9.]+)", out)]
    skipped = [int(x) for x in re.findall(r"number of skipped iterations:\s+(\d+)", out)]
    assert scales[-1] < 2.0**40 and sum(skipped) >= 1, out[-2000:]


@pytest.mark.slow
def test_pretrain_gpt2_one_rank_moe_trains_saves_and_resumes_exactly(
    test_device,
    data_prefix,
    tmp_path,
):
    """An MoE GPT (4 experts, top-2, grouped GEMM, aux loss) on one rank: it learns, and its
    checkpoint of step 6 resumed for 2 steps gives the losses of the 8 straight steps (on the
    CPU bit for bit; on a GPU within bf16 rounding, whose atomics are not deterministic)."""
    moe_flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm"]
    moe_flags += ["--moe-aux-loss-coeff", "0.01"]
    ck = tmp_path / "ck"
    out, straight = _pretrain(test_device, data_prefix, ck, *moe_flags, iters=8)
    assert straight[-1] < straight[0], "the toy corpus is learnable: the loss must fall"
    assert "load balancing loss:" in out and "expert load max/mean:" in out, out[-2000:]
    # The straight run saved at 3, 6 and 8: make it a run stopped after step 6 (one process
    # fewer than training 6 steps apart; the same save code wrote step 6).
    shutil.rmtree(ck / "iter_0000008")
    (ck / "latest_checkpointed_iteration.txt").write_text("6")
    load = ["--load", str(ck)]
    out, resumed = _pretrain(test_device, data_prefix, ck, *moe_flags, *load, iters=8)
    assert re.search(r"iteration\s+7/\s*8", out) and len(resumed) == 2, out[-2000:]
    if test_device.type == "cuda":
        assert resumed == pytest.approx(straight[-2:], rel=1e-2), (resumed, straight)
    else:
        assert resumed == straight[-2:], (resumed, straight)
