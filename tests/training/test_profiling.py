"""--profile: a Chrome trace per profiled rank holding only the window's iterations, with the
named ranges of every micro batch (forward, backward, pipeline send/recv, grad reduce,
optimizer); the flags' rules."""

import json
import os
from collections import Counter

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.training.timers import Timers
from tests.helpers.distributed import run_distributed
from tests.helpers.training import counting_corpus, flags, train_quietly


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """200 documents counting by 1."""
    return counting_corpus(tmp_path_factory.mktemp("data"), documents=200, strided=False)


def _range_counts(path) -> Counter:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return Counter(e["name"] for e in events if e.get("ph") == "X")


@pytest.mark.slow
def test_trace_per_rank_holds_the_window_and_the_named_ranges(data_prefix, tmp_path):
    # PP = 2, 4 micro batches per step; the window records iterations 3 and 4 of 5.
    argv = flags(data_prefix, iters=5) + [
        "--pipeline-model-parallel-size", "2",
        "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
        "--profile-ranks", "0", "1", "--profile-dir", str(tmp_path / "prof"),
    ]  # fmt: skip
    run_distributed(train_quietly, 2, argv)
    assert sorted(os.listdir(tmp_path / "prof")) == [
        "rank0.3.pt.trace.json",
        "rank1.3.pt.trace.json",
    ]
    steps, micro = 2, 4
    for rank in (0, 1):
        counts = _range_counts(tmp_path / "prof" / f"rank{rank}.3.pt.trace.json")
        assert counts["iteration"] == steps, counts  # only the window's steps
        assert counts["forward-compute"] == steps * micro
        assert counts["backward-compute"] == steps * micro
        assert counts["pipeline-send"] == steps * micro  # activations forward, grads back
        assert counts["pipeline-wait"] == steps * micro  # the matching receives
        assert counts["grads-all-reduce"] == steps
        assert counts["optimizer"] == steps
        assert counts["aten::mm"] > 0  # the torch profiler's own op events are there too


def test_ranges_follow_the_timers_only_while_the_window_is_open():
    pushed = []

    class Recorder:
        def push(self, name):
            pushed.append(("push", name))

        def pop(self, name):
            pushed.append(("pop", name))

    timers = Timers(log_level=0)
    timers("forward-compute", 1).start()  # level above log level: a no-op, and no range
    timers("forward-compute", 1).stop()
    timers.ranges = Recorder()
    timers("forward-compute", 1).start()  # any level becomes a range in the window
    timers("forward-compute", 1).stop()
    timers.ranges = None
    timers("optimizer", 1).start()
    timers("optimizer", 1).stop()
    assert pushed == [("push", "forward-compute"), ("pop", "forward-compute")]
    assert "forward-compute" not in timers.pop_elapsed()  # timing levels are unchanged


@pytest.mark.parametrize(
    "extra,world,flag",
    [
        (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], 1,
         "--profile-step-start"),
        (["--profile", "--profile-ranks", "2"], 2, "--profile-ranks"),
        (["--profile-ranks", "1"], 2, "--profile-ranks"),
        (["--profile-dir", "x"], 1, "--profile-dir"),
        (["--wandb-exp-name", "x"], 1, "--wandb-exp-name"),
        (["--wandb-save-dir", "x"], 1, "--wandb-save-dir"),
    ],
)  # fmt: skip
def test_profiling_and_wandb_flags_fail_fast(extra, world, flag):
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    argv = (argv + "--vocab-size 128 --train-iters 5 --lr 1e-3").split()
    cfg = parse_args(argv + extra, world_size=world)
    with pytest.raises(ConfigError, match=flag):
        validate(cfg, "train-gpt")
