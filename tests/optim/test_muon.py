"""--optimizer muon: the update against torch.optim.Muon and against a direct per-logical-matrix
(and per-expert) computation; TP2, PP2 (interleaved), DP2 with the distributed optimizer
(overlapped gather) and DP2 with FSDP2 (6 steps), TP2 x DP2 with each of these two and an MoE
model at DP2, EP2 (plain and distributed optimizer), TP2 with ETP1 and PP2 (3 steps) equal one
process (losses, grad norms, weights); Muon's momentum saves, resumes exactly and reshards (a
1-process plain checkpoint resumed at TP2, and at DP2 with the distributed optimizer and with
FSDP2; the MoE one at EP2); a NaN on one rank skips the Muon step on both."""

import numpy as np
import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema import ModelConfig
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel
from megatron.optim.build import check_state_kind
from megatron.optim.matrices import Whole, deal
from megatron.optim.muon import (
    MatrixLayout,
    MuonSettings,
    build_muon,
    matrix_layouts,
    newton_schulz,
    orthogonalize,
)
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    _CALLS,
    BASE,
    _losses,
    _poison_third_micro_batch_on_rank1,
    _shard_of,
    _train,
    flags,
    train_run,
)

MUON = ["--optimizer", "muon", "--swiglu", "--num-query-groups", "2", "--weight-decay", "0.1"]


def _cfg(*extra):
    return parse_args(["--optimizer", "muon", "--lr", "0.01", *extra]).optimizer


def _whole(params, layouts):
    """The plain optimizer's orthogonalizer of whole weights (params: id -> weight)."""
    return Whole(params, lambda p, u: orthogonalize(u, layouts[id(p)], MuonSettings()))


