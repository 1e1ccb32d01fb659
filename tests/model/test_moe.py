"""Mixture of experts on one process: the layer against a per-token reference, grouped against
looped experts, routing, capacity, the load-balancing and z losses, and the rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig, model_config_from_saved
from megatron.model.context import BuildContext
from megatron.model.moe import MoELayer, moe_step_stats, padded_bmm, set_moe_loss_scale
from megatron.model.router import capacity_keep, route
from megatron.models.gpt.model import GPTModel
from megatron.training.log import model_flops_per_sample
from tests.helpers.models import tiny_moe


def _cfg(**kw) -> ModelConfig:
    return tiny_moe(**{"make_vocab_size_divisible_by": 128, **kw})


def _layer(cfg: ModelConfig, grouped=False) -> MoELayer:
    model = GPTModel(cfg, BuildContext(moe_grouped_gemm=grouped))
    return model.layers["0"].mlp


def _reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """sum over the chosen experts of p x expert(token), token by token, plus the shared one."""
    cfg, ex = layer.cfg, layer.experts
    tokens = x.reshape(-1, x.size(-1))
    probs, experts, _ = route(F.linear(tokens.float(), layer.router.weight.float()), cfg)
    rows = []
    for t in range(tokens.size(0)):
        y = torch.zeros_like(tokens[t])
        for p, e in zip(probs[t], experts[t], strict=True):
            h = tokens[t] @ ex.weight1[e] + (ex.bias1[e] if ex.bias1 is not None else 0)
            if cfg.swiglu:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h)
            y = y + p * (h @ ex.weight2[e] + (ex.bias2[e] if ex.bias2 is not None else 0))
        rows.append(y)
    out = torch.stack(rows).view_as(x)
    if layer.shared_expert is not None:
        shared = layer.shared_expert(x)
        if layer.shared_expert_gate is not None:
            shared = torch.sigmoid(layer.shared_expert_gate(x)) * shared
        out = out + shared
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"swiglu": True, "add_bias_linear": False, "moe_router_topk": 1},
        {"moe_shared_expert_intermediate_size": 16, "moe_shared_expert_gate": True},
        {"moe_router_score_function": "sigmoid", "moe_router_topk": 3},
        {"moe_router_pre_softmax": True, "moe_ffn_hidden_size": 24},
    ],
)
def test_layer_matches_per_token_reference(kw):
    layer = _layer(_cfg(**kw))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_experts_equal_the_loop(swiglu):
    """Loss and every gradient of the model: torch._grouped_mm (or a padded bmm) vs the loop."""
    cfg = _cfg(swiglu=swiglu, moe_aux_loss_coeff=0.01)
    tokens, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    runs = []
    for grouped in (False, True):
        model = GPTModel(cfg, BuildContext(moe_grouped_gemm=grouped))
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=1e-6)
    for name, grad in runs[0][1].items():
        torch.testing.assert_close(grad, runs[1][1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_padded_bmm_equals_per_group_products():
    x, w = torch.randn(9, 5), torch.randn(3, 5, 6)  # 5 and 6: no 16-byte rows, the bmm path
    counts = [4, 0, 5]
    want = torch.cat([x[:4] @ w[0], x[4:9] @ w[2]])
    torch.testing.assert_close(padded_bmm(x, w, counts), want)


def test_routing_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs, experts, _ = route(logits, _cfg(moe_router_topk=2))
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))
    probs, _, _ = route(logits, _cfg(moe_router_topk=2, moe_router_pre_softmax=True))
    torch.testing.assert_close(probs, torch.softmax(logits, -1)[:, :2])
    probs, _, _ = route(logits, _cfg(moe_router_topk=2, moe_router_score_function="sigmoid"))
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(probs, (s / s.sum()).unsqueeze(0))


def test_capacity_drop_policies():
    # 4 tokens, top-1, all to expert 0, 2 experts: capacity ceil(4 x 1 / 2 x 1) = 2
    experts = torch.zeros(4, 1, dtype=torch.long)
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.7]])
    keep = capacity_keep(probs, experts, 2, 1.0, "probs")
    assert keep.squeeze(1).tolist() == [False, True, False, True]
    keep = capacity_keep(probs, experts, 2, 1.0, "position")
    assert keep.squeeze(1).tolist() == [True, True, False, False]
    assert capacity_keep(probs, experts, 2, 4.0, "probs").all()


def test_dropped_assignments_contribute_nothing():
    cfg = _cfg(moe_expert_capacity_factor=0.25, moe_router_topk=1)
    layer = _layer(cfg)
    x = torch.randn(1, 8, 32)
    tokens = x.reshape(8, 32)
    probs, experts, keep, *_ = layer.router(tokens, 1)
    assert not keep.all()  # capacity ceil(8 / 4 x 0.25) = 1 per expert
    assert int(keep.sum()) <= 4
    out = layer(x).reshape(8, 32)
    for t in torch.nonzero(~keep.squeeze(1)).squeeze(1).tolist():
        torch.testing.assert_close(out[t], torch.zeros(32))


def test_aux_loss_is_coeff_when_balanced_and_z_loss_value():
    cfg = _cfg(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, moe_router_topk=1, num_experts=2)
    layer = _layer(cfg)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0] + [0.0] * 31, [-1.0] + [0.0] * 31]))
    x = torch.zeros(4, 32)
    x[:2, 0], x[2:, 0] = 5.0, -5.0  # two tokens to each expert, almost surely
    _, _, _, aux, z, counts = layer.router(x, 1)
    assert counts.tolist() == [2, 2]
    # each expert: 2 tokens, probability sum p + (1 - p) over the 4 tokens = 2 (balanced)
    torch.testing.assert_close(aux, torch.tensor(0.5 * 2 / (1 * 16) * (2 * 2 + 2 * 2)))
    lse = torch.logsumexp(torch.tensor([5.0, -5.0]), 0)
    torch.testing.assert_close(z, 0.1 * lse**2)


def test_seq_aux_loss_of_one_sequence_is_the_aux_loss():
    x = torch.randn(8, 32)
    layer = _layer(_cfg(moe_aux_loss_coeff=0.1))
    seq = _layer(_cfg(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss"))
    torch.testing.assert_close(layer.router(x, 1)[3], seq.router(x, 1)[3])
    assert not torch.allclose(layer.router(x, 1)[3], seq.router(x, 2)[3])


def test_aux_loss_gradient_scaled_and_stats_recorded():
    layer = _layer(_cfg(moe_aux_loss_coeff=1.0))
    layer.train()
    x = torch.randn(2, 8, 32)
    (0 * layer(x).sum()).backward()  # only the aux loss moves the router
    g1 = layer.router.weight.grad.clone()
    assert g1.abs().sum() > 0
    layer.router.weight.grad = None
    set_moe_loss_scale(layer, 0.25)
    (0 * layer(x).sum()).backward()
    torch.testing.assert_close(layer.router.weight.grad, 0.25 * g1)
    aux, z, micro = layer.stats.values[:3].tolist()
    assert micro == 2 and aux > 0 and z == 0
    assert layer.stats.values[3:].sum() == 2 * 16 * 2  # tokens x k, twice


def test_aux_loss_evens_a_skewed_router():
    """Training only the router on the aux loss spreads a router that sends all to expert 0."""
    torch.manual_seed(0)
    layer = _layer(_cfg(moe_aux_loss_coeff=1.0, moe_router_topk=1))
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.05)
        layer.router.weight[0] += 0.3  # expert 0 wins: the tokens share a positive mean
    x = torch.randn(64, 32) + 0.5

    def max_over_mean():
        counts = layer.router(x, 1)[5].float()
        return (counts.max() / counts.mean()).item()

    before = max_over_mean()
    opt = torch.optim.SGD([layer.router.weight], lr=0.5)
    for _ in range(60):
        opt.zero_grad()
        layer.router(x, 1)[3].backward()
        opt.step()
    assert before == 4.0 and max_over_mean() < 1.5


def test_settings_recorded_with_the_model():
    cfg = _cfg(moe_router_topk=1, moe_ffn_hidden_size=48, moe_layer_freq=2)
    back = model_config_from_saved(dataclasses.asdict(cfg))
    assert back == cfg and back.moe_layers == 1 and back.expert_ffn_size == 48
    model = GPTModel(back)
    assert isinstance(model.layers["0"].mlp, MoELayer)
    assert not isinstance(model.layers["1"].mlp, MoELayer)


BAD = [
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size"),
    (["--moe-aux-loss-coeff", "0.1"], "--moe-aux-loss-coeff"),
    (["--num-experts", "4", "--moe-shared-expert-gate"], "--moe-shared-expert-gate"),
    # EP is carved from DP x CP: at TP 2 x CP 2 of 4 ranks that is 2
    (
        ["--num-experts", "4", "--context-parallel-size", "2", "--expert-model-parallel-size", "4"],
        "--expert-model-parallel-size",
    ),
    (["--num-experts", "4", "--DDP-impl", "torch"], "--num-experts"),
    (["--num-experts", "0"], "--num-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm"),
    (["--moe-token-dispatcher-type", "allgather"], "--moe-token-dispatcher-type"),
    # expert tensor parallelism: 1 or the TP size (2 here), the expert width divisible by it
    (["--num-experts", "4", "--expert-tensor-parallel-size", "4"], "--expert-tensor-parallel-size"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "3"], "--moe-ffn-hidden-size"),
    (
        [
            "--num-experts",
            "4",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-pre-softmax",
        ],
        "--moe-router-pre-softmax",
    ),
]


@pytest.mark.parametrize("argv, flag", BAD)
def test_bad_moe_input_names_the_flag_and_fix(argv, flag, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    base += ["--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1"]
    base += ["--tensor-model-parallel-size", "2", "--train-iters", "1"]
    with pytest.raises(ConfigError) as err:
        parse_args(base + argv)
    assert flag in str(err.value) and "Fix:" in str(err.value)


def test_good_moe_flags_parse(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = parse_args(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
        + ["--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1"]
        + ["--train-iters", "1", "--num-experts", "8", "--expert-model-parallel-size", "2"]
        + ["--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather"]
    )
    assert cfg.model.num_experts == 8 and cfg.parallel.expert_model_parallel_size == 2
    assert cfg.kernels.moe_grouped_gemm and cfg.parallel.moe_token_dispatcher_type == "allgather"


def test_expert_tensor_parallel_size_defaults_to_tp_and_takes_1(monkeypatch):
    """Megatron-core's default: experts split over the TP group; 1 keeps them whole; an odd
    expert width is fine at ETP 1."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    base += ["--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1"]
    base += ["--train-iters", "1", "--num-experts", "4", "--tensor-model-parallel-size", "2"]
    cfg = parse_args(base)
    assert cfg.parallel.expert_tensor_parallel_size is None and cfg.parallel.expert_tp_size == 2
    cfg = parse_args(base + ["--expert-tensor-parallel-size", "1", "--moe-ffn-hidden-size", "3"])
    assert cfg.parallel.expert_tp_size == 1


