"""An optimizer added by one registration, from this file alone: a few-line Lion trains with
--optimizer lion plain and with --use-distributed-optimizer at DP2, each equal to one process
(losses, weights). And every backend refuses, by name, a checkpoint another --optimizer wrote:
under --use-torch-fsdp2 too (SGD or Muon from AdamW's, AdamW from Muon's), which resumed
before with momentum silently zero or a raw KeyError."""

import numpy as np
import pytest
import torch

from megatron.config.optimizers import OptimizerKind, register
from tests.helpers.distributed import run_distributed
from tests.helpers.training import _losses, _ref_worker, _train, flags


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): w -= lr (sign(b1 m + (1 - b1) g) + wd w); m = b2 m + (1 - b2) g."""

    def __init__(self, groups, lr, betas):
        super().__init__(groups, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


def build_lion(groups, cfg, feed):
    groups = [{**g, "weight_decay": cfg.weight_decay * g["wd_mult"]} for g in groups]
    return Lion(groups, cfg.lr, (cfg.adam_beta1, cfg.adam_beta2))


def register_lion() -> None:
    """The one registration --optimizer lion needs (made in the ranks' processes, so the
    table of the test session itself, docs/flags.md's choices included, stays as shipped)."""
    register(OptimizerKind("lion", build_lion, ("exp_avg",), lambda settings: 4))


LION = ["--optimizer", "lion", "--lr", "1e-3", "--weight-decay", "0.1"]
DISTRIB = ["--use-distributed-optimizer"]
FSDP = ["--use-torch-fsdp2"]


def _refusal(rank, world, argv) -> str:
    """The error of a run that must be refused ('' if it ran)."""
    try:
        _train(rank, world, argv)
    except ValueError as e:
        return str(e)
    return ""


def _one_process_worker(rank, world, argv, save_dir):
    """Lion on one process; then FSDP2 checkpoints of AdamW and Muon resumed by another."""
    register_lion()
    out = {"lion": _ref_worker(rank, world, argv + LION)}
    short = [a if a != "6" else "2" for a in argv] + FSDP
    for saved, resumed in (("adam", "sgd"), ("adam", "muon"), ("muon", "adam")):
        where = f"{save_dir}/{saved}"
        _train(rank, world, short + ["--optimizer", saved, "--save", where])
        resume = short + ["--optimizer", resumed, "--load", where]
        out[saved, resumed] = _refusal(rank, world, resume)
    return out


def _dp2_worker(rank, world, argv):
    register_lion()
    return [_ref_worker(rank, world, argv + LION + extra) for extra in ([], DISTRIB)]


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    argv = flags(data_prefix)
    save_dir = str(tmp_path_factory.mktemp("kinds"))
    (one,) = run_distributed(_one_process_worker, 1, argv, save_dir)
    return one, run_distributed(_dp2_worker, 2, argv)


@pytest.mark.slow
def test_lion_from_one_registration_trains_plain_and_distributed_at_dp2_as_one_process(runs):
    (history, weights), dp2 = runs[0]["lion"], runs[1]
    assert history[-1]["lm_loss"] < history[0]["lm_loss"]  # it trains
    for rank, pair in enumerate(dp2):
        for what, (h, w) in zip(("plain", "distributed"), pair, strict=True):
            np.testing.assert_allclose(_losses(h), _losses(history), rtol=2e-5, err_msg=what)
            for name, value in weights.items():
                np.testing.assert_allclose(
                    w[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{what} rank {rank} {name}"
                )


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("adam", "sgd"), ("adam", "muon"), ("muon", "adam")])
def test_fsdp2_refuses_a_checkpoint_of_another_optimizer_by_name(runs, saved, resumed):
    message = runs[0][saved, resumed]
    assert "saved by another --optimizer" in message, message
    assert f"--optimizer {resumed}" in message and "--no-load-optim" in message
