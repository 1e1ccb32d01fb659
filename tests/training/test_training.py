"""End-to-end training on gloo: parallel layouts equal one process, skips are global, resume is
bit-exact, SIGTERM saves and exits cleanly."""

import functools
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron.config.cli import parse_args
from megatron.models.gpt.train import forward_step
from megatron.training.train_loop import TrainingError
from tests.helpers.checkpoints import _damage
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.training import (
    _CALLS,
    _losses,
    _poison_third_micro_batch_on_rank1,
    _resume_worker,
    _sigterm_on_rank1_iteration3,
    _train,
    flags,
)


@pytest.mark.slow
def test_tp_dp_layouts_log_the_same_losses_as_one_process(data_prefix):
    # Adam's first steps turn any nonzero gradient into a +-lr update, so a gradient that is
    # 0 up to rounding (summed in another order on another layout) would move a weight by lr;
    # a larger epsilon keeps rounding-sized gradients rounding-sized.
    argv = flags(data_prefix, "--adam-eps", "1e-4")
    ((ref, _, _),) = run_distributed(_train, 1, argv)
    assert _losses(ref)[-1] < _losses(ref)[0], "the toy run must learn"
    for world, extra in (
        (2, ["--tensor-model-parallel-size", "2"]),
        (2, []),
        (4, ["--tensor-model-parallel-size", "2"]),
    ):
        results = run_distributed(_train, world, argv + extra)
        for rank, (history, _, _) in enumerate(results):
            np.testing.assert_allclose(
                _losses(history),
                _losses(ref),
                rtol=2e-5,
                err_msg=f"world {world} {extra} rank {rank}",
            )
            np.testing.assert_allclose(
                [h["grad_norm"] for h in history], [h["grad_norm"] for h in ref], rtol=1e-4
            )


def _poison_rank1(kind: str, every: bool, data_iterator, model):
    """Rank 1's loss at its third micro batch (or at every one), poisoned so that only the loss
    ('add-inf': + inf, the gradients stay finite) or only the gradient norm ('times-1e30': the
    loss and every gradient stay finite, the sum of their squares overflows) is non-finite."""
    output, loss_func = forward_step(data_iterator, model)
    _CALLS["n"] += 1
    if torch.distributed.get_rank() != 1 or not (every or _CALLS["n"] == 3):
        return output, loss_func

    def poisoned(out):
        loss = loss_func(out)[0]
        loss = loss + float("inf") if kind == "add-inf" else loss * 1e30
        return loss, {"lm loss": loss.detach()}

    return output, poisoned


def _skip_worker(rank, world, argv_fp16, argv_fp32, argv_bf16):
    out = []
    for argv in (argv_fp16, argv_fp32):
        _CALLS["n"] = 0
        out.append(_train(rank, world, argv, _poison_third_micro_batch_on_rank1)[0])
    # fp32 and bf16 (RELIABILITY promise 5 is for every precision): a non-finite loss or grad
    # norm with finite gradients.
    for argv in (argv_fp32, argv_bf16):
        for kind in ("add-inf", "times-1e30"):
            _CALLS["n"] = 0
            out.append(_train(rank, world, argv, functools.partial(_poison_rank1, kind, False))[0])
    # Every step poisoned: --max-skipped-in-a-row stops the run.
    _CALLS["n"] = 0
    try:
        _train(
            rank,
            world,
            argv_bf16 + ["--max-skipped-in-a-row", "2"],
            functools.partial(_poison_rank1, "add-inf", True),
        )
    except TrainingError as e:
        out.append(str(e))
    return out