def test_one_matrix_matches_torch_optim_muon():
    """Moonlight's scale (spectral x 0.2) is torch's adjust_lr_fn="match_rms_adamw"; the
    momentum is the same EMA; torch runs NS in bf16, we in fp32 (hence the tolerance)."""
    torch.manual_seed(0)
    w0, grads = torch.randn(48, 32), [torch.randn(48, 32) for _ in range(3)]
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    layouts = {id(ours): MatrixLayout("w", (48, 32))}
    opt = build_muon(
        [{"params": [ours], "wd_mult": 1.0}],
        _cfg("--weight-decay", "0.1"),
        [ours],
        _whole({id(ours): ours}, layouts),
    )
    ref = torch.optim.Muon([theirs], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(
        opt.state[ours]["momentum_buffer"], ref.state[theirs]["momentum_buffer"]
    )
    torch.testing.assert_close(ours - w0, theirs - w0, rtol=0.05, atol=2e-3)


def test_a_state_saved_by_another_optimizer_is_refused():
    w = torch.nn.Parameter(torch.randn(8, 4))
    adam = torch.optim.AdamW([w])
    w.grad = torch.randn(8, 4)
    adam.step()
    layouts = {id(w): MatrixLayout("w", (8, 4))}
    muon = build_muon([{"params": [w], "wd_mult": 1.0}], _cfg(), [w], _whole({id(w): w}, layouts))
    muon.load_state_dict(adam.state_dict())  # torch loads it; our check names the fix
    with pytest.raises(ValueError, match="--no-load-optim"):
        check_state_kind(muon, "muon")
    muon.state.clear()
    muon.step()
    check_state_kind(muon, "muon")
    saved = muon.state_dict()["state"].items()
    with pytest.raises(ValueError, match="exp_avg"):
        check_state_kind(adam, "adam", [(w, st) for _, st in saved])


def test_newton_schulz_orthogonalises():
    """Singular values of NS_5(x) in the quintic's band (~0.7 to 1.2), whatever x's scale."""
    x = torch.randn(64, 24) * 1e3
    s = torch.linalg.svdvals(newton_schulz(x, 5))
    assert s.min() > 0.5 and s.max() < 1.3, s


def _direct_qkv(u: torch.Tensor, groups: int, per: int, d: int, settings) -> torch.Tensor:
    """Q, K and V picked out of the fused rows by index, each orthogonalised and scaled on its
    own, written back by the same indices."""
    rows = torch.arange(u.shape[0]).view(groups, per + 2, d)
    out = torch.empty_like(u)
    for idx in (rows[:, :per].reshape(-1), rows[:, per].reshape(-1), rows[:, per + 1].reshape(-1)):
        m = u[idx]
        out[idx] = newton_schulz(m, settings.ns_steps) * 0.2 * max(m.shape) ** 0.5
    return out


def test_qkv_and_gate_up_are_orthogonalised_per_logical_matrix():
    torch.manual_seed(1)
    settings = MuonSettings()
    groups, per, d, h = 2, 3, 4, 16  # 6 query heads in 2 groups of 4-wide heads, hidden 16
    u = torch.randn(groups * (per + 2) * d, h)
    qkv = MatrixLayout("qkv", tuple(u.shape), 0, (groups, per, d))
    torch.testing.assert_close(
        orthogonalize(u, qkv, settings), _direct_qkv(u, groups, per, d, settings)
    )
    fused = newton_schulz(u, 5) * 0.2 * max(u.shape) ** 0.5
    assert not torch.allclose(orthogonalize(u, qkv, settings), fused, atol=1e-3)
    gate_up = torch.randn(32, 16)
    expected = torch.cat([newton_schulz(m, 5) * 0.2 * 16**0.5 for m in gate_up.chunk(2)])
    layout = MatrixLayout("fc1", (32, 16), 0, None, stacked=2)
    torch.testing.assert_close(orthogonalize(gate_up, layout, settings), expected)
    # --muon-no-split-qkv at TP2: NS of the gathered rows [g_0; u_0; g_1; u_1] is NS of
    # [gate; up] with its rows moved the same way
    moved = torch.cat([gate_up[i : i + 8] for i in (0, 16, 8, 24)])
    whole = newton_schulz(gate_up, 5)
    torch.testing.assert_close(
        newton_schulz(moved, 5), torch.cat([whole[i : i + 8] for i in (0, 16, 8, 24)])
    )


def test_muon_takes_the_layers_matrices_and_adamw_the_rest():
    cfg = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
        vocab_size=128, swiglu=True,
    )  # fmt: skip
    model = GPTModel(cfg, BuildContext(seed=1))
    layouts = matrix_layouts(model, MuonSettings())
    names = {n for n, p in model.named_parameters() if id(p) in layouts}
    assert len(names) == 8 and all(n.startswith("layers.") for n in names), names
    assert all(p.ndim == 2 for n, p in model.named_parameters() if n in names)
    qkv = [layouts[id(p)] for n, p in model.named_parameters() if "query_key_value.w" in n]
    assert qkv[0].qkv == (2, 2, 8)  # 2 groups of 2 queries, head dim 8
    fc1 = [layouts[id(p)] for n, p in model.named_parameters() if "dense_h_to_4h.w" in n]
    assert fc1[0].stacked == 2
    unsplit = matrix_layouts(model, MuonSettings(split_qkv=False))
    assert all(not u.qkv and u.stacked == 1 for u in unsplit.values())


