"""--use-torch-fsdp2 equals the plain optimizer's run (losses, grad norms, weights, this rank's
gradient shard) at DP4 (untied embedding), DP2, TP2 x DP2 (+ sequence parallel, recompute,
bf16) and interleaved PP2 x CP2 (sharded over CP); its checkpoints resume exactly as FSDP2 at
another DP size and at TP2 / PP2, as the distributed optimizer and as the plain one, and theirs
as FSDP2; an fp16 overflow on one rank skips the step on every rank; the flags it cannot run
with are refused.

The plain optimizer's DP runs are the one-process run's equals (tests/training/test_training.py),
so equality with them here is equality with one process."""

import numpy as np
import pytest
import torch

from megatron.config.cli import parse_args
from megatron.optim.fsdp2 import fsdp_pieces
from megatron.optim.shards import parameter_names
from tests.helpers.checkpoints import _checkpoint_at
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    _CALLS,
    BASE,
    _losses,
    _poison_third_micro_batch_on_rank1,
    _train,
    flags,
    refusal,
    train_run,
)

FSDP = ["--use-torch-fsdp2"]
# (loss rtol, weight rtol, weight atol, grad rtol, grad atol): fp32 differs by summation order
# only; bf16 weights are compared as saved (bf16: 2^-8 relative)
TOL = {"fp32": (2e-5, 1e-4, 2e-6, 1e-3, 1e-7), "bf16": (2e-3, 2e-2, 1e-2, 5e-2, 1e-4)}


def _snapshot(model):
    """(whole weights as saved, this rank's gradient shard by name: (lo, hi, grad)), numpy.
    FSDP2 assembles the whole weights for the checkpoint's writer, DP x CP rank 0, only."""
    state = model.state_dict()
    weights = {k: v.float().numpy() for k, v in state.items() if not v.is_meta}
    if hasattr(model, "mesh"):  # FSDP2: the shard this rank holds
        pieces = fsdp_pieces(model)
        grads = {pc.name: (pc.lo, pc.hi, pc.param.main_grad.flatten().numpy()) for pc in pieces}
    else:
        names = parameter_names(model.module)
        grads = {names[id(p)]: p.main_grad.flatten().numpy() for p in model.module.parameters()}
    return weights, grads


def _pair_worker(rank, world, layouts, save=None):
    """Each layout trained plain and with FSDP2: (histories, snapshots); then, with `save`
    (directory, flags), an FSDP2 run saved at iterations 3 and 6."""
    out = {}
    for what, argv, extra, _ in layouts:
        runs = [train_run(rank, world, argv + opt) for opt in ([], FSDP + extra)]
        out[what] = [(r.history, _snapshot(r.model)) for r in runs]
    if save is not None:  # (directory, flags)
        argv = [*save[1], "--train-iters", "6", *FSDP]
        out["straight"] = _train(rank, world, [*argv, "--save", save[0], "--save-interval", "3"])[0]
        at3 = f"{save[0]}_at3"
        if rank == 0:
            _checkpoint_at(save[0], 3, at3)
        torch.distributed.barrier()
        out["resumed"] = _train(rank, world, [*argv, "--load", at3])[0]  # the same layout
    return out


def _check_pairs(results, layouts):
    for rank, out in enumerate(results):
        for what, _, _, tol in layouts:
            (h0, (w0, g0)), (h1, (w1, g1)) = out[what]
            l_rtol, w_rtol, w_atol, g_rtol, g_atol = TOL[tol]
            msg = f"{what} rank {rank}"
            np.testing.assert_allclose(_losses(h1), _losses(h0), rtol=l_rtol, err_msg=msg)
            norms = [[h["grad_norm"] for h in run] for run in (h1, h0)]
            np.testing.assert_allclose(*norms, rtol=max(l_rtol, 1e-4), err_msg=msg)
            assert set(w1) <= set(w0), msg  # FSDP2: all of them on DP x CP rank 0
            assert rank > 0 or list(w1) == list(w0), msg
            for name, w in w1.items():
                np.testing.assert_allclose(w, w0[name], w_rtol, w_atol, err_msg=f"{msg} {name}")
            for name, (lo, hi, g) in g1.items():
                np.testing.assert_allclose(g, g0[name][lo:hi], g_rtol, g_atol, err_msg=name)


def _base(prefix, iters=3):
    return flags(prefix, "--adam-eps", "1e-4", iters=iters)