@pytest.mark.slow
def test_overflow_and_nan_on_one_rank_skip_the_step_everywhere(data_prefix):
    # DP=2, 2 micro batches per rank per step: rank 1's 3rd micro batch is in iteration 2.
    fp16 = flags(
        data_prefix,
        "--fp16",
        "--hysteresis",
        "1",
        "--initial-loss-scale",
        "1024",
        "--loss-scale-window",
        "100",
        iters=4,
    )
    fp32 = flags(data_prefix, iters=4)
    bf16 = flags(data_prefix, "--bf16", iters=4)
    for rank, (h16, h32, *others, stopped) in enumerate(
        run_distributed(_skip_worker, 2, fp16, fp32, bf16)
    ):
        assert [h["updated"] for h in h16] == [True, False, True, True], f"rank {rank}"
        assert [h["loss_scale"] for h in h16] == [1024.0, 512.0, 512.0, 512.0]
        assert [h["updated"] for h in h32] == [True, False, True, True], f"rank {rank}"
        assert math.isnan(h32[1]["lm_loss"]) and h32[1]["grad_norm"] is None
        # The skipped step changed nothing: the lr schedule did not advance either.
        assert h32[1]["lr"] == h32[0]["lr"] < h32[2]["lr"]
        names = ("fp32 inf", "fp32 1e30", "bf16 inf", "bf16 1e30")
        for name, h in zip(names, others, strict=True):
            assert [x["updated"] for x in h] == [True, False, True, True], f"{name} rank {rank}"
            assert h[1]["lr"] == h[0]["lr"] < h[2]["lr"], name
            assert [x["loss_scale"] for x in h] == [1.0] * 4, name
            if name.endswith("inf"):
                assert h[1]["lm_loss"] == math.inf and h[1]["grad_norm"] is None, name
            else:  # a finite loss; the norm overflowed, and is reported
                assert math.isfinite(h[1]["lm_loss"]) and h[1]["grad_norm"] == math.inf, name
        # Skipped, not applied with a clipped or zero gradient: the step after it starts from
        # the same weights as the NaN-gradient skip (fp32) and as each other (bf16).
        assert others[0][2]["lm_loss"] == others[1][2]["lm_loss"] == h32[2]["lm_loss"]
        assert others[2][2]["lm_loss"] == others[3][2]["lm_loss"]
        assert "2 iterations in a row were skipped" in stopped, stopped
        assert "up to iteration 2" in stopped and "--max-skipped-in-a-row" in stopped


def test_too_many_skipped_steps_exit_non_zero_with_the_message(monkeypatch, capsys):
    import pretrain_gpt2

    def diverging(cfg, **kwargs):
        raise TrainingError("50 iterations in a row were skipped (inf/NaN gradients or loss)")

    monkeypatch.setattr(pretrain_gpt2, "pretrain", diverging)
    assert pretrain_gpt2.main(flags("unused")) == 1
    assert "error: 50 iterations in a row were skipped" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [(1, []), (4, ["--tensor-model-parallel-size", "2"])])
def test_resume_gives_bit_identical_losses(data_prefix, tmp_path, world, extra):
    """Promises 3 and 15: exact resume, with dropout off and on (1 rank, TP2 x DP2)."""
    argv = flags(data_prefix, *extra)
    for runs in run_distributed(_resume_worker, world, argv, str(tmp_path)):
        for kind, (straight, first, second, final_iter) in runs.items():
            assert final_iter == 6 and len(first) == 3 and len(second) == 3
            assert _losses(first) == _losses(straight)[:3], kind
            assert _losses(second) == _losses(straight)[3:], f"{kind}: resume must be bit-exact"
            assert [h["lr"] for h in second] == [h["lr"] for h in straight[3:]]
        off, on = runs["no dropout"][0], runs["dropout"][0]
        assert _losses(off) != _losses(on), "dropout 0.1 must change the losses"
    for kind in ("no_dropout", "dropout"):
        latest = tmp_path / kind / "b" / "latest_checkpointed_iteration.txt"
        assert latest.read_text().strip() == "6"


def _damaged_resume_worker(rank, world, argv, save_dir):
    """4 iterations saving at 2 and 4; then, per kind of damage to iteration 4's shard, a copy
    of the checkpoints resumed to iteration 6 (with the warnings it gave); then a copy whose
    saves never committed (no pointer, no markers) trained to 6."""
    import shutil
    import warnings

    from megatron.checkpoint.storage import shard_path

    first = _train(rank, world, [a if a != "6" else "4" for a in argv] + ["--save", save_dir])
    resumed = {}
    for where in ("tensor data", "pickle header"):
        copy = f"{save_dir}-{where.replace(' ', '-')}"
        shutil.copytree(save_dir, copy)
        _damage(shard_path(copy, 4, 0, 0, 1), where)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = _train(rank, world, argv + ["--load", copy, "--save", copy])[0]
        resumed[where] = (history, [str(w.message) for w in caught], shard_path(copy, 4, 0, 0, 1))
    # A first save killed before its commit: no pointer and no marker, only shard files.
    crashed = f"{save_dir}-never-committed"
    shutil.copytree(save_dir, crashed)
    os.remove(f"{crashed}/latest_checkpointed_iteration.txt")
    for it in (2, 4):
        os.remove(f"{crashed}/iter_{it:07d}/complete")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _train(rank, world, argv + ["--load", crashed, "--save", crashed])[0]
    return first[0], resumed, (history, [str(w.message) for w in caught])


