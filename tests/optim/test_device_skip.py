"""No host sync on steps that do not log: the optimizer decides an inf/NaN skip on the device
(fused AdamW's found_inf), the loop reads it at log lines, saves and every
--max-skipped-in-a-row steps, takes back the LR schedule of the skipped steps, and timers
synchronize only when --timing-log-level asks for device times."""

import math

import pytest
import torch
from torch import nn

from megatron import mpu
from megatron.config.schema_optimizer import OptimizerConfig
from megatron.optim.plain import plain_optimizer
from megatron.training.timers import Timers
from megatron.training.train_loop import TrainingError
from tests.helpers.distributed import run_distributed
from tests.helpers.training import _train, flags


def _optimizer(dtype=torch.bfloat16, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(dtype)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    opt = plain_optimizer(
        model,
        OptimizerConfig(lr=1e-2, **cfg),
        params_dtype=dtype,
        state=mpu.single_process_state(),
        clip_grad=1.0,
    )
    return model, opt


def _grads(model, value):
    for p in model.parameters():
        p.main_grad.fill_(value)


def _snapshot(model, opt):
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return weights, masters


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_fused_adamw_skips_on_the_device_and_reports_device_values():
    model, opt = _optimizer()
    assert opt.skip_on_device
    cases = {
        "inf gradient": (math.inf, None),
        "inf loss, finite gradients": (0.1, torch.tensor(math.inf)),
        "finite gradients whose squares overflow": (1e30, None),
    }
    for name, (grad, loss) in cases.items():
        before = _snapshot(model, opt)
        _grads(model, grad)
        updated, norm = opt.step(loss=loss)
        assert isinstance(updated, torch.Tensor) and isinstance(norm, torch.Tensor), name
        assert not updated.item(), name
        # NaN stands for "no norm" (the gradients or loss were inf/NaN); an overflowed norm
        # of finite gradients is reported as it is
        assert (norm.item() == math.inf) if grad == 1e30 else math.isnan(norm.item()), name
        assert _same(_snapshot(model, opt)[0], before[0]), f"{name}: weights moved"
        assert _same(_snapshot(model, opt)[1], before[1]), f"{name}: masters moved"
        steps = [s["step"].item() for s in opt.optimizer.state.values()]
        assert steps == [0.0] * len(steps), f"{name}: Adam counted a skipped step"
    before = _snapshot(model, opt)
    _grads(model, 0.1)
    updated, norm = opt.step()
    assert updated.item() and norm.item() == pytest.approx(math.sqrt(30 * 0.01), rel=1e-5)
    assert not _same(_snapshot(model, opt)[0], before[0]), "a clean step must update"
    assert all(s["step"].item() == 1.0 for s in opt.optimizer.state.values())


def test_the_host_decides_where_the_update_cannot_take_a_device_flag():
    assert not _optimizer(torch.float16)[1].skip_on_device, "a dynamic loss scale needs it"
    assert _optimizer(torch.float16, loss_scale=128.0)[1].skip_on_device, "a static one not"
    assert _optimizer(torch.float32)[1].skip_on_device
    sgd = _optimizer(torch.float32, optimizer="sgd")[1]
    assert not sgd.skip_on_device  # fused SGD leaves a skipped first step's momentum garbage


def test_timers_synchronize_only_when_a_timing_level_asks_for_device_times():
    cuda = torch.device("cuda")  # never used: only whether a timer would synchronize
    assert not Timers(0, cuda)("iteration").sync
    assert Timers(1, cuda)("iteration").sync and Timers(1, cuda)("optimizer", 1).sync
    assert not Timers(1, "cpu")("iteration").sync


_CALLS = {"n": 0}


def _poison(bad_iterations, data_iterator, model):
    """Micro batches of the given iterations (4 micro batches each) return a NaN loss."""
    from megatron.models.gpt.train import forward_step

    output, loss_func = forward_step(data_iterator, model)
    _CALLS["n"] += 1
    if (_CALLS["n"] - 1) // 4 + 1 not in bad_iterations:
        return output, loss_func

    def poisoned(out):
        loss = loss_func(out)[0] * math.nan
        return loss, {"lm loss": loss.detach()}

    return output, poisoned


def _runs(rank, world, argv, save_dir):
    """Iteration 2 poisoned: read every step; read every 4 steps with a save at 3, and the same
    as 3 steps + save + resume + 3; every step poisoned with --max-skipped-in-a-row 3 and reads
    every 100 steps; steps 2-6 poisoned, and step 6 alone."""
    import functools

    out = {}
    half = [a if a != "6" else "3" for a in argv]  # --train-iters 3
    for name, run_argv in {
        "log every step": argv + ["--log-interval", "1"],
        "log every 4": argv + ["--log-interval", "4", "--save", f"{save_dir}/a"],
        "first 3": half + ["--log-interval", "4", "--save", f"{save_dir}/b"],
    }.items():
        _CALLS["n"] = 0
        extra = ["--save-interval", "3"] if name == "log every 4" else []
        out[name] = _train(rank, world, run_argv + extra, functools.partial(_poison, {2}))[0]
    resume = ["--log-interval", "4", "--load", f"{save_dir}/b", "--save", f"{save_dir}/b"]
    out["resumed at 3"] = _train(rank, world, argv + resume)[0]
    _CALLS["n"] = 0
    try:
        bad = ["--log-interval", "100", "--max-skipped-in-a-row", "3"]
        _train(rank, world, argv + bad, functools.partial(_poison, set(range(1, 7))))
    except TrainingError as e:
        out["diverging"] = str(e)
    for name, poisoned in {"ends on NaN": set(range(2, 7)), "last step NaN": {6}}.items():
        _CALLS["n"] = 0  # far fewer skips than --max-skipped-in-a-row's 50
        try:
            out[name] = _train(rank, world, argv, functools.partial(_poison, poisoned))[0]
        except TrainingError as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer", "--bf16"]])
def test_skips_read_at_log_lines_and_saves_resume_exactly(data_prefix, tmp_path, extra):
    argv = flags(data_prefix, *extra)
    (out,) = run_distributed(_runs, 1, argv, str(tmp_path))
    every, lazy, resumed = out["log every step"], out["log every 4"], out["resumed at 3"]
    for run in (every, lazy):
        assert [h["updated"] for h in run] == [True, False, True, True, True, True]
        assert math.isnan(run[1]["lm_loss"]) and run[1]["grad_norm"] is None
    # Read at once, the skip never advances the schedule. Read later, the step after it runs
    # one schedule step ahead, and the save at 3 takes it back: from there on equal.
    assert every[1]["lr"] == every[0]["lr"] and lazy[1]["lr"] > lazy[0]["lr"]
    assert [h["lr"] for h in lazy[2:]] == [h["lr"] for h in every[2:]]
    assert [h["lm_loss"] for h in resumed] == [h["lm_loss"] for h in lazy[3:]]
    assert [h["lr"] for h in resumed] == [h["lr"] for h in lazy[3:]]
    assert "3 iterations in a row were skipped" in out["diverging"]
    assert "up to iteration 3" in out["diverging"]
    # A run that ends with its weights no longer training ends non-zero; one NaN batch at the
    # end does not
    assert "ends with its last 5 iterations skipped on a non-finite" in out["ends on NaN"]
    assert [h["updated"] for h in out["last step NaN"]] == [True] * 5 + [False]
