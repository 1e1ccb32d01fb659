"""Multi-latent attention: equal to Hugging Face's DeepseekV3Attention (YaRN, with and without
a query latent), its KV cache holds the compressed latent and gives the uncached logits, and
YaRN at factor 1 is plain RoPE."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron import mpu
from megatron.inference.engine import InferenceModel
from megatron.inference.generation import SamplingParams, generate
from megatron.model.attention.mla import LatentKVCache, MultiLatentAttention, mla_rotary
from megatron.model.context import BuildContext
from megatron.model.rope import RotaryEmbedding
from megatron.model.weights import init_weights
from megatron.models.gpt.model import GPTModel
from tests.helpers.models import mla_fields, tiny_gpt

DT = torch.float64
YARN = dict(
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=8,
    mscale=1.0,
    mscale_all_dim=0.7,
    rotary_base=100.0,
)


def mla_cfg(**overrides):
    """A tiny DeepSeek-shaped attention: 8 heads of (8 + 4) query/key and 6 value dims."""
    base = dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        seq_length=32,
        add_bias_linear=False,
        **mla_fields(24, 16, 8, 4, 6),
        **YARN,
    )
    return tiny_gpt(**{**base, **overrides})


def _hf_attention(cfg):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {
        "rope_type": "yarn",
        "factor": cfg.rotary_scaling_factor,
        "original_max_position_embeddings": cfg.original_max_position_embeddings,
        "beta_fast": cfg.beta_fast,
        "beta_slow": cfg.beta_slow,
        "mscale": cfg.mscale,
        "mscale_all_dim": cfg.mscale_all_dim,
        "rope_theta": cfg.rotary_base,
    }
    hc = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_rank,
        qk_nope_head_dim=cfg.qk_nope_dim,
        qk_rope_head_dim=cfg.qk_rope_dim,
        v_head_dim=cfg.v_dim,
        rope_interleave=False,  # ours is Megatron-core's rotate-half layout
        attention_bias=False,
        max_position_embeddings=cfg.seq_length,
        rope_parameters=rope,
        attn_implementation="sdpa",
    )
    return hf.DeepseekV3Attention(hc, 0).to(DT), hf.DeepseekV3RotaryEmbedding(hc).to(DT)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_equals_hugging_face_deepseek_v3_attention_with_yarn(q_lora_rank):
    cfg = mla_cfg(q_lora_rank=q_lora_rank)
    ours = MultiLatentAttention(cfg, BuildContext(seed=3, dtype=DT))
    init_weights(ours, cfg, mpu.single_process_state(), 3)
    hf, rotary = _hf_attention(cfg)
    # the parameter names are HF's but for the output projection (dense, as every attention)
    hf.load_state_dict({k.replace("dense.", "o_proj."): v for k, v in ours.state_dict().items()})
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, dtype=DT)
    cos, sin = rotary(x, torch.arange(cfg.seq_length).expand(2, -1))
    want, _ = hf(x, (cos, sin), None)
    assert ours.softmax_scale == pytest.approx(hf.scaling, rel=1e-12)
    # HF draws its YaRN frequencies in float32, ours in float64
    torch.testing.assert_close(ours(x), want, rtol=1e-6, atol=1e-7)


def test_yarn_at_factor_one_is_plain_rope():
    cfg = mla_cfg(rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    yarn = mla_rotary(cfg)
    plain = RotaryEmbedding(cfg.qk_rope_dim, cfg.max_positions, cfg.rotary_base)
    torch.testing.assert_close(yarn.cos, plain.cos)
    torch.testing.assert_close(yarn.sin, plain.sin)


def test_kv_cache_holds_the_latent_and_gives_the_uncached_logits():
    cfg = mla_cfg(num_layers=2, q_lora_rank=None)
    model = GPTModel(cfg, BuildContext(seed=5, dtype=DT))
    engine = InferenceModel([model], mpu.single_process_state(), cfg.vocab_size, cfg.hidden_size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    full = model(tokens)[..., : cfg.vocab_size]  # (b, s, V): one forward, no cache
    caches = engine.new_caches(2, 12)
    cache = caches[model.layer_numbers[0]]
    assert isinstance(cache, LatentKVCache)
    # per token and layer: the latent and the shared RoPE key, not 2 x heads x head size
    assert cache.k.shape[-1] + cache.v.shape[-1] == cfg.kv_rank + cfg.qk_rope_dim
    assert LatentKVCache.bytes_per_token(cfg, 2) == 2 * (16 + 4)
    positions = torch.arange(12).expand(2, -1)
    step = engine.next_token_logits(tokens[:, :5], positions[:, :5], caches)  # a 5-token prompt
    torch.testing.assert_close(step, full[:, 4].float())
    for pos in range(5, 12):  # then one token at a time
        step = engine.next_token_logits(
            tokens[:, pos : pos + 1], positions[:, pos : pos + 1], caches
        )
        torch.testing.assert_close(step, full[:, pos].float(), msg=f"position {pos}")
    assert cache.length == 12
    # generation: cached == uncached, prompts of different lengths
    prompts = [tokens[0, :3].tolist(), tokens[1, :6].tolist()]
    params = SamplingParams(max_new_tokens=5, greedy=True)
    cached = generate(engine, prompts, params, use_cache=True)
    assert cached == generate(engine, prompts, params, use_cache=False)


def test_mla_weights_reshard_over_tp_and_pp_by_their_recorded_partition(tmp_path):
    """The up projections split their rows over TP (by heads), dense its columns; the down
    projections and the latent norms are whole on every rank. A TP 2 x PP 2 checkpoint of a
    one-process state merges back to it."""
    from megatron.checkpoint.reading import load_shard
    from megatron.checkpoint.resharding import load_checkpoint, model_layout, save_resharded

    cfg = mla_cfg(num_layers=2, seq_length=16, vocab_size=96)
    rules = model_layout(cfg)[1]
    attn = "layers.1.self_attention."
    expected = {"q_a_proj": None, "q_a_layernorm": None, "q_b_proj": (0, 1)}
    expected |= {"kv_a_proj_with_mqa": None, "kv_a_layernorm": None, "kv_b_proj": (0, 1)}
    expected |= {"dense": (1, 1)}
    assert {k: rules[f"{attn}{k}.weight"] for k in expected} == expected
    state = GPTModel(cfg, BuildContext(seed=9)).state_dict()
    state["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"][:96]
    args = {"model": dataclasses.asdict(cfg), "tensor_model_parallel_size": 1}
    args |= {"pipeline_model_parallel_size": 1, "padded_vocab_size": 96}
    save_resharded(state, args, str(tmp_path), 2, 2, 4, quiet=True)
    shard = load_shard(str(tmp_path), 4, tp_rank=1, pp_rank=1, pp_size=2)
    heads = cfg.num_attention_heads // 2
    assert shard["model"][f"{attn}kv_b_proj.weight"].shape == (heads * (8 + 6), 16)
    assert shard["partition"][f"{attn}kv_a_proj_with_mqa.weight"] is None
    merged = load_checkpoint(str(tmp_path)).state
    assert merged.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(merged[name], tensor, msg=name)