@pytest.mark.parametrize("swiglu, bias", [(False, False), (True, True)])
def test_expert_shards_and_their_whole_indices(swiglu, bias):
    """Each (EP, ETP) rank's experts are the whole tensor's rows and [gate_r; up_r] columns
    (drawn whole, as at one process), and `whole_index` names exactly those elements (what the
    distributed optimizer saves for an ETP shard)."""
    from megatron.checkpoint.experts import whole_index
    from megatron.mpu.expert_shards import cut_whole
    from megatron.mpu.parallel_state import single_process_state

    cfg = _cfg(swiglu=swiglu, add_bias_linear=bias, moe_ffn_hidden_size=8)
    whole = _layer(cfg).experts
    for ep_rank, tp_rank in ((0, 1), (1, 0), (1, 1)):
        state = dataclasses.replace(
            single_process_state(), ep_size=2, ep_rank=ep_rank, etp_size=2, tp_rank=tp_rank
        )
        part = GPTModel(cfg, BuildContext(state=state)).layers["0"].mlp.experts
        assert part.weight1.shape == (2, 32, 8 if swiglu else 4) and part.weight2.shape[1] == 4
        for name, p in part.named_parameters():
            full = getattr(whole, name)
            torch.testing.assert_close(p, cut_whole(full, p, state), rtol=0, atol=0)
            index = whole_index(p, state, 0, p.numel())
            assert torch.equal(full.reshape(-1)[index], cut_whole(full, p, state).reshape(-1))
            assert bool((index[1:] > index[:-1]).all())  # increasing
        w1 = whole.weight1[2 * ep_rank : 2 * ep_rank + 2]
        if swiglu:  # [gate; up] of width 8 each: this rank's 4 of either
            gate, up = w1.chunk(2, dim=2)
            want = torch.cat([gate.chunk(2, 2)[tp_rank], up.chunk(2, 2)[tp_rank]], dim=2)
        else:
            want = w1.chunk(2, dim=2)[tp_rank]
        torch.testing.assert_close(part.weight1, want, rtol=0, atol=0)
        if bias:  # bias2 is whole on every ETP rank
            assert part.bias2.shape == (2, 32) and not part.bias2.expert_tensor_parallel


