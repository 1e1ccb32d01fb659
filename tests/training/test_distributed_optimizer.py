"""--use-distributed-optimizer equals the plain optimizer (losses, grads, weights) at DP=2, DP=4
and TP2 x PP2 x DP2 in fp32/bf16/fp16; an fp16 overflow skips on every rank together; its
checkpoints resume at another DP size (4 -> 2, 4 -> 1, 1 -> 2) with the uninterrupted losses."""

import numpy as np
import pytest
import torch

from megatron.config.schema import ModelConfig
from megatron.data_parallel import ddp as ddp_module
from megatron.data_parallel.ddp import DistributedDataParallel
from megatron.models.gpt.model import GPTModel
from megatron.optim.distributed import shard_pieces
from megatron.optim.shards import Piece as _Piece
from megatron.optim.shards import assemble as _assemble
from megatron.optim.shards import parameter_names
from tests.helpers.checkpoints import _checkpoint_at, _cli
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    _CALLS,
    _losses,
    _poison_third_micro_batch_on_rank1,
    _train,
    flags,
    refusal,
    train_run,
)

DISTRIB = ["--use-distributed-optimizer"]
# Tolerances (loss rtol, weight rtol/atol, grad rtol/atol). fp32: reduction order only (the
# reduce-scatter sums in another order than the all-reduce). Half weights: ~1 ulp apart after
# a few steps (bf16: 2^-8 relative), so the gradients they give differ by about as much; a bias
# gradient sums many tokens' terms that cancel, so its small elements can move by more than their
# own ulp (CI saw 3.9e-5 on a 2.1e-3 fp16 element): the half atol is 1e-4.
TOL = {
    "fp32": (2e-5, 1e-4, 1e-6, 1e-4, 1e-7),
    "bf16": (2e-3, 2e-2, 1e-2, 5e-2, 1e-4),
    "fp16": (5e-4, 2e-3, 1e-3, 1e-2, 1e-4),
}


def _snapshot(model) -> tuple[dict, dict]:
    """(weights by name, this rank's gradient ranges by name: (lo, hi, flat fp32 grad)).

    The distributed optimizer only reduces this rank's shard, so grads are compared there."""
    names = parameter_names(model.module)
    weights = {names[id(p)]: p.detach().float().clone() for p, _, _ in model.param_ranges}
    if model.distributed:
        grads = {
            pc.name: (pc.lo, pc.hi, model.grad_buffer[pc.buf_lo : pc.buf_hi].clone())
            for pc in shard_pieces(model)
        }
    else:
        grads = {
            names[id(p)]: p.main_grad.detach().flatten().clone() for p, _, _ in model.param_ranges
        }
    return weights, grads


def _compare(plain, distrib, tol, what):
    (w0, g0), (w1, g1) = plain, distrib
    _, w_rtol, w_atol, g_rtol, g_atol = tol
    for name, w in w0.items():
        torch.testing.assert_close(
            w1[name], w, rtol=w_rtol, atol=w_atol, msg=lambda m, n=name: f"{what} weight {n}: {m}"
        )
    for name, (lo, hi, g) in g1.items():
        torch.testing.assert_close(
            g,
            g0[name][lo:hi],
            rtol=g_rtol,
            atol=g_atol,
            msg=lambda m, n=name: f"{what} grad {n}: {m}",
        )


def _equivalence_worker(rank, world, layouts, save_dir=None, overflow=True):
    """Each layout trained with the plain and the distributed optimizer in this spawn."""
    out = {}
    for what, argv, extra, tol in layouts:
        runs = []
        for opt in ([], extra):
            result = train_run(rank, world, argv + opt)
            runs.append((result.history, _snapshot(result.model)))
        _compare(runs[0][1], runs[1][1], TOL[tol], what)
        out[what] = [runs[0][0], runs[1][0]]
    if save_dir is not None:  # the DP=world reference run, saved at iteration 3
        argv = [*layouts[0][1], "--train-iters", "6", *DISTRIB]
        argv += ["--save", save_dir, "--save-interval", "3"]
        out["straight"] = _train(rank, world, argv)[0]
    if not overflow:
        return out
    _CALLS["n"] = 0  # fp16, rank 1's 3rd micro batch overflows: every rank skips together
    overflow = [*layouts[0][1], "--fp16", "--hysteresis", "1", "--initial-loss-scale", "1024"]
    out["overflow"] = _train(rank, world, overflow + DISTRIB, _poison_third_micro_batch_on_rank1)[0]
    return out


