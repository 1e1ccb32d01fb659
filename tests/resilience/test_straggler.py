"""--log-straggler (Megatron-LM's flags): a rank slowed inside its forward is named in the log
at the first log line, with its host and its factor over the median; TensorBoard gets the
spread; a request on --straggler-ctrlr-port toggles the detector on every rank at the same log
line (off with 4 ranks; on from --disable-straggler-on-startup in one process). Assertions are
on the rank named, never on times."""

import io
import re
import socket
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.models.gpt.train import forward_step
from megatron.resilience.straggler import StragglerDetector
from megatron.resilience.straggler_report import RankTimes, report_lines
from megatron.training.loop import pretrain
from megatron.training.timers import Timers
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.training import counting_corpus, flags

SLOW_RANK, SLEEP_S = 2, 0.5  # the sleep dwarfs a step of this model (a few ms) and its noise


def _slowed_forward(data_iterator, model):
    import torch.distributed as dist

    if dist.get_rank() == SLOW_RANK:
        time.sleep(SLEEP_S)
    return forward_step(data_iterator, model)


def _switched_off_in_iteration_3(port):
    calls = {"n": 0}

    def hook(data_iterator, model):
        import torch.distributed as dist

        calls["n"] += 1  # DP = 4, global batch 8, micro batch 2: one forward per step
        if dist.get_rank() == 0 and calls["n"] == 3:
            assert _poke(port) == "straggler detector turns off at the next log line\n"
        return _slowed_forward(data_iterator, model)

    return hook