def test_distributed_optimizer_ranges_match_element_by_element():
    """Saved entries with a whole-tensor "index" (an ETP shard's) or a "range" are read back
    element by element for any wanted indices; a gap is an error."""
    from megatron.optim.shards import Piece as _Piece
    from megatron.optim.shards import assemble as _assemble

    values = torch.arange(20.0)
    entries = [
        {"range": (0, 10), "exp_avg": values[:10].clone()},
        {
            "range": (10, 19),
            "index": torch.tensor([10, 12, 14, 16, 18]),
            "exp_avg": values[10:20:2],
        },
        {
            "range": (11, 20),
            "index": torch.tensor([11, 13, 15, 17, 19]),
            "exp_avg": values[11:20:2],
        },
    ]
    piece = _Piece("w", None, 4, 16, 0, 0)
    assert torch.equal(_assemble(piece, entries)["exp_avg"], values[4:16])
    need = torch.tensor([1, 5, 13, 18])
    assert torch.equal(_assemble(piece, entries, need)["exp_avg"], values[need])
    with pytest.raises(ValueError, match="incomplete"):
        _assemble(piece, entries[:2], torch.tensor([3, 13]))


def test_moe_with_context_parallelism_parses_ep_over_the_cp_ranks(monkeypatch):
    """MoE x CP is allowed; EP may span the CP ranks (TP 2 x CP 2 of 4 ranks: DP 1, EP 2)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = parse_args(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
        + ["--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1"]
        + ["--train-iters", "1", "--num-experts", "4", "--expert-model-parallel-size", "2"]
        + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
        + ["--sequence-parallel", "--moe-router-load-balancing-type", "seq_aux_loss"]
    )
    assert cfg.parallel.data_parallel_size == 1 and cfg.parallel.expert_model_parallel_size == 2


def test_expert_groups_span_dp_x_cp_cp_ranks_first():
    """Megatron-core's expert grid: EP consecutive DP x CP ranks (CP inner) form an EP group,
    the ranks with the same EP index the expert-data-parallel group; TP peers stay apart."""
    from megatron.mpu.parallel_state import _expert_groups, rank_grid

    groups = _expert_groups(rank_grid(8, 1, 1, 2), 2)  # [PP 1, DP 4, CP 2, TP 1]
    assert groups["ep"] == [(0, 1), (2, 3), (4, 5), (6, 7)]  # each a CP pair
    assert groups["expert_dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    groups = _expert_groups(rank_grid(8, 2, 1, 2), 4)  # [PP 1, DP 2, CP 2, TP 2]
    assert groups["ep"] == [(0, 2, 4, 6), (1, 3, 5, 7)]  # all of DP x CP, per TP rank
    assert sorted(groups["expert_dp"]) == [(r,) for r in range(8)]  # every rank its own
    groups = _expert_groups(rank_grid(8, 1, 2, 1), 2)  # CP 1: EP consecutive DP ranks
    assert groups["ep"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups["expert_dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_moe_size_and_z_loss_flags_reach_the_built_model(monkeypatch):
    """--moe-ffn-hidden-size, --moe-shared-expert-intermediate-size and --moe-z-loss-coeff from
    the command line: the expert and shared-expert widths of the model and its z loss."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = parse_args(
        ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"]
        + ["--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1"]
        + ["--train-iters", "1", "--num-experts", "2", "--moe-router-topk", "1"]
        + ["--moe-ffn-hidden-size", "24", "--moe-shared-expert-intermediate-size", "40"]
        + ["--moe-z-loss-coeff", "0.25"]
    )
    layer = _layer(cfg.model)
    assert tuple(layer.experts.weight2.shape) == (2, 24, 32)  # (experts, width, hidden)
    assert layer.shared_expert.dense_4h_to_h.weight.shape[1] == 40
    logits = torch.tensor([[3.0, -1.0]])
    torch.testing.assert_close(
        layer.router._z_loss(logits), 0.25 * torch.logsumexp(logits, -1).square().mean()
    )


