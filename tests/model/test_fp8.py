"""--fp8-format on a built GPT (megatron.model.fp8) on the CPU, through torchao's emulation
(float8 rounding, fp32 GEMMs): which linears take float8, the loss and gradients against the
same model in bf16, TP = 2 (gloo, with and without sequence parallelism) against TP = 1, and
what is refused.

Tolerances, against bf16 (the toy GPT below, 2 x 64 tokens): the loss within 0.1% relative
(measured 4e-6); each gradient within 20% relative Frobenius error with e5m2 gradients
(hybrid; measured at most 10.6%), 15% with e4m3 (8.1%): each of the 8 float8 linears adds its
~4-6% rounding to what flows back. TP = 2 against TP = 1: a shard is scaled on its own, so the
same float8 rounding on other blocks: the loss within 0.1% (1e-5), gradients within 20%
(11.4%). Sequence parallelism changes no float8 operand: TP = 2 with it gives the float8
linears' weights the same gradients, bit for bit (the gradients of replicated norms and biases,
summed over the two sequence halves in bf16, within 3%).
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig, PrecisionConfig
from megatron.model.context import BuildContext
from megatron.model.fp8 import apply_fp8
from megatron.model.parallelize import parallelize
from megatron.models.gpt.model import GPTModel
from megatron.mpu import fp8
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed

pytest.importorskip("torchao", reason=f"pip install {fp8.TORCHAO_REQUIREMENT} (the fp8 extra)")

BF16 = torch.bfloat16
CFG = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=100,
    make_vocab_size_divisible_by=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
HYBRID = PrecisionConfig(bf16=True, fp8_format="hybrid")
LINEARS = ("self_attention.query_key_value", "self_attention.dense")
LINEARS += ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def _batch(cfg=CFG, batch=2):
    g = torch.Generator().manual_seed(7)
    return tuple(
        torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g) for _ in "tl"
    )


def _loss_and_grads(model, tokens, labels):
    loss = model(tokens, labels=labels).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("precision", [HYBRID, dataclasses.replace(HYBRID, fp8_format="e4m3")])
def test_a_gpt_in_float8_matches_bf16_within_the_stated_tolerance(precision):
    ref = GPTModel(CFG, BuildContext(seed=3, dtype=BF16))
    model = copy.deepcopy(ref)
    report = apply_fp8(model, precision, emulate=True)
    assert report.converted == [f"layers.{i}.{name}" for i in range(2) for name in LINEARS]
    assert report.kept == []
    tokens, labels = _batch()
    ref_loss, ref_grads = _loss_and_grads(ref, tokens, labels)
    loss, grads = _loss_and_grads(model, tokens, labels)
    assert abs(loss - ref_loss) < 1e-3 * ref_loss
    tol = 0.20 if precision.fp8_format == "hybrid" else 0.15
    errors = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
    assert max(errors.values()) < tol, errors
    fp8_weights = [f"layers.0.{name}.weight" for name in LINEARS]
    assert min(errors[n] for n in fp8_weights) > 0.01, "the linears ran in bf16"


def test_the_embedding_and_output_head_stay_bf16_and_odd_shapes_are_named():
    cfg = dataclasses.replace(CFG, ffn_hidden_size=72, untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg, BuildContext(seed=3, dtype=BF16))
    report = apply_fp8(model, HYBRID, emulate=True)
    assert model.head.output_layer.fp8 is None
    assert model.layers["0"].self_attention.query_key_value.fp8 is report.matmul
    assert model.layers["0"].mlp.dense_h_to_4h.fp8 is None
    assert "layers.0.mlp.dense_h_to_4h (72 x 64)" in report.kept
    assert "layers.1.mlp.dense_4h_to_h (64 x 72)" in report.describe()
    assert len(report.converted) == 4


def test_parallelize_applies_fp8_from_the_precision_section(monkeypatch, capsys):
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    model = GPTModel(CFG, BuildContext(seed=3, dtype=BF16))
    parallelize(model, mpu.single_process_state(), precision=PrecisionConfig(bf16=True))
    assert model.layers["0"].mlp.dense_4h_to_h.fp8 is None  # no --fp8-format: untouched
    parallelize(model, mpu.single_process_state(), precision=HYBRID)
    assert model.layers["0"].mlp.dense_4h_to_h.fp8 is not None
    assert "> fp8 (hybrid): 8 linears in float8 tensorwise scaling" in capsys.readouterr().out


def test_what_cannot_run_float8_is_refused_with_the_reason(monkeypatch):
    """The device and torchao; the flags (--bf16, experts) are refused by the config rules
    (tests/config/test_rules_fp8.py)."""
    monkeypatch.delenv(fp8.EMULATE_ENV, raising=False)
    model = GPTModel(CFG, BuildContext(seed=3, dtype=BF16))
    with pytest.raises(ConfigError, match="the cpu has no float8 matmul"):
        apply_fp8(model, HYBRID)
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"pip install torchao==0\.18\.0"):
        apply_fp8(model, HYBRID, emulate=True)


def _tp_model(state):
    model = GPTModel(CFG, BuildContext(state, seed=3, dtype=BF16))
    apply_fp8(model, HYBRID, emulate=True)
    return model


def _full_grads(model, grads, state):
    """Every gradient as the whole tensor (TP shards all-gathered; sequence-parallel ones
    summed over TP first)."""
    out = {}
    for name, p in model.named_parameters():
        g = grads[name]
        if mpu.is_sequence_parallel(p):
            dist.all_reduce(g, group=state.tp_group)
        if mpu.is_tensor_parallel(p):
            parts = [torch.empty_like(g) for _ in range(state.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=state.tp_group)
            g = mpu.unshard(parts, p.partition_dim, p.partition_stride)
        out[name] = g[: CFG.vocab_size] if name.endswith("word_embeddings.weight") else g
    return out


def _tp2_worker(rank, world):
    tokens, labels = _batch()
    ref = GPTModel(CFG, BuildContext(seed=3, dtype=BF16))
    apply_fp8(ref, HYBRID, emulate=True)
    ref_loss, ref_grads = _loss_and_grads(ref, tokens, labels)
    ref_grads["embedding.word_embeddings.weight"] = ref_grads["embedding.word_embeddings.weight"][
        : CFG.vocab_size
    ]
    runs = {}
    for sp in (False, True):
        state = initialize_model_parallel(2, sequence_parallel=sp)
        model = parallelize(_tp_model(state), state)
        loss, grads = _loss_and_grads(model, tokens, labels)
        runs[sp] = loss, _full_grads(model, grads, state)
        destroy_model_parallel(state)
    for sp, (loss, grads) in runs.items():
        assert abs(loss - ref_loss) < 1e-3 * ref_loss, (sp, loss, ref_loss)
        errors = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
        assert max(errors.values()) < 0.20, (sp, errors)
    (loss, grads), (sp_loss, sp_grads) = runs[False], runs[True]
    assert abs(sp_loss - loss) < 1e-3 * loss, (sp_loss, loss)
    for name, g in grads.items():
        if name.endswith(".weight") and any(f".{linear}." in name for linear in LINEARS):
            assert torch.equal(sp_grads[name], g), f"{name}: sequence parallelism changed it"
        else:  # summed over the sequence halves then over TP, in bf16: rounding-sized
            assert _rel(sp_grads[name], g) < 0.03, name
    return True


@pytest.mark.slow
def test_tp2_in_float8_equals_tp1_in_float8_with_and_without_sequence_parallelism():
    assert run_distributed(_tp2_worker, 2) == [True, True]
