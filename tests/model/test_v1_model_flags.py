"""Megatron-LM v1.x model and numerics flags: each changes what it should, and only that.

qk layer scaling, fp32 attention softmax, fp16 LM cross-entropy, OpenAI GeLU, post-LN residual,
layer sharing (--num-unique-layers / --param-sharing-style), exponential LR decay, the v1.x
fusion spellings; TP2 and PP2 against one process; the Hugging Face export of these models.
"""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.config.schema import ModelConfig
from megatron.config.schema_recompute import RecomputeConfig
from megatron.fused_kernels import TORCH_OPS
from megatron.model.attention.standard import KVCache, ParallelAttention
from megatron.model.context import BuildContext
from megatron.model.parallelize import parallelize
from megatron.model.transformer import TransformerLayer
from megatron.models.gpt.model import GPTModel
from tests.helpers.distributed import run_distributed
from tests.helpers.models import SMALL

BASE = dict(SMALL, num_layers=4, vocab_size=50, make_vocab_size_divisible_by=8)
V1 = dict(
    apply_query_key_layer_scaling=True,
    openai_gelu=True,
    apply_residual_connection_post_layernorm=True,
    num_unique_layers=2,
)
ST = mpu.single_process_state()
FUSED_BDA = dataclasses.replace(TORCH_OPS, bias_dropout_add="compile")  # --bias-dropout-fusion