def test_flops_count_the_active_parameters():
    """Top-2 of 8 experts of width 32 cost what a dense MLP of width 64 costs, plus the router."""
    moe = _cfg(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    dense = _cfg(num_experts=None, ffn_hidden_size=64)
    s, h = 8, 32
    router = 3 * moe.num_layers * 2 * s * h * 8
    assert model_flops_per_sample(moe, s) - model_flops_per_sample(dense, s) == router


def test_step_stats_report_the_losses_and_the_load():
    model = GPTModel(_cfg(moe_aux_loss_coeff=0.1))
    model.train()
    tokens = torch.randint(0, 64, (2, 8))
    for _ in range(2):  # two micro batches
        model(tokens, labels=tokens).mean().backward()
    aux = model.layers["0"].mlp.stats.values[0] + model.layers["1"].mlp.stats.values[0]
    stats = moe_step_stats(model, model.state, model.cfg)
    torch.testing.assert_close(stats["load balancing loss"], aux / 2)
    assert stats["z loss"] == 0 and stats["expert load max/mean"] >= 1.0
    assert model.layers["0"].mlp.stats.values is None  # read once


# ---- the planner ----


def test_planner_counts_expert_parameters_and_shards_their_state_over_dp_over_ep():
    from megatron.planning.memory import (
        Training,
        model_state_bytes,
        stage_expert_params,
        stage_params,
    )

    for kw in ({}, {"swiglu": True, "moe_shared_expert_intermediate_size": 16}):
        cfg = _cfg(moe_layer_freq=2, moe_ffn_hidden_size=24, **kw)
        model = GPTModel(cfg)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for p in model.parameters() if getattr(p, "expert_parallel", 0))
        assert stage_params(cfg, 1, 1, 0) == total
        assert stage_expert_params(cfg, 1, 0, 1) == experts
        assert stage_params(cfg, 1, 1, 0, ep=2) == total - experts // 2
        # ETP 2: the experts' FFN halves, their output biases stay whole
        bias2 = cfg.moe_layers * cfg.num_experts * cfg.hidden_size * int(cfg.add_bias_linear)
        assert stage_expert_params(cfg, 1, 0, 1, 2) == (experts - bias2) // 2 + bias2
    # distributed optimizer at DP 4, EP 2: dense state / 4, expert state / 2
    t = Training(dtype_bytes=4, sharding="distributed")
    assert (
        model_state_bytes(1000, 4, t, experts=400, ep=2)["optimizer"] == 600 * 8 // 4 + 400 * 8 // 2
    )