def _check_equivalence(results, layouts, overflow=True):
    for rank, out in enumerate(results):
        for what, _, _, tol in layouts:
            plain, distrib = out[what]
            rtol = TOL[tol][0]
            np.testing.assert_allclose(
                _losses(distrib), _losses(plain), rtol=rtol, err_msg=f"{what} rank {rank}"
            )
            norms = [[h["grad_norm"] for h in run] for run in (distrib, plain)]
            np.testing.assert_allclose(*norms, rtol=max(rtol, 1e-4), err_msg=what)
        if not overflow:
            continue
        h16 = out["overflow"]
        # DP=4, one micro batch per rank and step: rank 1's 3rd is in iteration 3.
        assert [h["updated"] for h in h16] == [True, True, False, True], rank
        assert [h["loss_scale"] for h in h16] == [1024.0, 1024.0, 512.0, 512.0], rank
        assert h16[2]["grad_norm"] is None


def _base(prefix, iters=4):
    return flags(prefix, "--adam-eps", "1e-4", "--num-layers", "4", iters=iters)


def _dp4_layouts(base):
    return [
        ("DP4 fp32", base, DISTRIB, "fp32"),
        (
            "DP4 bf16, 2 micro batches, 4000-element buckets, overlapped gather",
            base + ["--bf16", "--ddp-bucket-size", "4000", "--global-batch-size", "16"],
            DISTRIB + ["--overlap-param-gather"],
            "bf16",
        ),
        (
            "PP2 interleaved x DP2 fp16",
            base
            + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage"]
            + ["1", "--fp16", "--initial-loss-scale", "4096"],
            DISTRIB + ["--overlap-param-gather"],
            "fp16",
        ),
        (
            "TP2 x DP2 with --sequence-parallel",
            base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            DISTRIB + ["--overlap-param-gather"],
            "fp32",
        ),
    ]


@pytest.fixture(scope="module")
def dp4_spawn(data_prefix, tmp_path_factory):
    """One 4-rank spawn for both tests: the DP=4 layouts (plain vs distributed), the DP=4 run
    saved at iterations 3 and 6, and the fp16 overflow."""
    save_dir = str(tmp_path_factory.mktemp("distopt") / "dp4")
    layouts = _dp4_layouts(_base(data_prefix))
    return run_distributed(_equivalence_worker, 4, layouts, save_dir), layouts, save_dir


@pytest.mark.slow
def test_distributed_optimizer_equals_plain_at_dp4_and_tp2_pp2_dp2(data_prefix, dp4_spawn):
    # Micro batches per rank and step (global 8, micro 2): 1 at DP=4 (2 in the bf16 layout,
    # global 16), 2 at DP=2; the pipeline layouts accumulate over them under no_sync too.
    results, layouts, _ = dp4_spawn
    _check_equivalence(results, layouts)
    tp2pp2dp2 = [
        (
            "TP2 x PP2 x DP2",
            _base(data_prefix)
            + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            DISTRIB + ["--overlap-param-gather"],
            "fp32",
        )
    ]
    results = run_distributed(_equivalence_worker, 8, tp2pp2dp2, None, False)
    _check_equivalence(results, tp2pp2dp2, overflow=False)


def _resume_worker(rank, world, argv, runs):
    """Each (load dir, extra flags) resumed to iteration 6 in this spawn: its history."""
    return [_train(rank, world, [*argv, "--load", load, *extra])[0] for load, extra in runs]


def _continues(history, straight, first, what):
    assert [h["iteration"] for h in history] == list(range(first, 7)), what
    np.testing.assert_allclose(
        _losses(history), _losses(straight)[first - 1 :], rtol=2e-5, err_msg=what
    )