def test_resume_survives_damaged_and_never_committed_checkpoints(data_prefix, tmp_path):
    argv = flags(data_prefix, "--save-interval", "2")
    ((first, resumed, fresh),) = run_distributed(
        _damaged_resume_worker, 1, argv, str(tmp_path / "ck")
    )
    assert len(first) == 4
    for where, (history, messages, damaged_file) in resumed.items():
        assert [h["iteration"] for h in history] == [3, 4, 5, 6], where
        # Resumed from iteration 2's intact state: the same losses as the first run, bit for bit.
        assert _losses(history)[:2] == _losses(first)[2:4], where
        assert any(f"{damaged_file} is damaged" in m for m in messages), (where, messages)
    # Only never-committed saves: a fresh start (the first run's losses again), with a warning
    # naming them, instead of exiting 1 on every restart.
    history, messages = fresh
    assert _losses(history)[:4] == _losses(first) and len(history) == 6
    assert any(
        "only incomplete checkpoints ['iter_0000002', 'iter_0000004']" in m for m in messages
    )


def _sigterm_worker(rank, world, argv):
    _CALLS["n"] = 0
    return _train(rank, world, argv, _sigterm_on_rank1_iteration3)


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_everywhere_and_exits_cleanly(data_prefix, tmp_path):
    argv = flags(data_prefix, "--exit-signal-handler", "--save", str(tmp_path), iters=10)
    for history, reason, iteration in run_distributed(_sigterm_worker, 2, argv):
        assert reason == "signal" and iteration == 3 and len(history) == 3
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def _refused_in_process(argv, capsys) -> tuple[int, str]:
    """pretrain_gpt2.main(argv), which `python pretrain_gpt2.py` exits with, run here: (its
    status, its stderr) for a command line refused before any distributed or data work (a
    process of its own would only add its imports); no process group is left behind."""
    import pretrain_gpt2

    capsys.readouterr()
    status = pretrain_gpt2.main(argv)
    assert not torch.distributed.is_initialized(), "a refused run left a process group"
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_command_line_run_logs_like_megatron_and_bad_flags_fail(data_prefix, tmp_path, capsys):
    extra = [
        "--exit-interval",
        "2",
        "--save",
        str(tmp_path / "ck"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--timing-log-level",
        "2",
    ]
    cmd = [sys.executable, str(ROOT / "pretrain_gpt2.py"), *flags(data_prefix, *extra, iters=3)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert " iteration        2/       3 | consumed samples:           16 |" in out.stdout
    for field in (
        "elapsed time per iteration (ms):",
        "learning rate:",
        "lm loss:",
        "loss scale: 1.0",
        "grad norm:",
        "number of skipped iterations:   0",
        "number of nan iterations:   0",
        "tokens per second:",
        "TFLOP/s per device:",
        "(ms per iteration) backward-compute:",
        "grads-all-reduce:",
    ):
        assert field in out.stdout
    assert " iteration        3/" not in out.stdout, "--exit-interval 2 stops after iteration 2"
    assert "no --save" not in out.stdout and out.stdout.count("number of parameters") == 1
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    # The resolved config beside the checkpoints re-loads to the same config, and is in TB.
    run_config = tmp_path / "ck" / "run_config.yaml"
    again = parse_args(["-c", str(run_config)], world_size=1)
    assert again == parse_args(flags(data_prefix, *extra, iters=3), world_size=1)
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").iterdir())
    assert b"run-config" in events and b"hidden_size: 32" in events
    no_lr = flags(data_prefix)
    del no_lr[no_lr.index("--lr") : no_lr.index("--lr") + 2]
    status, err = _refused_in_process(no_lr, capsys)
    assert status == 1 and "error: --lr: a positive peak learning rate" in err


def test_batch_size_ramp_up():
    from megatron.training.microbatches import MicroBatchCalculator

    calc = MicroBatchCalculator(32, 2, 2, rampup=(8, 8, 300))  # 8 -> 32 in 3 steps of 100
    assert [calc.global_batch_at(c) for c in (0, 99, 100, 200, 299, 300, 10**6)] == [
        8,
        8,
        16,
        24,
        24,
        32,
        32,
    ]
    assert calc.num_micro_batches(0) == 2 and calc.num_micro_batches(400) == 8


def test_both_backends_implement_the_one_contract():
    """The loop talks to either backend through TrainerBackend only; a backend missing one of
    its methods could not even be instantiated."""
    from megatron.training.backend import TrainerBackend
    from megatron.training.deepspeed.backend import DeepSpeedBackend
    from megatron.training.step import NativeBackend

    for backend in (NativeBackend, DeepSpeedBackend):
        assert issubclass(backend, TrainerBackend), backend
        assert not backend.__abstractmethods__, (backend, backend.__abstractmethods__)
    assert TrainerBackend.__abstractmethods__ == {
        "loss_scale",
        "train_step",
        "evaluate",
        "save",
        "load",
    }


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(data_prefix, tmp_path):
    """Promise 7/13: rank 1 is SIGSTOPped mid-run; rank 0 exits non-zero within
    --distributed-timeout-minutes (0.1 = 6 s) plus a bounded margin, naming rank 1."""
    argv = flags(data_prefix, "--distributed-timeout-minutes", "0.1", "--log-interval", "1")
    argv[argv.index("--train-iters") + 1] = "100000"
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    base.update(WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "pretrain_gpt2.py"), *argv],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for r in range(2)
    ]
    try:
        # rank 1 logs (the last rank); stop it once training is under way
        for line in procs[1].stdout:
            if " iteration        3/" in line:
                break
        else:
            pytest.fail(f"rank 1 never reached iteration 3: {procs[1].stderr.read()}")
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        elapsed = time.monotonic() - stopped_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
            p.wait(timeout=30)
    print(f"rank 0 exited {elapsed:.1f} s after rank 1 was stopped (timeout 6 s)")
    assert procs[0].returncode != 0
    assert "rank 1 stopped answering" in err, err[-3000:]
    assert "rank 0 gave up waiting" in err and "--distributed-timeout-minutes 0.1" in err
    assert elapsed < 6 + 20, f"took {elapsed:.1f} s, more than the 6 s timeout + 20 s margin"


