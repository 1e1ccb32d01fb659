"""GPTModel: equal to a plain reference GPT at TP = 1, and the same model at TP = 1, 2, 4."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.model.transformer import TransformerLayer
from megatron.models.gpt.model import GPTModel
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import run_distributed
from tests.helpers.models import TINY as BASE
from tests.helpers.reference_gpt import RefGPT, load_from_megatron

# vocab 100 pads to 104 / 112 / 128 at TP 1 / 2 / 4: the padding differs, the model must not.
VARIANTS = {
    "gpt2": ModelConfig(**BASE),
    "rope-rmsnorm-swiglu-gqa-untied": ModelConfig(
        **BASE,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=4,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    ),
}
DT = torch.float64


def _batch(cfg, batch=3):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)
    return tokens, labels


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tp1_model_equals_plain_reference_gpt(name):
    cfg = VARIANTS[name]
    model = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    ref = RefGPT(cfg).to(DT)
    load_from_megatron(ref, model)
    tokens, labels = _batch(cfg)
    logits = model(tokens)
    assert logits.shape[-1] == cfg.padded_vocab_size(1)
    assert torch.isinf(logits[..., cfg.vocab_size :]).all(), "padding logits must be masked"
    torch.testing.assert_close(logits[..., : cfg.vocab_size], ref(tokens), rtol=1e-10, atol=1e-10)
    loss, ref_loss = model(tokens, labels=labels), ref(tokens, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    loss.mean().backward()
    ref_loss.mean().backward()
    torch.testing.assert_close(
        model.embedding.word_embeddings.weight.grad[: cfg.vocab_size],
        ref.wte.weight.grad,
        rtol=1e-9,
        atol=1e-12,
    )
    torch.testing.assert_close(
        model.layers["0"].self_attention.dense.weight.grad,
        ref.blocks[0].o.weight.grad,
        rtol=1e-9,
        atol=1e-12,
    )


def test_weight_init_statistics():
    cfg = dataclasses.replace(VARIANTS["gpt2"], num_layers=8, hidden_size=256, vocab_size=1000)
    model = GPTModel(cfg, BuildContext(seed=1))
    sd = model.state_dict()
    std = sd["layers.0.self_attention.query_key_value.weight"].std().item()
    scaled = sd["layers.0.mlp.dense_4h_to_h.weight"].std().item()
    assert abs(std - 0.02) < 0.001
    assert abs(scaled - 0.02 / 4.0) < 0.0005  # 1 / sqrt(2 x 8 layers)
    assert torch.equal(sd["layers.0.input_layernorm.weight"], torch.ones(256))
    assert torch.equal(sd["layers.0.mlp.dense_h_to_4h.bias"], torch.zeros(1024))
    assert not sd["embedding.word_embeddings.weight"][1000:].any(), "padding rows are zero"
    other = GPTModel(cfg, BuildContext(seed=2)).state_dict()
    assert not torch.equal(
        sd["layers.0.mlp.dense_4h_to_h.weight"], other["layers.0.mlp.dense_4h_to_h.weight"]
    )


def _gather_full(param, state):
    """The full tensor of a (possibly TP-split) parameter or gradient, via all-gather."""
    if not mpu.is_tensor_parallel(param) or state.tp_size == 1:
        return None
    return lambda t: mpu.unshard(
        _all_gather(t, state.tp_group, state.tp_size), param.partition_dim, param.partition_stride
    )


def _all_gather(t, group, size):
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _compare_to_reference(cfg, state, ref, ref_loss, tokens, labels):
    model = GPTModel(cfg, BuildContext(state, seed=3, dtype=DT))
    loss = model(tokens, labels=labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    loss.mean().backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = _gather_full(p, state)
        weight = full(p.detach()) if full else p.detach()
        grad = full(p.grad) if full else p.grad
        expected_w, expected_g = ref_params[name].detach(), ref_params[name].grad
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            rows = cfg.vocab_size
            assert not grad[rows:].any(), f"{name}: padding rows got gradient"
            weight, grad = weight[:rows], grad[:rows]
            expected_w, expected_g = expected_w[:rows], expected_g[:rows]
        torch.testing.assert_close(
            weight, expected_w, rtol=0, atol=0, msg=lambda m, n=name: f"weight {n}: {m}"
        )
        torch.testing.assert_close(
            grad,
            expected_g,
            rtol=1e-8,
            atol=1e-12,
            msg=lambda m, n=name: f"grad {n} at TP={state.tp_size}: {m}",
        )


def _tp_worker(rank, world):
    for cfg in VARIANTS.values():
        tokens, labels = _batch(cfg)
        ref = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
        ref_loss = ref(tokens, labels=labels)
        ref_loss.mean().backward()
        for tp in (4, 2):
            state = initialize_model_parallel(tp, 1)
            _compare_to_reference(cfg, state, ref, ref_loss.detach(), tokens, labels)
            destroy_model_parallel(state)
    return True


@pytest.mark.slow
def test_same_loss_and_gradients_at_tp1_tp2_tp4():
    assert run_distributed(_tp_worker, 4) == [True] * 4


def test_activation_checkpoint_replays_dropout_exactly():
    cfg = dataclasses.replace(VARIANTS["gpt2"], hidden_dropout=0.3, attention_dropout=0.3)
    state = mpu.single_process_state()
    tracker = mpu.RNGStatesTracker("cpu")
    tracker.add(mpu.MODEL_PARALLEL_RNG, 99)
    layer = TransformerLayer(cfg, BuildContext(state, dtype=DT, rng_tracker=tracker))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x0 = torch.randn(2, cfg.seq_length, cfg.hidden_size, dtype=DT)
    results = []
    for use_checkpoint in (False, True):
        torch.manual_seed(5)
        tracker.set_states({mpu.MODEL_PARALLEL_RNG: _fresh_state(99)})
        layer.zero_grad()
        x = x0.clone().requires_grad_()
        y = mpu.checkpoint(layer, tracker, x) if use_checkpoint else layer(x)
        y.pow(2).sum().backward()
        results.append(
            (
                y.detach(),
                x.grad,
                [p.grad.clone() for p in layer.parameters()],
                torch.get_rng_state(),
                tracker.get_states()[mpu.MODEL_PARALLEL_RNG],
            )
        )
    (y0, dx0, g0, cpu0, mp0), (y1, dx1, g1, cpu1, mp1) = results
    assert not torch.equal(layer.eval()(x0), y0), "dropout must be active in this test"
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(cpu0, cpu1) and torch.equal(mp0, mp1), "RNG streams must end in step"


def _fresh_state(seed):
    return torch.Generator().manual_seed(seed).get_state()


def _loss_and_grads(model, tokens, labels):
    model.zero_grad()
    loss = model(tokens, labels=labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_is_applied_after_building_by_name_and_changes_no_number(granularity):
    from megatron.config.schema_recompute import RecomputeConfig
    from megatron.model.parallelize import parallelize
    from megatron.model.recompute import LayerRecompute

    cfg = ModelConfig(**{**BASE, "num_layers": 3})
    tokens, labels = _batch(cfg)
    plain = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    model = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    names = list(model.state_dict())
    recompute = RecomputeConfig(granularity=granularity, method="uniform", num_layers=2)
    assert parallelize(model, mpu.single_process_state(), recompute) is model
    assert list(model.state_dict()) == names, "state-dict names must not change"
    selective = [layer.self_attention.recompute_core for layer in model.layers.values()]
    if granularity == "selective":
        assert all(selective) and model.layer_recompute is None
    else:
        assert not any(selective) and model.layer_recompute == LayerRecompute("uniform", 2)
    assert plain.layer_recompute is None and not plain.layers["0"].self_attention.recompute_core
    (l0, g0), (l1, g1) = (
        _loss_and_grads(plain, tokens, labels),
        _loss_and_grads(model, tokens, labels),
    )
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0)


@pytest.mark.slow  # Inductor compiles the whole model: ~20 s on 2 cores
def test_compile_is_applied_to_the_chunk_as_a_module_keeping_its_names():
    from megatron.model.parallelize import parallelize

    cfg = ModelConfig(**BASE)
    tokens, labels = _batch(cfg)
    plain = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    model = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    parallelize(model, mpu.single_process_state(), torch_compile=True)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert model._compiled_call_impl is not None, "the chunk, head and loss included"
    assert "forward" not in vars(model), "the module is compiled, not its forward"
    (l0, g0), (l1, g1) = (
        _loss_and_grads(plain, tokens, labels),
        _loss_and_grads(model, tokens, labels),
    )
    torch.testing.assert_close(l1, l0, rtol=1e-10, atol=1e-10)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-10)


def test_attention_mask_types_say_what_they_carry():
    from megatron.model.attention.masks import CAUSAL, AttentionMask, MaskType

    with pytest.raises(ValueError, match="causal attention mask takes no keep tensor"):
        AttentionMask(MaskType.CAUSAL, torch.ones(1, 1, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding attention mask needs a keep tensor"):
        AttentionMask(MaskType.PADDING)
    pad = AttentionMask.padding(torch.tensor([[1, 1, 0]]))
    assert pad.type is MaskType.PADDING and pad.keep.shape == (1, 1, 3, 3)
    assert pad.keep[0, 0, 0].tolist() == [True, True, False]  # every query: the real keys
    docs = AttentionMask.documents(torch.tensor([[0, 0, 1]]))
    assert docs.type is MaskType.ARBITRARY
    assert docs.keep[0, 0].tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    # A padding mask of all-real tokens is not causal: the first query sees the last key.
    cfg = ModelConfig(**BASE)
    layer = TransformerLayer(cfg, BuildContext(dtype=DT)).eval()
    with torch.no_grad():  # a bare layer's weights are uninitialized memory: the model inits them
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
    x = torch.randn(2, 5, cfg.hidden_size, dtype=DT)
    full = layer(x, None, None, AttentionMask.padding(torch.ones(2, 5)))
    causal = layer(x, None, None, CAUSAL)
    torch.testing.assert_close(full[:, -1], causal[:, -1], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(full[:, 0], causal[:, 0])