def test_each_expert_is_orthogonalised_on_its_own():
    """(experts, in, out) weights: each expert's (out x in) matrix, SwiGLU's gate and up apart,
    scaled by its own shape (unit_rms_norm: sqrt(out / in), so the orientation shows)."""
    cfg = ModelConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=64,
        swiglu=True, num_experts=3, moe_ffn_hidden_size=6,
    )  # fmt: skip
    model = GPTModel(cfg, BuildContext(seed=1))
    layouts = matrix_layouts(model, MuonSettings())
    by_name = {n: layouts.get(id(p)) for n, p in model.named_parameters()}
    w1, w2 = by_name["layers.0.mlp.experts.weight1"], by_name["layers.0.mlp.experts.weight2"]
    assert w1.experts and w1.stacked == 2 and w2.experts and w2.stacked == 1
    assert by_name["layers.0.mlp.experts.bias1"] is None  # (experts, out): biases, AdamW's
    assert by_name["layers.0.mlp.router.weight"].shape == (3, 16)  # a plain matrix (Megatron-core)
    settings = MuonSettings(scale_mode="unit_rms_norm")
    u1, u2 = torch.randn(3, 16, 12), torch.randn(3, 6, 16)

    def direct(m):  # (in, out) -> NS of (out, in) scaled by sqrt(out / in), back
        return (newton_schulz(m.T, 5) * 0.2 * (m.shape[1] / m.shape[0]) ** 0.5).T

    want1 = torch.stack([torch.cat([direct(w[:, :6]), direct(w[:, 6:])], dim=1) for w in u1])
    torch.testing.assert_close(orthogonalize(u1, w1, settings), want1)
    torch.testing.assert_close(orthogonalize(u2, w2, settings), torch.stack(list(map(direct, u2))))


def test_matrices_are_dealt_once_in_decreasing_size():
    owners = deal([10, 40, 40, 20, 5], 2)
    assert owners == [1, 0, 1, 0, 0]  # sizes 40, 40, 20, 10, 5 dealt to 0, 1, 0, 1, 0
    assert deal([3, 2], 1) == [0, 0]


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--deepspeed"], "--deepspeed"),
        (["--cpu-optimizer"], "--cpu-optimizer"),
        (
            ["--num-experts", "4", "--tensor-model-parallel-size", "2"],
            "--expert-tensor-parallel-size 2",
        ),
    ],
)
def test_muon_refuses_what_it_cannot_run_with(extra, says):
    from megatron.config.rules import validate

    argv = [*BASE, "--optimizer", "muon", "--lr", "1e-3", "--train-iters", "2", *extra]
    with pytest.raises(ConfigError, match=says):
        validate(parse_args(argv, world_size=2), "train-gpt")
    if "--num-experts" in extra:  # experts whole on each rank: Muon takes them
        ok = [*argv, "--expert-tensor-parallel-size", "1"]
        validate(parse_args(ok, world_size=2), "train-gpt")


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--muon-momentum", "0.9"], "--muon-momentum"),
        (["--muon-no-split-qkv"], "--muon-no-split-qkv"),
        (["--no-muon-nesterov"], "--no-muon-nesterov"),
        (["--muon-ns-steps", "3"], "--muon-num-ns-steps"),
    ],
)
def test_muon_flags_without_muon_are_refused(extra, says):
    from megatron.config.rules import validate

    argv = [*BASE, "--lr", "1e-3", "--train-iters", "2", *extra]
    with pytest.raises(ConfigError, match=says):
        validate(parse_args(argv, world_size=1), "train-gpt")


def _weights(result) -> dict:
    return {k: v.numpy().copy() for k, v in result.model.state_dict().items()}


def _three(argv):
    """The same run stopped after 3 of its 6 steps (the LR schedule does not depend on it)."""
    return [a if a != "6" else "3" for a in argv]


def _reference_worker(rank, world, argv, save_dir, moe_argv):
    """One process: 6 straight steps; 3 steps saved (weights kept), resumed to 6; the MoE
    model's 6 steps, and 3 saved (weights kept)."""
    straight = train_run(rank, world, argv)
    at3 = _weights(train_run(rank, world, _three(argv) + ["--save", save_dir]))
    resumed = _train(rank, world, argv + ["--load", save_dir, "--save", save_dir + "_b"])
    moe = train_run(rank, world, moe_argv)
    moe3 = _weights(train_run(rank, world, _three(moe_argv) + ["--save", save_dir + "_moe"]))
    return straight.history, _weights(straight), resumed[0], at3, (moe.history, moe3)