@pytest.mark.slow
def test_empty_validation_split_warns_and_a_bad_save_dir_is_one_named_line(
    data_prefix, tmp_path, capsys, monkeypatch
):
    """Default --num-workers. `--split 100,0,0 --eval-iters 2` used to train without ever
    validating, silently (as Megatron-LM does); --save naming a file failed with a traceback
    (FileExistsError) after the model and data were built."""
    argv = flags(data_prefix, iters=2)
    del argv[argv.index("--num-workers") : argv.index("--num-workers") + 2]
    argv[argv.index("--split") + 1] = "100,0,0"
    argv[argv.index("--eval-iters") + 1] = "2"
    cmd = [sys.executable, str(ROOT / "pretrain_gpt2.py"), *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    warning = (
        "warning: validation is off: --split 100,0,0 leaves the validation split no documents, "
        "so --eval-iters 2 has nothing to read"
    )
    assert run.stdout.count(warning) == 1, run.stdout
    assert run.stdout.count("note: no --save: this run writes no checkpoint") == 1, run.stdout
    assert run.stdout.count(" number of parameters: ") == 1, run.stdout
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    for save, problem in (("a-file", "is an existing file"), ("a-file/ck", "cannot write there")):
        status, err = _refused_in_process([*argv, "--save", save], capsys)
        assert status == 1 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1].startswith(f"error: --save {save}: {problem}")


def test_a_save_dir_that_cannot_be_written_is_a_named_error(tmp_path, monkeypatch):
    """A read-only --save directory: a named error at start, not a traceback at the first save
    (root writes through chmod, so there the refusal of the write is simulated)."""
    from megatron import fileio
    from megatron.checkpoint.storage import CheckpointError
    from megatron.resilience import preflight

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:

        def refuse(*args, dir, **kwargs):
            raise PermissionError(13, "Permission denied", os.path.join(dir, ".write-test-x"))

        monkeypatch.setattr(fileio.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(CheckpointError, match=f"--save {ro}: cannot write there .Permission"):
        preflight.check_save_dir(str(ro))
    monkeypatch.undo()
    preflight.check_save_dir(str(tmp_path / "new" / "dir"))  # created, writable: no error
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())


def test_a_final_evaluation_longer_than_the_training_is_announced(data_prefix):
    """A 2-step check with --eval-iters 9 evaluates 9 batches at the end (3 steps' time):
    said before training starts; Megatron's defaults themselves are kept."""
    import io

    from megatron.training.loop import pretrain

    def run(eval_iters):
        argv = flags(data_prefix, iters=2)
        argv[argv.index("--eval-iters") + 1] = str(eval_iters)
        out = io.StringIO()
        try:
            pretrain(parse_args(argv, world_size=1, purpose="train-gpt"), out=out)
        finally:  # a run in the test's own process: leave no process group to the next test
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        return out.getvalue()

    text = run(9)
    note = " note: the final evaluation runs 9 batches of the validation split (--eval-iters)"
    assert text.count(note) == 1 and text.index(note) < text.index(" iteration        1/"), text
    assert "about the time of 3 training steps, more than the 2 left to train" in text
    assert "final evaluation" not in run(1)