def _tokens(cfg, batch=2, seed=1):
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=_gen(seed))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _init(module, seed=0):
    """Modules built outside GPTModel are uninitialized: draw small weights."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=_gen(seed)) * 0.2)
    return module


def _attention(cfg, layer_number=1, ops=TORCH_OPS, dtype=torch.float32):
    attn = ParallelAttention(cfg, BuildContext(ST, dtype=dtype, ops=ops), layer_number=layer_number)
    return _init(attn)


def _layer(cfg):
    layer = _init(TransformerLayer(cfg, BuildContext(ST)), seed=4)
    with torch.no_grad():  # norms near their usual weights
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.add_(1.0)
    return layer


# ---- attention: qk layer scaling and the fp32 softmax ----------------------------------------


def test_qk_layer_scaling_equals_plain_attention_in_fp32():
    cfg = ModelConfig(**BASE)
    x = torch.randn(2, 8, 32, generator=_gen(0))
    for backend in ("sdpa", "unfused"):
        ops = dataclasses.replace(TORCH_OPS, attention_backend=backend)
        plain = _attention(cfg, ops=ops)
        scaled = _attention(dataclasses.replace(cfg, apply_query_key_layer_scaling=True), 7, ops)
        scaled.load_state_dict(plain.state_dict())
        torch.testing.assert_close(scaled(x), plain(x), rtol=1e-5, atol=1e-6)
    assert scaled.qk_coeff == 7.0 and plain.qk_coeff is None


def _explicit_fp32_softmax(attn, x, coeff):
    """The attention v1.x computes: scores in the input dtype, softmax in fp32."""
    b, s, _ = x.shape
    qkv = attn.query_key_value(x).view(b, s, attn.heads, 3, attn.head_dim)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (b, n, s, d)
    if coeff is None:  # scores q k^T, scaled by 1/sqrt(d) in fp32
        scores, scale = torch.matmul(q, k.transpose(-1, -2)), 1 / math.sqrt(attn.head_dim)
    else:  # scores q k^T / (sqrt(d) L) from the GEMM, multiplied back by L in fp32
        scores = torch.baddbmm(
            torch.empty(b * attn.heads, s, s, dtype=x.dtype),
            q.reshape(-1, s, attn.head_dim),
            k.reshape(-1, s, attn.head_dim).transpose(1, 2),
            beta=0.0,
            alpha=1 / (math.sqrt(attn.head_dim) * coeff),
        ).view(b, attn.heads, s, s)
        scale = coeff
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    z = (scores.float() * scale).masked_fill(~causal, float("-inf"))
    probs = z.softmax(-1).to(x.dtype)
    ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
    return attn.dense(ctx)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_bf16_attention_takes_the_fp32_softmax_path(dtype):
    cfg = ModelConfig(**BASE)
    x = torch.randn(2, 8, 32, generator=_gen(0)).to(dtype)
    fp32_ops = dataclasses.replace(TORCH_OPS, softmax_in_fp32=True)
    for attn, coeff in (
        (_attention(cfg, ops=fp32_ops, dtype=dtype), None),  # --attention-softmax-in-fp32
        (_attention(dataclasses.replace(cfg, **V1), 3, dtype=dtype), 3.0),  # qk layer scaling
    ):
        with torch.no_grad():
            assert torch.equal(attn(x), _explicit_fp32_softmax(attn, x, coeff))
    # In fp32 the flag keeps SDPA: bit for bit the output without it.
    plain, flagged = _attention(cfg), _attention(cfg, ops=fp32_ops)
    flagged.load_state_dict(plain.state_dict())
    x32 = x.float()
    assert torch.equal(plain(x32), flagged(x32))


def test_qk_layer_scaling_keeps_fp16_scores_finite():
    """The reason for the flag: q k^T past fp16's 65504 is inf without it."""
    cfg = dataclasses.replace(ModelConfig(**BASE), num_layers=24)
    ops = dataclasses.replace(TORCH_OPS, attention_backend="unfused")
    plain = _attention(cfg, ops=ops, dtype=torch.float16)
    scaled = _attention(dataclasses.replace(cfg, apply_query_key_layer_scaling=True), 24, ops)
    scaled = scaled.half()
    with torch.no_grad():
        plain.query_key_value.weight.mul_(200.0)  # huge queries and keys
        scaled.load_state_dict(plain.state_dict())
        x = torch.randn(1, 8, 32, generator=_gen(2)).half()
        ref = plain.float()(x.float())
        assert not torch.isfinite(plain.half()(x)).all()
        out = scaled(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


# ---- MLP, residuals, loss --------------------------------------------------------------------


def test_openai_gelu_is_the_tanh_form_and_changes_only_the_mlp():
    cfg = ModelConfig(**BASE)
    erf = _layer(cfg)
    tanh = TransformerLayer(dataclasses.replace(cfg, openai_gelu=True), BuildContext(ST))
    tanh.load_state_dict(erf.state_dict())
    h = torch.randn(2, 8, 32, generator=_gen(3))
    fc1, fc2 = tanh.mlp.dense_h_to_4h, tanh.mlp.dense_4h_to_h
    z = fc1(h)
    v1x = 0.5 * z * (1.0 + torch.tanh(0.7978845608028654 * z * (1.0 + 0.044715 * z * z)))
    torch.testing.assert_close(tanh.mlp(h), fc2(v1x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(tanh.mlp(h), erf.mlp(h), atol=1e-6)
    torch.testing.assert_close(tanh.self_attention(h), erf.self_attention(h), rtol=0, atol=0)


def test_post_layernorm_residual_follows_v1x():
    cfg = dataclasses.replace(ModelConfig(**BASE), apply_residual_connection_post_layernorm=True)
    layer = _layer(cfg)
    x = torch.randn(2, 8, 32, generator=_gen(5))
    n1 = layer.input_layernorm(x)
    h = n1 + layer.self_attention(n1)
    n2 = layer.post_attention_layernorm(h)
    torch.testing.assert_close(layer(x), n2 + layer.mlp(n2), rtol=0, atol=0)
    pre = TransformerLayer(ModelConfig(**BASE), BuildContext(ST))
    pre.load_state_dict(layer.state_dict())
    assert not torch.allclose(pre(x), layer(x))


@pytest.mark.slow  # torch.compile: about 10 s on 2 cores
def test_bias_dropout_fusion_compiles_the_residual_add_and_replays_its_masks():
    """--bias-dropout-fusion: the blocks return their output without the bias, and one
    torch.compile'd residual + dropout(out + bias) adds it: the values of the separate ops
    (pre- and post-LN), masks that a reseeded call replays (what recompute relies on), and a
    GPT whose full recompute gives the loss and gradients of the run that keeps activations."""
    from megatron.fused_kernels import select_ops
    from megatron.model import transformer

    for flag, impl in (("--bias-dropout-fusion", "compile"), ("--no-bias-dropout-fusion", "torch")):
        kernels = parse_args([*ARGV, flag], world_size=1).kernels
        assert select_ops(kernels, "cpu").bias_dropout_add == impl, flag
    for post_ln in (False, True):
        cfg = dataclasses.replace(
            ModelConfig(**BASE), apply_residual_connection_post_layernorm=post_ln
        )
        plain = _layer(cfg)
        fused = TransformerLayer(cfg, BuildContext(ST, ops=FUSED_BDA))
        fused.load_state_dict(plain.state_dict())
        x = torch.randn(2, 8, 32, generator=_gen(5), requires_grad=True)
        assert fused.self_attention.defer_bias and fused.mlp.defer_bias
        assert not torch.allclose(fused.mlp(x), plain.mlp(x)), "the MLP leaves its bias out"
        y0, y1 = plain(x), fused(x)
        torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
        g0 = torch.autograd.grad(y0.square().sum(), [x, *plain.parameters()])
        g1 = torch.autograd.grad(y1.square().sum(), [x, *fused.parameters()])
        for a, b in zip(g1, g0, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "fn" in transformer._FUSED, "the layer went through the compiled function"

    cfg = dataclasses.replace(ModelConfig(**BASE), hidden_dropout=0.1)
    tokens, labels = _tokens(cfg), _tokens(cfg, seed=2)
    runs = []
    for recompute in (None, RecomputeConfig(granularity="full", method="uniform", num_layers=1)):
        model = parallelize(GPTModel(cfg, BuildContext(ST, seed=3, ops=FUSED_BDA)), ST, recompute)
        torch.manual_seed(11)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = runs
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for name, grad in g0.items():
        torch.testing.assert_close(g1[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    # The masks themselves (shapes and p of the GPT above, so nothing recompiles).
    fn = transformer.fused_bias_dropout_add()
    x, b, r = (torch.randn(2, 8, 32, requires_grad=True) for _ in range(3))
    b = b[0, 0]
    with torch.no_grad():
        torch.manual_seed(7)
        y = fn(x, b, r, 0.1)
        kept = (y - r) != 0
        torch.testing.assert_close((y - r)[kept], ((x + b) / 0.9)[kept])
        assert 0.8 < kept.float().mean() < 0.97, "a tenth of the elements dropped"
        torch.manual_seed(7)
        assert torch.equal(fn(x, b, r, 0.1), y), "the same generator state, the same mask"


def test_fp16_lm_cross_entropy_keeps_the_logits_dtype():
    logits = (torch.randn(4, 8, 64, generator=_gen(6)) * 3).half().requires_grad_()
    target = torch.randint(0, 64, (4, 8), generator=_gen(7))
    fp32 = mpu.vocab_parallel_cross_entropy(logits, target)
    fp16 = mpu.vocab_parallel_cross_entropy(logits, target, upcast=False)
    assert fp32.dtype == torch.float32 and fp16.dtype == torch.float16
    ref = F.cross_entropy(logits.float().view(-1, 64), target.view(-1), reduction="none")
    torch.testing.assert_close(fp32.view(-1), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp16.float().view(-1), ref, rtol=1e-2, atol=1e-2)
    (grad,) = torch.autograd.grad(fp16.float().sum(), logits)
    assert grad.dtype == torch.float16
    # The model's loss follows the KernelConfig switch (through FusedOps).
    cfg = ModelConfig(**BASE)
    for flag, dtype in ((False, torch.float32), (True, torch.float16)):
        ops = dataclasses.replace(TORCH_OPS, fp16_lm_cross_entropy=flag)
        model = GPTModel(cfg, BuildContext(ST, dtype=torch.float16, ops=ops))
        assert model(_tokens(cfg), labels=_tokens(cfg, seed=2)).dtype == dtype


# ---- layer sharing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "style,order", [("grouped", [0, 1, 0, 1]), ("spaced", [0, 0, 1, 1])]
)  # v1.x's help: grouped [1, 2, 1, 2], spaced [1, 1, 2, 2]
@pytest.mark.slow  # over a second on 2 cores
def test_shared_layers_exist_once_and_their_gradients_sum(style, order):
    cfg = ModelConfig(**BASE, num_unique_layers=2, param_sharing_style=style)
    assert [cfg.unique_layer(i) for i in range(4)] == order
    shared = GPTModel(cfg, BuildContext(ST, seed=3, dtype=torch.float64))
    owners = sorted({cfg.layer_owner(i) for i in range(4)})
    assert sorted(map(int, shared.layers)) == owners and len(shared.run_order()) == 4
    names = {n.split(".")[1] for n in shared.state_dict() if n.startswith("layers.")}
    assert names == {str(o) for o in owners}, "a checkpoint holds each unique layer once"
    # The same model written out with 4 separate (equal) layers: same loss, and the shared
    # gradient is the sum over the layers that use it.
    full = GPTModel(ModelConfig(**BASE), BuildContext(ST, seed=3, dtype=torch.float64))
    sd = dict(shared.state_dict())
    for i in range(4):
        for key, t in shared.layers[str(cfg.layer_owner(i))].state_dict().items():
            sd[f"layers.{i}.{key}"] = t
    full.load_state_dict({k: v for k, v in sd.items() if k in full.state_dict()})
    tokens, labels = _tokens(cfg), _tokens(cfg, seed=2)
    loss_s, loss_f = shared(tokens, labels=labels).sum(), full(tokens, labels=labels).sum()
    loss_s.backward()
    loss_f.backward()
    torch.testing.assert_close(loss_s, loss_f, rtol=1e-12, atol=0)
    for name, p in shared.layers.named_parameters():
        owner, rest = name.split(".", 1)
        want = sum(
            full.get_parameter(f"layers.{i}.{rest}").grad
            for i in range(4)
            if cfg.layer_owner(i) == int(owner)
        )
        torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12)


def test_kv_cache_generation_runs_shared_layers_with_a_cache_per_use():
    cfg = ModelConfig(**BASE, **V1)
    model = GPTModel(cfg, BuildContext(ST, seed=3)).eval()
    tokens = _tokens(cfg, batch=1)
    caches = {n: KVCache(1, 8, 4, 8, "cpu", torch.float32) for n in model.layer_numbers}
    with torch.no_grad():
        full = model(tokens)
        first = model(tokens[:, :5], kv_caches=caches)
        steps = [model(tokens[:, i : i + 1], torch.tensor([[i]]), kv_caches=caches) for i in (5, 6)]
    torch.testing.assert_close(first, full[:, :5], rtol=1e-5, atol=1e-5)
    for i, step in zip((5, 6), steps, strict=True):
        torch.testing.assert_close(step[:, 0], full[:, i], rtol=1e-5, atol=1e-5)


# ---- flags and rules -------------------------------------------------------------------------

ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
ARGV += ["--seq-length", "8", "--vocab-size", "50"]


def test_v1x_flags_parse_into_the_config():
    cfg = parse_args(
        [
            *ARGV,
            *("--apply-query-key-layer-scaling", "--openai-gelu", "--onnx-safe", "true"),
            *("--apply-residual-connection-post-layernorm", "--attention-softmax-in-fp32"),
            *("--num-unique-layers", "2", "--param-sharing-style", "spaced", "--fp16"),
            *("--fp16-lm-cross-entropy", "--no-bias-gelu-fusion", "--bias-gelu-fusion"),
            *("--no-masked-softmax-fusion", "--scaled-upper-triang-masked-softmax-fusion"),
        ],
        world_size=1,
    )
    validate(cfg)
    m, k = cfg.model, cfg.kernels
    assert (m.apply_query_key_layer_scaling, m.openai_gelu, m.num_unique_layers) == (1, 1, 2)
    assert m.apply_residual_connection_post_layernorm and m.param_sharing_style == "spaced"
    assert k.attention_softmax_in_fp32 and k.fp16_lm_cross_entropy and k.onnx_safe == "true"
    assert k.bias_gelu_fusion and k.masked_softmax_fusion, "v1.x spellings switch them on"
    k2 = parse_args([*ARGV, "--scaled-masked-softmax-fusion"], world_size=1).kernels
    assert k2.masked_softmax_fusion


@pytest.mark.parametrize(
    "extra,world,flag",
    [
        (["--fp16-lm-cross-entropy"], 1, "--fp16-lm-cross-entropy"),
        (["--num-unique-layers", "3"], 1, "--num-unique-layers"),
        (["--openai-gelu", "--swiglu"], 1, "--openai-gelu"),
        (["--num-unique-layers", "2", "--pipeline-model-parallel-size", "2"], 2, "spaced"),
        (
            ["--num-unique-layers", "2", "--param-sharing-style", "spaced"]
            + ["--pipeline-model-parallel-size", "4"],
            4,
            "different pipeline model chunks",
        ),
    ],
)
def test_v1x_rules_name_the_flag_and_the_fix(extra, world, flag):
    with pytest.raises(ConfigError, match=flag) as err:
        validate(parse_args([*ARGV, *extra], world_size=world))
    assert "Fix:" in str(err.value)


def test_exponential_lr_decay_is_v1x():
    from megatron.training.learning_rates import AnnealingLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = AnnealingLR(opt, max_lr=1.0, min_lr=0.1, decay_steps=100, decay_style="exponential")
    v1x = [max(1.0 * math.exp(-0.693 * min(n, 100) / 100), 0.1) for n in (0, 30, 100, 150)]
    assert [s.get_lr(n) for n in (0, 30, 100, 150)] == v1x  # v1.x: end_iter and no warmup
    s = AnnealingLR(opt, max_lr=1.0, min_lr=0.6, warmup_steps=10, decay_steps=110,
                    decay_style="exponential")  # fmt: skip
    assert s.get_lr(5) == 0.5 and s.get_lr(10) == 1.0 and s.get_lr(60) > 0.6
    assert s.get_lr(110) == s.get_lr(500) == 0.6  # floored at min_lr
    argv = [*ARGV, "--lr", "1e-3", "--train-iters", "10", "--lr-decay-style", "exponential"]
    validate(parse_args(argv, world_size=1), "train-gpt")


# ---- TP2 and PP2 against one process (one spawn) ---------------------------------------------


def _gathered(p, t, state):
    """The full tensor of a TP-split parameter's `t` (or `t` itself when replicated)."""
    if not mpu.is_tensor_parallel(p) or state.tp_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(state.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=state.tp_group)
    return mpu.unshard(parts, p.partition_dim, p.partition_stride)


def _check_grads(model, ref_grads, state, vocab, reduce_embedding=False):
    for name, p in model.named_parameters():
        grad = _gathered(p, p.grad, state)
        if name == "embedding.word_embeddings.weight":
            if reduce_embedding:  # the tied copies of the first and last stage: summed
                dist.all_reduce(grad, group=state.embedding_group)
            grad = grad[:vocab]
        want = ref_grads[name][: grad.shape[0]]
        torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12, msg=name)


def _tp_pp_worker(rank, world):
    from megatron.models.gpt.model import build_model
    from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel

    cfg = ModelConfig(**BASE, **V1, param_sharing_style="spaced")
    tokens, labels = _tokens(cfg), _tokens(cfg, seed=2)
    ref = GPTModel(cfg, BuildContext(ST, seed=3, dtype=torch.float64))
    ref_loss = ref(tokens, labels=labels)
    ref_loss.sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    state = initialize_model_parallel(2, 1)  # TP2
    model = GPTModel(cfg, BuildContext(state, seed=3, dtype=torch.float64))
    loss = model(tokens, labels=labels)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    _check_grads(model, ref_grads, state, cfg.vocab_size)
    # fp16 logits split over TP: the fp16 loss matches one process's fp16 loss.
    logits = (torch.randn(2, 8, 64, generator=_gen(6)) * 3).half()
    target = torch.randint(0, 64, (2, 8), generator=_gen(7))
    local = logits.chunk(2, dim=-1)[state.tp_rank]
    split = mpu.vocab_parallel_cross_entropy(local, target, state.tp_group, upcast=False)
    whole = mpu.vocab_parallel_cross_entropy(logits, target, upcast=False)
    assert split.dtype == torch.float16
    torch.testing.assert_close(split, whole, rtol=2e-3, atol=2e-3)
    destroy_model_parallel(state)

    state = initialize_model_parallel(1, 2)  # PP2: unique layer r lives on stage r
    (stage,) = build_model(cfg, BuildContext(state, seed=3, dtype=torch.float64)).chunks
    assert list(stage.layers) == [str(2 * rank)] and stage.layer_numbers == [2 * rank, 2 * rank + 1]
    if state.is_first_stage:
        out = stage(tokens)
        dist.send(out.detach(), state.next_pp_rank)
        grad = torch.empty_like(out)
        dist.recv(grad, state.next_pp_rank)
        out.backward(grad)
    else:
        x = torch.empty(2, 8, 32, dtype=torch.float64)
        dist.recv(x, state.prev_pp_rank)
        stage.set_input_tensor(x.requires_grad_())
        loss = stage(labels=labels)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
        loss.sum().backward()
        dist.send(x.grad, state.prev_pp_rank)
    _check_grads(stage, ref_grads, state, cfg.vocab_size, reduce_embedding=True)
    destroy_model_parallel(state)
    return True


def test_v1x_architecture_at_tp2_and_pp2_equals_one_process():
    """qk scaling + OpenAI GeLU + post-LN residual + 4 layers sharing 2 (spaced): loss and every
    gradient at TP2, and at PP2 with each unique layer on its own stage; the fp16 LM loss at
    TP2."""
    assert run_distributed(_tp_pp_worker, 2) == [True, True]


# ---- Hugging Face export ---------------------------------------------------------------------


def _full_state(model, cfg):
    vocab = ("embedding.word_embeddings.weight", "head.output_layer.weight")
    return {n: t[: cfg.vocab_size] if n in vocab else t for n, t in model.state_dict().items()}


def test_hf_export_openai_gelu_as_gelu_new_and_shared_layers_copied(tmp_path):
    transformers = pytest.importorskip("transformers", reason="HF export checks need transformers")
    import json

    from megatron.models.gpt.hf import from_hf, hf_architecture, to_hf

    cfg = ModelConfig(**{**BASE, **V1, "apply_residual_connection_post_layernorm": False})
    model = GPTModel(cfg, BuildContext(ST, seed=3)).eval()
    with torch.no_grad():  # biases and norms away from 0 and 1
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=_gen(8)) * 0.05)
    args = {"model": dataclasses.asdict(cfg), "tokenizer": {"tokenizer_type": None}}
    assert to_hf(_full_state(model, cfg), args, str(tmp_path)) == "gpt2"
    config = json.load(open(tmp_path / "config.json"))
    assert config["activation_function"] == "gelu_new" and config["n_layer"] == 4
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), local_files_only=True).eval()
    tokens = _tokens(cfg)
    with torch.no_grad():
        ours = model(tokens)[..., : cfg.vocab_size]
        torch.testing.assert_close(hf(tokens).logits, ours, rtol=1e-5, atol=1e-5)
    # Imported back: the tanh GeLU is recorded (the layers come back unshared).
    _, imported = from_hf(str(tmp_path))
    assert imported["model"]["openai_gelu"] and imported["model"]["num_unique_layers"] is None
    post_ln = dataclasses.replace(cfg, apply_residual_connection_post_layernorm=True)
    with pytest.raises(ValueError, match="--apply-residual-connection-post-layernorm"):
        hf_architecture(post_ln)
