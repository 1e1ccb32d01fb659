"""DeepSeek-V3's router on one process: sigmoid scores normalized over the chosen experts and
scaled, group-limited routing, the expert bias that moves only the choice (against transformers'
DeepseekV3TopkRouter and a per-token reference), the bias update from the global tokens per
expert, --moe-layer-freq patterns (dense first layers), a resume that restores the biases
exactly and a conversion that carries them, the bias turned on over a checkpoint without it
(zero at first) or off over one with it (dropped), and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron import mpu
from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.layer_pattern import parse_layer_freq
from megatron.config.schema import ModelConfig
from megatron.model.mlp import ParallelMLP
from megatron.model.moe import MoELayer, moe_step_stats, update_expert_bias
from megatron.model.router import route
from megatron.models.gpt.hf_moe import moe_architecture, moe_config
from megatron.models.gpt.model import GPTModel
from tests.helpers.models import V3_ROUTER, tiny_moe
from tests.helpers.training import BASE as SHAPE
from tests.helpers.training import flags, train_run

V3 = tiny_moe(
    hidden_size=16,
    make_vocab_size_divisible_by=128,
    num_experts=8,
    **V3_ROUTER,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
)


def _dense(weights: torch.Tensor, experts: torch.Tensor, e: int) -> torch.Tensor:
    """(T, k) weights of the (T, k) chosen experts -> (T, E), zeros elsewhere (order-free)."""
    return torch.zeros(weights.size(0), e, dtype=weights.dtype).scatter(1, experts, weights)


@pytest.mark.parametrize(
    "k, groups, top_groups", [(2, 2, 1), (4, 4, 2), (2, 1, 1), (3, None, None)]
)
def test_sigmoid_routing_equals_transformers_deepseek_v3(k, groups, top_groups):
    """The same logits, bias and weights as DeepseekV3TopkRouter (norm_topk_prob, its
    routed_scaling_factor and n_group / topk_group; it scores a group by its top 2 experts,
    ours by its top k / g, equal where k / g = 2 or there is one group)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    m = dataclasses.replace(
        V3, moe_router_topk=k, moe_router_num_groups=groups, moe_router_group_topk=top_groups
    )
    hf_cfg = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=8,
        num_experts_per_tok=k,
        n_group=groups or 1,
        topk_group=top_groups or 1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    hf = DeepseekV3TopkRouter(hf_cfg)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 16)
    _, hf_weights, hf_experts = hf(x)
    logits = torch.nn.functional.linear(x, hf.weight)
    probs, experts, _ = route(logits, m, hf.e_score_correction_bias)
    assert torch.equal(experts.sort(-1).values, hf_experts.sort(-1).values)
    torch.testing.assert_close(_dense(probs, experts, 8), _dense(hf_weights, hf_experts, 8))