@pytest.fixture(scope="module")
def dp4_spawn(data_prefix, tmp_path_factory):
    """One 4-rank spawn: DP4 (untied: the embedding a unit of its own), TP2 x DP2 (SP,
    recompute, bf16) and interleaved PP2 x CP2 (no resharding after forward), plain against
    FSDP2; DP4 FSDP2 saved at 3 and 6."""
    base = _base(data_prefix)
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"]
    tp2 += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    layouts = [
        ("DP4 fp32 untied embedding", base + ["--untie-embeddings-and-output-weights"], [], "fp32"),
        ("TP2 x DP2 SP recompute bf16", base + tp2, [], "bf16"),
        (
            "PP2 interleaved x CP2 (sharded over the CP ranks), no reshard after forward",
            base
            + ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]
            + ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
            ["--torch-fsdp2-no-reshard-after-forward"],
            "fp32",
        ),
    ]
    save = str(tmp_path_factory.mktemp("fsdp2") / "dp4")
    return run_distributed(_pair_worker, 4, layouts, (save, base)), layouts, save


@pytest.mark.slow
def test_fsdp2_equals_plain_at_dp4_tp2_dp2_and_pp2_cp2_and_resumes_bit_for_bit(dp4_spawn):
    results, layouts, _ = dp4_spawn
    _check_pairs(results, layouts)
    for rank, out in enumerate(results):  # DP4 FSDP2 resumed at 3 on its own layout: exact
        assert _losses(out["resumed"]) == _losses(out["straight"])[3:], rank
        norms = [[h["grad_norm"] for h in run] for run in (out["resumed"], out["straight"][3:])]
        assert norms[0] == norms[1], rank


def _resume_worker(rank, world, layouts, runs):
    """DP2 plain against FSDP2; each (load dir, extra flags) resumed, in order; an fp16 run
    whose rank 1 overflows in its 3rd micro batch."""
    out = _pair_worker(rank, world, layouts)
    base = [*layouts[0][1], "--train-iters", "6"]
    out["resumed"] = [_train(rank, world, [*base, "--load", d, *extra])[0] for d, extra in runs]
    _CALLS["n"] = 0
    fp16 = ["--fp16", "--hysteresis", "1", "--initial-loss-scale", "1024", *FSDP]
    out["overflow"] = _train(rank, world, layouts[0][1] + fp16, _poison_third_micro_batch_on_rank1)
    return out


def _continues(history, straight, first, last, what):
    assert [h["iteration"] for h in history] == list(range(first, last + 1)), what
    np.testing.assert_allclose(
        _losses(history), _losses(straight)[first - 1 : last], rtol=2e-5, err_msg=what
    )


@pytest.mark.slow
def test_fsdp2_checkpoints_load_as_fsdp2_distributed_and_plain_and_back(
    data_prefix, dp4_spawn, tmp_path
):
    """DP4 FSDP2 saved at 3: DP2 resumes it as FSDP2, as the distributed optimizer and as the
    plain optimizer (these two saving at 4, which FSDP2 resumes), and TP2 and PP2 as FSDP2
    (resharded on load, over a one-rank DP mesh), and FSDP2 saving with --async-save at 4,
    which FSDP2 resumes; every run ends with the
    uninterrupted losses (rtol 2e-5: sums over ranks in another order). And DP2 plain
    against FSDP2."""
    (out, *_), _, dp4 = dp4_spawn
    straight = out["straight"]
    at3 = _checkpoint_at(dp4, 3, tmp_path / "at3")
    distrib, plain = str(tmp_path / "distrib"), str(tmp_path / "plain")
    async_dir = str(tmp_path / "async")
    until4 = ["--train-iters", "4", "--save-interval", "4", "--save"]
    runs = [
        (at3, FSDP),
        (at3, ["--use-distributed-optimizer", *until4, distrib]),
        (at3, [*until4, plain]),
        (distrib, FSDP),
        (plain, FSDP),
        (at3, [*FSDP, "--tensor-model-parallel-size", "2"]),  # resharded on load
        (at3, [*FSDP, "--pipeline-model-parallel-size", "2"]),
        (at3, [*FSDP, "--async-save", *until4, async_dir]),  # FSDP2 saves in the background
        (async_dir, FSDP),
    ]
    layouts = [
        ("DP2 fp32", _base(data_prefix), ["--torch-fsdp2-reshard-after-forward", "true"], "fp32")
    ]
    results = run_distributed(_resume_worker, 2, layouts, runs)
    _check_pairs(results, layouts)
    for rank, res in enumerate(results):
        fsdp2, as_distrib, as_plain, distrib_back, plain_back, tp2, pp2, *saved = res["resumed"]
        _continues(saved[0], straight, 4, 4, f"FSDP2 DP4 -> FSDP2 --async-save rank {rank}")
        _continues(saved[1], straight, 5, 6, f"FSDP2 --async-save -> FSDP2 rank {rank}")
        _continues(tp2, straight, 4, 6, f"FSDP2 DP4 -> FSDP2 TP2 rank {rank}")
        _continues(pp2, straight, 4, 6, f"FSDP2 DP4 -> FSDP2 PP2 rank {rank}")
        _continues(fsdp2, straight, 4, 6, f"FSDP2 DP4 -> FSDP2 DP2 rank {rank}")
        _continues(as_distrib, straight, 4, 4, f"FSDP2 DP4 -> distributed DP2 rank {rank}")
        _continues(as_plain, straight, 4, 4, f"FSDP2 DP4 -> plain DP2 rank {rank}")
        _continues(distrib_back, straight, 5, 6, f"distributed DP2 -> FSDP2 DP2 rank {rank}")
        _continues(plain_back, straight, 5, 6, f"plain DP2 -> FSDP2 DP2 rank {rank}")
        # DP2, two micro batches per rank and step: rank 1's 3rd is in iteration 2; every
        # rank skips it together over the sharded gradients, and fp16 halves its loss scale
        h16 = res["overflow"][0]
        assert [h["updated"] for h in h16] == [True, False, True], rank
        assert [h["loss_scale"] for h in h16] == [1024.0, 512.0, 512.0], rank
        assert h16[1]["grad_norm"] is None