def _moe_to_plan():
    """A model with 8 experts for the planner, at a 64-sample global batch."""
    from megatron.config.schema import MegatronConfig
    from megatron.config.schema_optimizer import OptimizerConfig
    from megatron.config.schema_training import TrainingConfig

    return MegatronConfig(
        model=ModelConfig(
            num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000, num_experts=8
        ),
        training=TrainingConfig(global_batch_size=64),
        optimizer=OptimizerConfig(lr=1e-4),
    )


def test_planner_enumerates_expert_parallelism_with_all_to_all_time():
    from megatron.planning.enumerate import Search, layouts, plans
    from megatron.planning.memory import Layout, Training
    from megatron.planning.timing import Hardware, step_time

    cfg = _moe_to_plan()
    search = Search(8, 80, micro_batches=(1,), recompute=(None,), context_parallel=(1,))
    found, _ = layouts(cfg, search)
    assert {x.ep for x in found} == {1, 2, 4, 8}
    assert all(x.dp % x.ep == 0 for x in found)
    ranked = plans(cfg, search)
    assert ranked and all("ep_comm" in p.time for p in ranked)
    t, hw = Training(), Hardware()
    one = step_time(cfg.model, Layout(1, 1, 8, 1, 8), t, hw)
    two = step_time(cfg.model, Layout(1, 1, 8, 1, 8, ep=2), t, hw)
    assert one["ep_comm"] == 0 < two["ep_comm"] and two["dp_comm"] < one["dp_comm"]