def _brute_force(scores: torch.Tensor, bias: torch.Tensor, m: ModelConfig):
    """Token by token: the top g groups by the sum of their top k / g biased scores, the top k
    biased scores within them, weights the unbiased scores normalized, times the factor."""
    k, g, groups = m.moe_router_topk, m.moe_router_group_topk, m.moe_router_num_groups
    size = m.num_experts // groups
    out = torch.zeros_like(scores)
    for t in range(scores.size(0)):
        biased = scores[t] + bias
        rank = [sum(sorted(biased[j * size : (j + 1) * size].tolist())[-(k // g) :]) for j in
                range(groups)]  # fmt: skip
        best = sorted(range(groups), key=lambda j: -rank[j])[:g]
        allowed = [e for e in range(m.num_experts) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:k]
        total = sum(scores[t, e] for e in chosen)
        for e in chosen:
            out[t, e] = scores[t, e] / total * m.moe_router_topk_scaling_factor
    return out


def test_group_limited_choice_and_the_bias_moving_only_the_choice():
    torch.manual_seed(1)
    m = dataclasses.replace(V3, num_experts=8, moe_router_num_groups=4, moe_router_group_topk=2)
    m = dataclasses.replace(m, moe_router_topk=4)
    logits = torch.randn(32, 8)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 wins every choice, yet weighs by its own score
    probs, experts, _ = route(logits, m, bias)
    assert (experts == 5).any(-1).all()
    torch.testing.assert_close(_dense(probs, experts, 8), _brute_force(logits.sigmoid(), bias, m))
    plain, _, _ = route(logits, m, torch.zeros(8))
    torch.testing.assert_close(plain.sum(-1), torch.full((32,), 2.5))  # normalized, scaled
    # the weights never see the bias: its gradient would be none (a buffer), the logits' is
    logits.requires_grad_(True)
    route(logits, m, bias)[0].sum().backward()
    assert logits.grad is not None


def test_softmax_top_k_scaled_and_single_expert_sigmoid_not_normalized():
    logits = torch.randn(16, 8)
    m = dataclasses.replace(
        V3,
        moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
    )
    probs, _, _ = route(logits, m)
    torch.testing.assert_close(probs.sum(-1), torch.full((16,), 2.5))
    one = dataclasses.replace(V3, moe_router_topk=1, moe_router_num_groups=None)
    one = dataclasses.replace(one, moe_router_group_topk=None, moe_router_topk_scaling_factor=None)
    probs, experts, _ = route(logits, one)
    torch.testing.assert_close(probs, logits.sigmoid().gather(1, experts))  # as Megatron-core


def _model(cfg: ModelConfig = V3) -> GPTModel:
    model = GPTModel(cfg)
    model.train()
    return model


def test_bias_update_from_counts_and_skipped_steps():
    model = _model()
    load = torch.tensor([[3.0, 1, 2, 2, 2, 2, 2, 2], [0.0, 0, 0, 0, 0, 0, 0, 16]])  # (layers, E)
    update_expert_bias(model, load, 0.1, updated=False)
    update_expert_bias(model, load, 0.1, updated=torch.tensor(False))
    biases = [model.layers[str(i)].mlp.router.expert_bias for i in range(2)]
    assert all(b.abs().sum() == 0 for b in biases)
    update_expert_bias(model, load, 0.1, updated=torch.tensor(True))
    torch.testing.assert_close(biases[0], torch.tensor([-0.1, 0.1, 0, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(biases[1], torch.tensor([0.1] * 7 + [-0.1]))
    assert biases[0].dtype == torch.float32


def test_step_stats_move_the_bias_by_the_whole_batch_and_keep_it_fp32():
    """Two micro batches: the bias moves once, by the sign of mean - the summed counts."""
    model = _model()
    tokens = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        model(tokens, labels=tokens).mean().backward()
    counts = [model.layers[str(i)].mlp.stats.values[3:].clone() for i in range(2)]
    moe_step_stats(model, mpu.single_process_state(), V3, updated=True)
    for i, c in enumerate(counts):
        want = 1e-3 * torch.sign(c.mean() - c)
        torch.testing.assert_close(model.layers[str(i)].mlp.router.expert_bias, want)
    assert "layers.0.mlp.router.expert_bias" in model.state_dict()
    model.to(torch.bfloat16)  # what DeepSpeed's bf16 engine does to the module
    assert model.layers["0"].mlp.router.expert_bias.dtype == torch.float32
    torch.testing.assert_close(model.layers["0"].mlp.router.expert_bias, 1e-3 * torch.sign(
        counts[0].mean() - counts[0]))  # fmt: skip


def test_layer_pattern_dense_first_layers_and_their_widths():
    assert parse_layer_freq("([0]*3+[1]*58)") == (0,) * 3 + (1,) * 58
    assert ModelConfig(moe_layer_freq=2).moe_layer_freq == "2"  # ints from older checkpoints
    cfg = dataclasses.replace(
        V3,
        num_layers=4,
        moe_layer_freq="([0]*1 + [1]*3)",
        ffn_hidden_size=48,
        moe_ffn_hidden_size=8,
    )
    assert cfg.moe_layer_pattern == (0, 1, 1, 1) and cfg.moe_layers == 3
    model = GPTModel(cfg)
    assert isinstance(model.layers["0"].mlp, ParallelMLP)
    assert model.layers["0"].mlp.dense_h_to_4h.weight.shape[0] == 48
    assert all(isinstance(model.layers[str(i)].mlp, MoELayer) for i in (1, 2, 3))
    assert model.layers["1"].mlp.experts.weight2.shape[1] == 8
    # HF: Qwen2-MoE lists dense layers (mlp_only_layers), Mixtral has none: refused with why
    plain = dataclasses.replace(
        cfg,
        moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk_scaling_factor=None,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True,
        add_bias_linear=False,
    )
    assert moe_architecture(plain, []) == "qwen2_moe"
    no_shared = dataclasses.replace(plain, moe_shared_expert_intermediate_size=None)
    with pytest.raises(ValueError, match="Mixtral has no dense layers"):
        moe_architecture(dataclasses.replace(no_shared, moe_shared_expert_gate=False), [])
    with pytest.raises(ValueError, match="no --moe-router-enable-expert-bias"):
        moe_architecture(dataclasses.replace(plain, moe_router_enable_expert_bias=True), [])
    hf = {"model_type": "qwen2_moe", "num_experts_per_tok": 2, "num_experts": 8}
    hf |= {"qkv_bias": False, "num_hidden_layers": 4, "mlp_only_layers": [0, 2]}
    hf |= {"moe_intermediate_size": 8, "shared_expert_intermediate_size": 16}
    assert moe_config(hf)["moe_layer_freq"] == "[0,1,0,1]"


def _bias_flags(data_prefix, *extra, iters):
    v3 = ["--num-experts", "4", "--moe-router-score-function", "sigmoid"]
    v3 += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"]
    return flags(data_prefix, *v3, *extra, iters=iters)


def _biases(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("expert_bias")}


@pytest.mark.slow  # three short training runs and a conversion
def test_resume_restores_the_expert_bias_exactly_and_conversion_carries_it(
    data_prefix, tmp_path, capsys
):
    from megatron.checkpoint.reading import load_shard
    from tests.helpers.checkpoints import _checkpoint_at, _cli

    save = ["--save", str(tmp_path / "a"), "--save-interval", "2"]
    straight = train_run(0, 1, _bias_flags(data_prefix, *save, iters=4))
    at2 = _checkpoint_at(str(tmp_path / "a"), 2, tmp_path / "at2")
    saved = load_shard(at2, 2, tp_rank=0, pp_rank=0, pp_size=1)["model"]
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("expert_bias"))
    resumed = train_run(0, 1, _bias_flags(data_prefix, "--load", at2, iters=4))
    assert [h["lm_loss"] for h in resumed.history] == [h["lm_loss"] for h in straight.history][2:]
    want, got = _biases(straight.model.module), _biases(resumed.model.module)
    assert want and all(torch.equal(want[k], got[k]) for k in want)
    # tools/convert_checkpoint.py to TP 2: every TP rank holds the whole bias
    tp2 = ["--target-tensor-model-parallel-size", "2"]
    assert _cli()(["--load", at2, "--save", str(tmp_path / "tp2"), *tp2]) == 0
    for r in range(2):
        shard = load_shard(str(tmp_path / "tp2"), 2, tp_rank=r, pp_rank=0, pp_size=1)["model"]
        assert all(torch.equal(shard[k], saved[k]) for k in saved if k.endswith("expert_bias"))
    # a run without the bias drops the checkpoint's biases with a line saying so (Megatron-
    # core's default load ignores checkpoint tensors the model does not ask for), resuming as
    # saved and from the TP2 conversion (resharded on load)
    for where in (at2, str(tmp_path / "tp2")):
        run = train_run(0, 1, flags(data_prefix, *NO_BIAS, "--load", where, *NO_RNG, iters=3))
        assert not _biases(run.model.module) and len(run.history) == 1
        assert "expert biases are dropped" in capsys.readouterr().err


NO_BIAS = ["--num-experts", "4", "--moe-router-score-function", "sigmoid"]
NO_RNG = ["--no-load-rng"]  # the conversion to TP2 keeps no RNG state (dropout is 0 here)


@pytest.mark.slow  # four short training runs and a conversion
def test_the_bias_turned_on_over_a_checkpoint_without_it_starts_at_zero(
    data_prefix, tmp_path, capsys
):
    """Saved without the expert bias, resumed (as saved, and resharded from a TP2
    conversion) and fine-tuned with it: each bias starts at zero, so the first step routes
    and loses exactly as without it, then moves; the load says so in one line."""
    from tests.helpers.checkpoints import _checkpoint_at, _cli

    save = ["--save", str(tmp_path / "a"), "--save-interval", "2"]
    straight = train_run(0, 1, flags(data_prefix, *NO_BIAS, *save, iters=3)).history
    at2 = _checkpoint_at(str(tmp_path / "a"), 2, tmp_path / "at2")
    tp2 = ["--target-tensor-model-parallel-size", "2"]
    assert _cli()(["--load", at2, "--save", str(tmp_path / "tp2"), *tp2]) == 0
    capsys.readouterr()
    for where in (at2, str(tmp_path / "tp2")):
        run = train_run(0, 1, _bias_flags(data_prefix, "--load", where, *NO_RNG, iters=3))
        assert run.history[0]["lm_loss"] == straight[2]["lm_loss"], where
        assert all(b.abs().sum() > 0 for b in _biases(run.model.module).values())
        assert capsys.readouterr().err.count("bias starts at zero") == 1
    tuned = train_run(0, 1, _bias_flags(data_prefix, "--load", at2, "--finetune", iters=1))
    assert [h["iteration"] for h in tuned.history] == [1]
    assert all(b.abs().sum() > 0 for b in _biases(tuned.model.module).values())
    assert "bias starts at zero" in capsys.readouterr().err


def test_only_the_expert_biases_may_differ_from_the_checkpoint():
    from megatron.checkpoint.expert_bias import fit_expert_biases

    w, b = torch.ones(2), torch.full((4,), 0.5)
    model = {"layers.0.mlp.router.weight": w, "layers.0.mlp.router.expert_bias": b}
    without = {"layers.0.mlp.router.weight": w}
    fitted = fit_expert_biases(without, model)
    assert list(fitted) == list(model) and torch.equal(fitted[list(model)[1]], torch.zeros(4))
    assert fit_expert_biases(model, without) == without  # dropped
    other = {"layers.0.mlp.router.weight2": w}  # any other difference: left to the checks
    assert fit_expert_biases(other, model) is other and fit_expert_biases(model, other) is model


BAD = [
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias: given with"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "do not divide"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], "only --moe-router-num"),
    (["--moe-router-group-topk", "1"], "without --moe-router-num-groups"),
    (["--moe-router-num-groups", "2"], "without --moe-router-group-topk"),
    (
        ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk", "3"],
        "multiple of 2",
    ),  # fmt: skip
    (["--moe-layer-freq", "([0]*1+[1]*2)"], "has 3 entries but --num-layers is 4"),
    (["--moe-layer-freq", "__import__('os').system('x')"], "not an integer or a list"),
    (["--moe-layer-freq", "[0]*4"], "no MoE layer"),
    (["--moe-layer-freq", "8"], "exceeds --num-layers 4"),
    (["--moe-layer-freq", "(" * 3000 + "1" + ")" * 3000], "deeper than 100"),  # no RecursionError
    (["--moe-layer-freq", "[" * 3000 + "1" + "]" * 3000], "--moe-layer-freq: '\\[\\[\\["),
    (["--moe-router-bias-update-rate", "0.01"], "without --moe-router-enable-expert-bias"),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_refused_before_any_work(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("*", r"\*")):
        parse_args([*SHAPE, "--num-experts", "8", *extra], world_size=1)


def test_refused_groups_across_ep_ranks_and_flags_without_experts():
    groups = ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"]
    with pytest.raises(ConfigError, match="do not line up with --expert-model-parallel-size 2"):
        parse_args([*SHAPE, "--num-experts", "12", *groups, "--expert-model-parallel-size", "2"],
                   world_size=2)  # fmt: skip
    for flag in (["--moe-router-enable-expert-bias"], ["--moe-layer-freq", "2"]):
        with pytest.raises(ConfigError, match="without --num-experts"):
            parse_args([*SHAPE, *flag], world_size=1)
