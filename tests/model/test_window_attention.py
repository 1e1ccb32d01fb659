"""Sliding-window attention (--window-size, --window-attn-skip-freq) and attention sinks
(--softmax-type): windowed and sink logits equal an explicit-mask reference (every backend, with
packed documents), windowed layers generate through a rolling cache of the window equal to
the full computation, the layer pattern places windows where Megatron-core
does, and bad input is refused with the flag and the fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.layer_pattern import (
    ATTENTION_MLP,
    WINDOW_ATTENTION_MLP,
    WINDOW_ATTENTION_MOE,
    layer_kinds,
)
from megatron.fused_kernels import TORCH_OPS
from megatron.inference.engine import InferenceModel
from megatron.inference.generation import SamplingParams, generate
from megatron.model.attention.backends import choose_backend
from megatron.model.attention.flex_window import FLEX_WINDOW
from megatron.model.attention.masks import AttentionMask
from megatron.model.attention.rolling_cache import RollingCache
from megatron.model.attention.window import has_flash_attn, window_report, windowed
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from tests.helpers.models import tiny_gpt, tiny_mla, tiny_moe
from tests.helpers.reference_gpt import RefGPT, load_from_megatron
from tests.helpers.training import BASE

DT = torch.float64
LEFT = 3
RUN = [*BASE, "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "4"]


def _window_keep(s: int, left: int) -> torch.Tensor:
    """(1, 1, s, s): j <= i and i - j <= left, written out."""
    keep = torch.zeros(1, 1, s, s, dtype=torch.bool)
    for i in range(s):
        for j in range(max(0, i - left), i + 1):
            keep[0, 0, i, j] = True
    return keep


def _models(backend: str, **overrides):
    cfg = tiny_gpt(position_embedding_type="rope", num_query_groups=2, **overrides)
    ops = dataclasses.replace(TORCH_OPS, attention_backend=backend)
    model = GPTModel(cfg, BuildContext(seed=3, dtype=DT, ops=ops)).eval()
    ref = RefGPT(cfg).to(DT)
    load_from_megatron(ref, model)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.manual_seed(5))
    return cfg, model, ref, tokens


def _close(ours, expected, vocab):
    torch.testing.assert_close(ours[..., :vocab], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_windowed_logits_equal_the_explicit_window_mask(backend):
    # skip freq 2: layer 1 windowed, layer 2 global (as gpt-oss)
    cfg, model, ref, tokens = _models(backend, window_size=f"{LEFT},0", window_attn_skip_freq="2")
    assert layer_kinds(cfg) == (WINDOW_ATTENTION_MLP, ATTENTION_MLP)
    s = cfg.seq_length
    with torch.no_grad():
        ours = model(tokens)
        _close(ours, ref(tokens, keep=[_window_keep(s, LEFT), None]), cfg.vocab_size)
        assert not torch.allclose(ours[..., : cfg.vocab_size], ref(tokens))  # the window acts


def test_a_documents_window_stops_at_its_start():
    cfg, model, ref, tokens = _models("sdpa", window_size=f"{LEFT},0")
    s = cfg.seq_length
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4])
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).unsqueeze(1)  # (b, 1, s, s)
    keep = same & _window_keep(s, LEFT)
    with torch.no_grad():
        ours = model(tokens, attention_mask=AttentionMask.documents(ids))
        _close(ours, ref(tokens, keep=keep), cfg.vocab_size)


@pytest.mark.parametrize("variant", ["gqa", "mla"])
def test_windowed_layers_generate_through_a_rolling_cache_of_the_window(variant):
    # layer 1 windowed (a cache of LEFT positions), layer 2 global (the full cache)
    window = dict(window_size=f"{LEFT},0", window_attn_skip_freq="2")
    cfg = (tiny_mla if variant == "mla" else tiny_gpt)(seq_length=16, **window)
    model = GPTModel(cfg, BuildContext(seed=5, dtype=DT)).eval()
    engine = InferenceModel([model], mpu.single_process_state(), cfg.vocab_size, cfg.hidden_size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)[..., : cfg.vocab_size].float()  # no cache
    caches = engine.new_caches(2, 16)
    rolling, whole = (caches[n] for n in model.layer_numbers)
    assert isinstance(rolling, RollingCache) and not isinstance(whole, RollingCache)
    positions = torch.arange(16).expand(2, -1)
    for start, end in [(0, 6), *((p, p + 1) for p in range(6, 10)), (10, 13), (13, 16)]:
        got = engine.next_token_logits(tokens[:, start:end], positions[:, start:end], caches)
        torch.testing.assert_close(got, full[:, end - 1], msg=f"position {end - 1}")
        assert rolling.held == min(end, LEFT) and rolling.length == end  # bounded by the window
    prompts = [tokens[0, :3].tolist(), tokens[1, :7].tolist()]
    params = SamplingParams(max_new_tokens=3, greedy=True)
    cached = generate(engine, prompts, params, use_cache=True)
    assert cached == generate(engine, prompts, params, use_cache=False)


def _sink_models(softmax_type: str, backend: str):
    cfg, model, ref, tokens = _models(backend, softmax_type=softmax_type)
    sinks = []
    for i, blk in enumerate(ref.blocks):
        core = model.layers[str(i)].self_attention.core
        sink = torch.zeros(cfg.num_attention_heads, dtype=DT)
        if softmax_type == "learnable":
            with torch.no_grad():
                core.softmax_offset.copy_(torch.linspace(-2.0, 3.0, cfg.num_attention_heads))
            sink = core.softmax_offset.detach().clone()
        blk.sink = sink
        sinks.append(sink)
    return cfg, model, ref, tokens


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
def test_sink_logits_equal_the_reference_softmax_with_the_extra_logit(softmax_type, backend):
    cfg, model, ref, tokens = _sink_models(softmax_type, backend)
    core = model.layers["0"].self_attention.core
    q = torch.zeros(1, cfg.num_attention_heads, 2, cfg.head_dim, dtype=DT)
    assert choose_backend(core, AttentionMask.causal(), q).name == "sink"
    with torch.no_grad():
        ours = model(tokens)
        _close(ours, ref(tokens), cfg.vocab_size)
        for blk in ref.blocks:
            blk.sink = None
        assert not torch.allclose(ours[..., : cfg.vocab_size], ref(tokens))  # the sink acts


def test_the_learnable_sink_is_a_tp_split_parameter_that_learns():
    cfg, model, ref, tokens = _sink_models("learnable", "sdpa")
    offset = model.layers["0"].self_attention.core.softmax_offset
    assert offset.shape == (cfg.num_attention_heads,) and offset.tensor_model_parallel
    assert offset.partition_dim == 0
    assert "layers.0.self_attention.core.softmax_offset" in model.state_dict()
    model(tokens).sum().backward()
    assert offset.grad is not None and offset.grad.abs().sum() > 0
    assert "softmax_offset" not in str(list(GPTModel(tiny_gpt()).state_dict()))


def test_windows_and_sinks_together_with_moe_layers():
    cfg = tiny_moe(window_size="2,0", window_attn_skip_freq="[1,0]", softmax_type="off-by-one")
    assert layer_kinds(cfg)[0] == WINDOW_ATTENTION_MOE
    model = GPTModel(cfg, BuildContext(seed=3, dtype=DT))
    assert model.layers["0"].self_attention.core.window == 2
    assert model.layers["1"].self_attention.core.window is None


@pytest.mark.parametrize(
    "layers, skip, windowed",
    [
        (12, "6", [i for i in range(12) if (i + 1) % 6]),  # Gemma 3: 5 local, 1 global
        (4, "2", [0, 2]),  # gpt-oss: alternating, the first windowed
        (4, None, [0, 1, 2, 3]),  # Mistral: every layer
        (4, "[1,1,0,1]", [0, 1, 3]),
        (6, "([1]*2+[0])*2", [0, 1, 3, 4]),
    ],
)
def test_the_pattern_places_windows_where_megatron_core_does(layers, skip, windowed):
    cfg = tiny_gpt(num_layers=layers, window_size="4,0", window_attn_skip_freq=skip)
    kinds = layer_kinds(cfg)
    assert [i for i, k in enumerate(kinds) if k == WINDOW_ATTENTION_MLP] == windowed
    assert all(kinds[i] == ATTENTION_MLP for i in range(layers) if i not in windowed)


def test_the_build_log_names_the_window_kernel_and_the_sinks():
    cfg = tiny_gpt(window_size="4,0", window_attn_skip_freq="2", softmax_type="learnable")
    lines = window_report(cfg, "cpu", torch.float32, TORCH_OPS)
    assert lines[0].startswith(
        "window attention: 1 of 2 layers, LEFT 4: the window mask in the sink"
    )
    assert lines[1].startswith("attention sinks (--softmax-type learnable)")
    plain = window_report(tiny_gpt(window_size="4,0"), "cuda", torch.bfloat16, TORCH_OPS)
    assert plain == [
        "window attention: 2 of 2 layers, LEFT 4: "
        + (
            "flash-attn window_size=(4, 0), the blocks outside it skipped"
            if has_flash_attn()
            else "flex attention's window block mask (compiled), the blocks outside it skipped"
        )
    ]
    assert window_report(tiny_gpt(), "cpu", torch.float32, TORCH_OPS) == []


@pytest.mark.parametrize(
    "flags, flag, fix",
    [
        (["--window-size", "64,0"], "--window-size", "drop --window-size (global attention)"),
        (["--window-size", "4,2"], "--window-size", "pass --window-size 4,0"),
        (["--window-size=-1,0"], "--window-size", "drop --window-size for global"),
        (["--window-size", "4;0"], "--window-size", "pass two integers"),
        (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq", "add --window-size"),
        (
            ["--window-size", "4,0", "--window-attn-skip-freq", "[1,0,1]"],
            "--window-attn-skip-freq",
            "one 1 (windowed) or 0 (global) per layer",
        ),
        (
            ["--window-size", "4,0", "--window-attn-skip-freq", "1"],
            "--window-attn-skip-freq",
            "use a frequency of 2 or more",
        ),
        (
            ["--window-size", "4,0", "--window-attn-skip-freq", "[1,1,0,0]"]
            + ["--num-unique-layers", "2"],
            "--window-attn-skip-freq",
            "give layers that share weights the same entry",
        ),
        (
            ["--window-size", "4,0", "--window-attn-skip-freq", "[1,2]"],
            "--window-attn-skip-freq",
            "a list of 1 (windowed) / 0 (global)",
        ),
    ],
)
def test_bad_window_flags_are_refused_naming_flag_and_fix(flags, flag, fix):
    with pytest.raises(ConfigError) as err:
        parse_args([*RUN, *flags], world_size=1)
    msg = str(err.value)
    assert msg.startswith(f"{flag}: ") and "Fix: " in msg and fix in msg, msg


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--window-size", "4,0"], "--window-size"),
        (["--softmax-type", "learnable"], "--softmax-type learnable"),
    ],
)
def test_context_parallelism_refuses_windows_and_sinks_before_any_work(flags, flag):
    with pytest.raises(ConfigError) as err:
        parse_args([*RUN, "--context-parallel-size", "2", *flags], world_size=2)
    msg = str(err.value)
    assert msg.startswith(f"{flag}: ring attention") and "drop --context-parallel-size" in msg


def test_bert_refuses_the_causal_window():
    with pytest.raises(ConfigError, match="^--window-size: BERT attends in both directions"):
        parse_args([*RUN, "--window-size", "4,0"], world_size=1, purpose="train-bert")


@pytest.mark.filterwarnings("ignore:.*flex_attention:UserWarning")
def test_flex_attentions_window_block_mask_equals_the_dense_window():
    # CUDA runs it compiled (FlexWindowBackend.accepts is CUDA-only); here its eager form
    cfg, model, ref, tokens = _models("sdpa", window_size=f"{LEFT},0")
    core = model.layers["0"].self_attention.core
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 16, 8, generator=gen, dtype=DT)
    k, v = (torch.randn(2, 2, 16, 8, generator=gen, dtype=DT) for _ in range(2))
    for s_q in (16, 5):  # every query, and a KV cache's last queries
        mask = windowed(AttentionMask.causal(), LEFT)
        got = FLEX_WINDOW.attend(core, q[:, :, -s_q:], k, v, mask, 0.0)
        keep = mask.dense(s_q, 16, "cpu")
        rep = (t.repeat_interleave(4, dim=1) for t in (k, v))
        want = F.scaled_dot_product_attention(q[:, :, -s_q:], *rep, attn_mask=keep)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert not FLEX_WINDOW.accepts(core, mask, q)  # the CPU runs SDPA's boolean mask
    assert choose_backend(core, mask, q).name == "sdpa"