def _poke(port: int) -> str:
    """What `curl localhost:PORT` does: one request, the reply's body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.makefile("rb").read().decode().split("\r\n\r\n", 1)[1]


def _run(argv, world, hook) -> str:
    cfg = validate(parse_args(argv, world_size=world), "train-gpt")
    out = io.StringIO()
    pretrain(cfg, forward_step_func=hook, out=out)
    return out.getvalue()


def _worker(rank, world, argv, port):
    return _run(argv, world, _switched_off_in_iteration_3(port)), socket.gethostname()


def _named(log: str, label: str) -> dict[int, list[int]]:
    """iteration -> the ranks the report at that iteration lists under `label` (in order)."""
    out: dict[int, list[int]] = {}
    iteration = None
    for line in log.splitlines():
        m = re.match(r" straggler report at iteration (\d+)", line)
        if m:
            iteration = int(m.group(1))
            out[iteration] = []
        m = re.match(rf"   {label} \d+: rank (\d+) ", line)
        if m:
            out[iteration].append(int(m.group(1)))
    return out


def _tensorboard(directory: str, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.mark.slow
def test_a_slowed_rank_is_named_within_the_log_interval_and_the_switch_is_agreed(tmp_path):
    data, port, tb = counting_corpus(tmp_path, 200, strided=False), free_port(), tmp_path / "tb"
    argv = flags(data, iters=6) + ["--log-interval", "2", "--eval-iters", "0", "--log-straggler"]
    argv += ["--straggler-minmax-count", "2", "--straggler-ctrlr-port", str(port)]
    log, host = run_distributed(_worker, 4, argv + ["--tensorboard-dir", str(tb)], port)[3]
    # Rank 2 sleeps in each forward: named first at the first log line (iteration 2) and at 4,
    # never among the fastest; --straggler-minmax-count 2 lists two ranks each way.
    slowest = _named(log, "slowest")
    assert {i: r[0] for i, r in slowest.items()} == {2: SLOW_RANK, 4: SLOW_RANK}, log
    assert all(len(r) == 2 for r in slowest.values()), log
    assert all(SLOW_RANK not in ranks for ranks in _named(log, "fastest").values()), log
    line = next(x for x in log.splitlines() if x.startswith("   slowest 1:"))
    assert f"rank {SLOW_RANK} ({host}, stage 0)" in line and "x the median" in line
    scalars = _tensorboard(str(tb), "straggler-slowest-rank")
    assert {s: int(v) for s, v in scalars.items()} == {2: SLOW_RANK, 4: SLOW_RANK}
    assert sorted(_tensorboard(str(tb), "straggler-max-over-median")) == [2, 4]
    # Rank 0's port was asked during iteration 3: the window 3..4 is still reported, then every
    # rank turns the detector off at that log line (the request rides in the all-gather), and
    # iteration 6 has no report.
    assert " straggler detector turned off at iteration 4 (--straggler-ctrlr-port)" in log


def _rows(*computes, stages=None):
    stages = stages or [0] * len(computes)
    return [
        RankTimes(
            r,
            f"h{r}",
            stages[r],
            {"forward": c, "backward": 0.0, "optimizer": 0.0, "data": 0.0, "comm-wait": 1.0},
        )
        for r, c in enumerate(computes)
    ]


def test_the_report_ranks_against_each_stage_median_and_lists_count_ranks():
    lines, scalars = report_lines(_rows(10, 30, 11, 9), 1, 8, 4)
    assert lines[1].startswith(
        "   slowest 1: rank 1 (h1, stage 0) compute 30.0 ms, 2.86x the median 10.5 ms"
    )
    assert lines[2].startswith("   fastest 1: rank 3 ")
    assert len(lines) == 3
    assert scalars["straggler-slowest-rank"] == 1 and scalars["straggler-compute-ms-max"] == 30
    # Two stages: the last one does more by design; its rank 3 is slow only against its stage.
    lines, _ = report_lines(_rows(10, 10, 40, 80, stages=[0, 0, 1, 1]), 2, 8, 4)
    assert [int(re.search(r"rank (\d+)", x).group(1)) for x in lines[1:]] == [3, 0, 2, 1]
    # the data read inside the forward is reported on its own and counted once
    row = RankTimes(
        0,
        "h",
        0,
        {"forward": 5.0, "backward": 2.0, "optimizer": 1.0, "data": 3.0, "comm-wait": 4.0},
    )
    assert row.sections["forward"] == 2.0 and row.compute == 8.0


def test_timers_feed_the_sections_at_level_0_and_the_port_toggles_the_detector():
    port = free_port()
    lg = SimpleNamespace(
        straggler_minmax_count=1, disable_straggler_on_startup=True, straggler_ctrlr_port=port
    )
    state = SimpleNamespace(rank=0, pp_rank=0)
    det = StragglerDetector(lg, state, torch.device("cpu"), io.StringIO())
    try:
        timers = Timers(0)
        timers.sections = det
        timers("forward-compute", 1).start()
        timers("forward-compute", 1).stop()
        assert det.report(2, 2) == ([], {})  # off: nothing collected, nothing reported
        assert "turns on" in _poke(port)
        lines, _ = det.report(4, 2)
        assert lines == [" straggler detector turned on at iteration 4 (--straggler-ctrlr-port)"]
        timers("forward-compute", 1).start()
        time.sleep(0.05)
        timers("forward-compute", 1).stop()
        assert next(det.data_iterator(iter([1]))) == 1
        lines, scalars = det.report(6, 2)
        assert (
            lines[1].startswith("   slowest 1: rank 0 ")
            and scalars["straggler-compute-ms-max"] >= 25
        )
    finally:
        det.close()


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--straggler-minmax-count", "2"], "--straggler-minmax-count"),
        (["--disable-straggler-on-startup"], "--disable-straggler-on-startup"),
        (["--straggler-ctrlr-port", "9999"], "--straggler-ctrlr-port"),
        (["--log-straggler", "--deepspeed"], "--log-straggler"),
    ],
)
def test_straggler_flags_fail_fast(tmp_path, extra, flag):
    argv = flags(str(tmp_path / "d"), iters=2) + extra
    with pytest.raises(ConfigError, match=re.escape(flag)):
        validate(parse_args(argv, world_size=1), "train-gpt")


def test_a_port_that_cannot_be_listened_on_is_an_error_only_when_starting_off():
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        state = SimpleNamespace(rank=0, pp_rank=0)
        lg = SimpleNamespace(
            straggler_minmax_count=1, disable_straggler_on_startup=False, straggler_ctrlr_port=port
        )
        out = io.StringIO()
        StragglerDetector(lg, state, torch.device("cpu"), out).close()
        assert f"warning: --straggler-ctrlr-port {port}: cannot listen" in out.getvalue()
        lg.disable_straggler_on_startup = True
        with pytest.raises(
            ConfigError, match=f"--straggler-ctrlr-port: rank 0 cannot listen on port {port}"
        ):
            StragglerDetector(lg, state, torch.device("cpu"), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_the_event_clock_times_device_work_without_a_sync():
    from megatron.resilience.straggler import _EventClock

    clock = _EventClock()
    a = torch.randn(2048, 2048, device="cuda")
    clock.start()
    for _ in range(20):
        a = a @ a / 2048
    clock.stop()
    assert clock.pairs and clock.take() > 0 and not clock.pairs  # read at take(), pooled
    assert clock.take() == 0.0