def test_planner_takes_expert_parallelism_from_dp_x_cp():
    """With CP the planner offers EP sizes dividing DP x CP (an EP group may be the CP ranks of
    one replica) and shards the expert state over the DP x CP / EP ranks holding it."""
    from megatron.planning.enumerate import Search, layouts
    from megatron.planning.memory import Layout, Training, stage_expert_params, stage_params
    from megatron.planning.pipeline_memory import estimate_memory

    cfg = _moe_to_plan()
    search = Search(8, 80, micro_batches=(1,), recompute=(None,), context_parallel=(2,))
    found, refused = layouts(cfg, search)
    assert found and all(x.cp == 2 and (x.dp * x.cp) % x.ep == 0 for x in found), refused
    assert any(x.dp % x.ep for x in found)  # EP beyond DP, across the CP ranks
    t = Training(dtype_bytes=4, sharding="distributed")
    for ep in (2, 4):  # DP 2 x CP 2: the expert state shards over 4 / EP ranks
        terms = estimate_memory(cfg.model, Layout(1, 1, 2, 1, 32, cp=2, ep=ep), t).terms
        params, experts = (
            stage_params(cfg.model, 1, 1, 0, ep),
            stage_expert_params(cfg.model, 1, 0, ep),
        )
        assert terms["optimizer"] == (params - experts) * 8 // 4 + experts * 8 // (4 // ep)


def test_expert_init_is_the_same_at_any_ep_size():
    """Experts are drawn on the whole (E, ...) tensors and sliced: EP rank 1 of 2 holds experts
    2-3 of the one-process model; expert biases start at zero."""
    from megatron.mpu.parallel_state import single_process_state

    cfg = _cfg()
    whole = _layer(cfg).experts
    state = dataclasses.replace(single_process_state(), ep_size=2, ep_rank=1)
    half = GPTModel(cfg, BuildContext(state=state)).layers["0"].mlp.experts
    assert half.weight1.shape[0] == 2
    torch.testing.assert_close(half.weight1, whole.weight1[2:], rtol=0, atol=0)
    torch.testing.assert_close(half.weight2, whole.weight2[2:], rtol=0, atol=0)
    assert whole.bias1.abs().sum() == 0 and whole.bias2.abs().sum() == 0
    assert not torch.equal(whole.weight1[0], whole.weight1[1])


@pytest.mark.slow  # compiles
def test_bias_dropout_fusion_runs_moe_layers_unchanged():
    """The fused residual add gets no MLP bias from an MoE layer (its output is complete)."""
    from megatron.config.schema_kernels import KernelConfig
    from megatron.fused_kernels import select_ops

    cfg = _cfg(moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.01)
    tokens = torch.randint(0, 64, (2, 8))
    ops = select_ops(KernelConfig(bias_dropout_fusion=True), torch.device("cpu"))
    runs = []
    for fused in (False, True):
        model = GPTModel(cfg, BuildContext(ops=ops) if fused else BuildContext())
        model.train()
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("width", [64, 256])
def test_planner_activation_memory_matches_the_built_moe_model(swiglu, width):
    from tests.helpers.planning import saved_and_predicted_activations

    cfg = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
        num_experts=4, moe_ffn_hidden_size=width, swiglu=swiglu,
    )  # fmt: skip
    measured, predicted = saved_and_predicted_activations(cfg)
    assert abs(predicted - measured) / measured < 0.01