@pytest.mark.parametrize(
    "extra,flag,says",
    [
        (["--use-torch-fsdp2", "--deepspeed"], "--deepspeed", "--zero-stage 3"),
        (
            ["--use-torch-fsdp2", "--use-distributed-optimizer"],
            "--use-distributed-optimizer",
            "one",
        ),
        (["--use-torch-fsdp2", "--DDP-impl", "torch"], "--DDP-impl torch", "drop"),
        (["--use-torch-fsdp2", "--cpu-optimizer"], "--cpu-optimizer", "drop"),
        (["--use-torch-fsdp2", "--num-experts", "2"], "--num-experts", "distributed-optimizer"),
        (["--use-torch-fsdp2", "--torch-compile"], "--torch-compile", "drop"),
        (["--use-torch-fsdp2", "--ddp-bucket-size", "1000"], "--ddp-bucket-size", "per layer"),
        (
            ["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"]
            + ["--pipeline-schedule", "zb-h1"],
            "--pipeline-schedule zb-h1",
            "interleaved",
        ),
        (["--torch-fsdp2-no-reshard-after-forward"], "without --use-torch-fsdp2", "add"),
        (
            ["--torch-fsdp2-reshard-after-forward", "true"],
            "--torch-fsdp2-reshard-after-forward",
            "add",
        ),
    ],
)
def test_refusals_name_the_flag_and_the_fix(extra, flag, says):
    message = refusal(*extra)
    assert flag in message and says in message and "Fix:" in message


def test_reshard_after_forward_takes_megatron_cores_spellings():
    for argv, want in (
        ([], "auto"),
        (["--torch-fsdp2-reshard-after-forward", "true"], "true"),
        (["--torch-fsdp2-reshard-after-forward", "false"], "false"),
        (["--torch-fsdp2-no-reshard-after-forward"], "false"),
    ):
        cfg = parse_args([*BASE, *FSDP, *argv], world_size=2)
        assert cfg.distributed.torch_fsdp2_reshard_after_forward == want


def test_what_mtp_reads_outside_a_forward_stays_in_the_root_unit():
    """Untied with MTP, the depths read the word embedding and call the head's loss outside
    those modules' forwards: neither may be a unit of its own (its weight would still be a
    shard there: "mixed torch.Tensor and DTensor"); without MTP both are units."""
    from torch import nn

    from megatron.data_parallel.fsdp2 import _units

    class Chunk(nn.Module):
        def __init__(self, mtp):
            super().__init__()
            self.embedding, self.layer, self.head = (
                nn.Linear(2, 2),
                nn.Linear(2, 2),
                nn.Linear(2, 2),
            )
            self.mtp = nn.Linear(2, 2) if mtp else None
            self.tied, self.shares_embedding = False, mtp

        def layer_list(self):
            return [self.embedding, self.layer, self.head]

    plain, mtp = Chunk(False), Chunk(True)
    assert _units(plain) == [plain.embedding, plain.layer, plain.head]
    assert _units(mtp) == [mtp.layer]