@pytest.mark.slow
def test_checkpoints_reshard_over_dp_4_to_2_to_1_and_back(data_prefix, dp4_spawn, tmp_path):
    """DP=4 saves at 3; DP=1 and DP=2 resume it; DP=1's iteration 4 resumes at DP=2;
    tools/convert_checkpoint.py turns it into TP=2, which resumes with its optimizer. Each ends
    with the uninterrupted DP=4 losses (rtol 2e-5: sums over DP ranks and micro batches in
    another order); the plain optimizer resumes from the distributed one's checkpoint, and back."""
    base = _base(data_prefix, iters=6)
    (out, *_), _, dp4 = dp4_spawn
    straight = out["straight"]
    at3 = _checkpoint_at(dp4, 3, tmp_path / "at3")
    dp1, plain = str(tmp_path / "dp1"), str(tmp_path / "plain")
    runs = [
        (at3, [*DISTRIB, "--save", dp1, "--save-interval", "1"]),
        (at3, ["--save", plain, "--save-interval", "1"]),  # into the plain optimizer
    ]
    (to_dp1, to_plain), *_ = run_distributed(_resume_worker, 1, base, runs)
    _continues(to_dp1, straight, 4, "DP4 -> DP1")
    _continues(to_plain, straight, 4, "DP4 distributed -> DP1 plain optimizer")
    at4 = _checkpoint_at(dp1, 4, tmp_path / "at4")
    plain_at4 = _checkpoint_at(plain, 4, tmp_path / "plain_at4")
    tp2 = str(tmp_path / "tp2")  # the converter carries the sharded state over to TP=2
    assert _cli()(["--load", at3, "--save", tp2, "--target-tensor-model-parallel-size", "2"]) == 0
    runs = [
        (at3, DISTRIB),
        (at4, DISTRIB),
        (at3, [*DISTRIB, "--no-load-optim", "--no-load-rng"]),
        (tp2, [*DISTRIB, "--tensor-model-parallel-size", "2", "--no-load-rng"]),
        (plain_at4, DISTRIB),  # the plain optimizer's checkpoint into the distributed one
    ]
    results = run_distributed(_resume_worker, 2, base, runs)
    for rank, (to_dp2, back_up, fresh, converted, from_plain) in enumerate(results):
        _continues(from_plain, straight, 5, f"DP1 plain -> DP2 distributed rank {rank}")
        _continues(to_dp2, straight, 4, f"DP4 -> DP2 rank {rank}")
        _continues(back_up, straight, 5, f"DP1 -> DP2 rank {rank}")
        _continues(converted, straight, 4, f"DP4 -> converted to TP2 x DP1 rank {rank}")
        # Weights loaded, optimizer afresh: the first loss is the checkpoint's, then it differs.
        np.testing.assert_allclose(_losses(fresh)[0], _losses(straight)[3], rtol=2e-5)
        assert _losses(fresh)[1] != pytest.approx(_losses(straight)[4], rel=1e-6)


@pytest.mark.parametrize(
    "extra,flag,says",
    [
        (["--use-distributed-optimizer", "--deepspeed"], "--use-distributed-optimizer", "ZeRO"),
        (["--overlap-param-gather"], "--overlap-param-gather", "--use-distributed-optimizer"),
        (["--use-distributed-optimizer", "--DDP-impl", "torch"], "--DDP-impl torch", "drop"),
        (["--use-distributed-optimizer", "--cpu-optimizer"], "--cpu-optimizer", "drop"),
        (
            ["--use-distributed-optimizer", "--bf16", "--allreduce-dtype", "params"],
            "--allreduce-dtype params",
            "drop",
        ),
    ],
)
def test_rules_name_the_flag_and_the_fix(extra, flag, says):
    message = refusal(*extra)
    assert flag in message and says in message and "Fix:" in message


def test_shards_cover_every_parameter_once_and_the_tied_embedding_has_its_own_bucket(
    monkeypatch,
):
    """DP=3 laid out on the meta device: the three ranks' pieces partition every parameter,
    each bucket is padded to equal shards, and `own_bucket` isolates the embedding."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    with torch.device("meta"):
        model = GPTModel(cfg)
    tied = model.word_embeddings_weight()
    monkeypatch.setattr(ddp_module, "group_size", lambda g: 1 if g is None else 3)
    covered = {}
    for dp_rank in range(3):
        monkeypatch.setattr(ddp_module, "group_rank", lambda g, r=dp_rank: 0 if g is None else r)
        ddp = DistributedDataParallel(
            model, "dp", bucket_size=20_000, use_distributed_optimizer=True, own_bucket=(tied,)
        )
        assert all((b.end - b.start) % (3 * 64) == 0 for b in ddp.buckets)
        (own,) = [b for b in ddp.buckets if any(p is tied for p in b.params)]
        assert len(own.params) == 1
        assert len(ddp.buckets) > 2
        for pc in shard_pieces(ddp):
            covered.setdefault(pc.name, []).append((pc.lo, pc.hi))
    for name, p in model.named_parameters():
        ranges = sorted(covered[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == p.numel(), name
        assert all(a[1] == b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True)), name


def test_assemble_cuts_any_saved_ranges_and_refuses_gaps():
    moment = torch.arange(10.0)
    saved = [
        {"range": (0, 4), "exp_avg": moment[0:4], "step": torch.tensor(3.0)},
        {"range": (4, 10), "exp_avg": moment[4:10], "step": torch.tensor(3.0)},
    ]
    piece = _Piece("w", None, 2, 7, 0, 5)
    out = _assemble(piece, saved)
    assert torch.equal(out["exp_avg"], moment[2:7]) and float(out["step"]) == 3.0
    with pytest.raises(ValueError, match="covers 2 of the 5 elements"):
        _assemble(piece, saved[:1])