def _layouts_worker(rank, world, argv, ref_weights, load_dir, moe):
    """LAYOUTS (weights checked here), RESUMES, a NaN skip; `moe`: (flags, reference weights
    after 3 steps) of the MoE model, trained 3 steps at MOE_LAYOUTS."""
    out = {}
    for what, extra in MOE_LAYOUTS:
        result = train_run(rank, world, _three(moe[0]) + extra)
        _check_weights(result.model, moe[1], what)
        out[what] = result.history
    for what, extra in LAYOUTS:
        result = train_run(rank, world, argv + extra)
        if hasattr(result.model, "mesh"):  # FSDP2: whole weights as saved, on DP rank 0
            _check_saved_weights(result.model, ref_weights, what)
        else:
            _check_weights(result.model, ref_weights, what)
        out[what] = result.history
    for what, extra in RESUMES:
        out[what] = _train(rank, world, argv + extra + ["--load", load_dir, "--no-load-rng"])[0]
    moe_load = ["--load", load_dir + "_moe", "--no-load-rng"]  # experts' momentum cut over EP
    out["MoE resumed at EP2"] = _train(rank, world, moe[0] + EP2 + DISTRIB + moe_load)[0]
    _CALLS["n"] = 0  # rank 1's 3rd micro batch (iteration 2) has a NaN loss: both ranks skip
    out["nan"] = _train(rank, world, argv + DISTRIB, _poison_third_micro_batch_on_rank1)[0]
    return out


def _check_weights(ddp, ref_weights, what):
    st = ddp.module.chunks[0].state
    for chunk in ddp.module.chunks:
        for name, p in chunk.named_parameters():
            expected = _shard_of(torch.from_numpy(ref_weights[name]), p, st.tp_rank, st.tp_size)
            if getattr(p, "expert_parallel", False):  # this EP rank's experts
                expected = expected.chunk(st.ep_size)[st.ep_rank]
            torch.testing.assert_close(
                p.detach(), expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{what} {n}: {m}"
            )


def _check_saved_weights(model, ref_weights, what):
    """FSDP2's whole TP-local weights (on DP x CP rank 0; meta elsewhere) against the
    reference's TP shard (the parameters keep their TP attributes under fully_shard)."""
    st = model.module.chunks[0].state
    params = {n: p for c in model.module.chunks for n, p in c.named_parameters()}
    for name, v in model.state_dict().items():
        if not v.is_meta:
            expected = torch.from_numpy(ref_weights[name])
            if name in params:
                expected = _shard_of(expected, params[name], st.tp_rank, st.tp_size)
            torch.testing.assert_close(
                v.float(), expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{what} {n}: {m}"
            )


TP2 = ["--tensor-model-parallel-size", "2"]
FSDP = ["--use-torch-fsdp2"]
DISTRIB = ["--use-distributed-optimizer"]
VIRTUAL = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 2 chunks per stage
LAYOUTS = [
    ("TP2", TP2),
    ("PP2 interleaved", ["--pipeline-model-parallel-size", "2"] + VIRTUAL),
    ("DP2 distributed optimizer", DISTRIB + ["--overlap-param-gather"]),
    ("DP2 FSDP2", FSDP),
]
EP2 = ["--expert-model-parallel-size", "2"]
MOE = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--num-layers", "2"]
MOE += ["--adam-eps", "1e-4"]  # AdamW's part: near-zero bias gradients summed in another order
MOE_LAYOUTS = [  # each expert's [gate; up] and down matrices orthogonalised on their own
    ("MoE DP2", []),
    ("MoE DP2 distributed optimizer", DISTRIB),
    ("MoE EP2", EP2),
    ("MoE EP2 distributed optimizer", EP2 + DISTRIB),
    ("MoE TP2 (ETP1)", TP2 + ["--expert-tensor-parallel-size", "1"]),
    ("MoE PP2", ["--pipeline-model-parallel-size", "2"]),
]
RESUMES = [
    ("resumed at TP2", TP2),
    ("resumed at DP2 distributed", DISTRIB),
    ("resumed at DP2 FSDP2", FSDP),
]


@pytest.fixture(scope="module")
def one_process(data_prefix, tmp_path_factory):
    """The one-process reference: flags, 6 straight steps (history, weights), 3 saved and
    resumed to 6 (history), the save directory, the weights after 3 steps; the MoE model's
    (flags, 6 steps' history, weights after 3)."""
    argv = flags(data_prefix, *MUON, "--num-layers", "4", iters=6)
    moe_argv = flags(data_prefix, *MUON, *MOE, iters=6)
    save = str(tmp_path_factory.mktemp("muon") / "one")
    ((straight, weights, resumed, at3, moe),) = run_distributed(
        _reference_worker, 1, argv, save, moe_argv
    )
    return argv, straight, weights, resumed, save, at3, (moe_argv, *moe)


def _assert_same_history(history, straight, what):
    np.testing.assert_allclose(_losses(history), _losses(straight), rtol=2e-5, err_msg=what)
    norms = [[h["grad_norm"] for h in run] for run in (history, straight)]
    np.testing.assert_allclose(*norms, rtol=1e-4, err_msg=f"{what} grad norms")


@pytest.mark.slow
def test_tp2_pp2_dp2_distributed_and_moe_equal_one_process_and_resume(one_process):
    argv, straight, weights, resumed, save, _, (moe_argv, moe_straight, moe3) = one_process
    np.testing.assert_allclose(_losses(resumed), _losses(straight)[3:], rtol=0, atol=0)
    for run in (straight, moe_straight):
        assert _losses(run)[-1] < _losses(run)[0] - 0.05  # it learns
    results = run_distributed(_layouts_worker, 2, argv, weights, save, (moe_argv, moe3))
    for rank, out in enumerate(results):
        for what, _ in MOE_LAYOUTS:
            _assert_same_history(out[what], moe_straight[:3], f"{what} rank {rank}")
        for what, _ in LAYOUTS:
            _assert_same_history(out[what], straight, f"{what} rank {rank}")
        assert [h["updated"] for h in out["nan"]] == [True, False, True, True, True, True]
        assert np.isfinite(_losses(out["nan"])[2:]).all(), out["nan"]
        for what, _ in RESUMES:
            np.testing.assert_allclose(
                _losses(out[what]), _losses(straight)[3:], rtol=2e-5, err_msg=f"{what} {rank}"
            )
        moe_resumed = out["MoE resumed at EP2"]
        np.testing.assert_allclose(_losses(moe_resumed), _losses(moe_straight)[3:], rtol=2e-5)


def _four_rank_worker(rank, world, argv, ref_weights):
    """TP2 x DP2 with the distributed optimizer and with FSDP2, 3 steps: each rank's TP-local
    weights against the reference's TP shard (FSDP2: as saved, whole on DP rank 0)."""
    out = {}
    for what, extra in TP_DP:
        result = train_run(rank, world, _three(argv) + extra)
        if hasattr(result.model, "mesh"):
            _check_saved_weights(result.model, ref_weights, what)
        else:
            _check_weights(result.model, ref_weights, what)
        out[what] = result.history
    return out


TP_DP = [("TP2 x DP2 distributed optimizer", TP2 + DISTRIB), ("TP2 x DP2 FSDP2", TP2 + FSDP)]


@pytest.mark.slow
def test_tp2_x_dp2_distributed_and_fsdp2_equal_one_process(one_process):
    """A TP-split matrix orthogonalised whole by the DP rank that owns it (each TP rank of
    that DP rank gathers its TP shards), the update scattered back over DP."""
    argv, straight, _, _, _, at3, _ = one_process  # 3 steps: the reference's first 3
    for rank, out in enumerate(run_distributed(_four_rank_worker, 4, argv, at3)):
        for what, _ in TP_DP:
            _assert_same_history(out[what], straight[:3], f"{what} rank {rank}")
