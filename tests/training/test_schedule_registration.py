"""A pipeline schedule registered from this file alone, with no other file changed: GPipe, 1F1B
with a warm-up of every micro batch (all forwards, then all backwards). It is a
--pipeline-schedule choice, the rules and the simulator take it, and it trains PP 2 like one
process (losses, gradient norms, final weights)."""

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.schedules.base import PipelineSchedule
from megatron.schedules.registry import SCHEDULES, registered
from megatron.schedules.sim import simulate, textbook_bubble
from tests.helpers.distributed import run_distributed
from tests.helpers.training import BASE, _pp_worker, _ref_worker, assert_same_run, flags


def _gpipe_actions(P: int, s: int, M: int, V: int) -> list[tuple[str, int, int]]:
    return [("F", 0, mb) for mb in range(M)] + [("B", 0, mb) for mb in range(M)]


GPIPE = PipelineSchedule(
    name="gpipe",
    build=_gpipe_actions,
    help="every forward, then every backward",
    textbook_idle=lambda P, M, V, costs: (P - 1) * (costs.f + costs.b + costs.w),
)
_ARGV = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"]


def test_a_registered_schedule_is_a_choice_the_rules_and_the_simulator_take():
    argv = [*BASE, "--lr", "1e-3", "--train-iters", "10", "--global-batch-size", "8", *_ARGV]
    with registered(GPIPE):
        cfg = validate(parse_args(argv, world_size=2), "train-gpt")
        assert cfg.parallel.schedule is GPIPE and cfg.parallel.virtual_pipeline_size(4) is None
        for P in (2, 3, 4):
            for M in (1, P, 2 * P + 1):
                run = simulate("gpipe", P, M)  # every action once, no deadlock
                assert max(run.peak) == M  # GPipe holds every micro batch on stage 0
                assert run.bubble[0] == pytest.approx(textbook_bubble("gpipe", P, M))
        with pytest.raises(ConfigError, match="one model chunk"):
            validate(parse_args([*argv, "--num-layers-per-virtual-pipeline-stage", "1"], 2))
    assert "gpipe" not in SCHEDULES and "gpipe" not in list(SCHEDULES)
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'gpipe'"
        parse_args(argv, world_size=2)


def _gpipe_worker(rank, world, argv, ref_weights):
    with registered(GPIPE):  # in this rank's process only
        return _pp_worker(rank, world, argv, ref_weights)["history"]


@pytest.mark.slow
def test_a_registered_schedule_trains_pp2_like_one_process(data_prefix):
    argv = flags(data_prefix, "--num-layers", "4", "--adam-eps", "1e-4", iters=3)
    ((ref_history, ref_weights),) = run_distributed(_ref_worker, 1, argv)
    histories = run_distributed(_gpipe_worker, 2, [*argv, *_ARGV], ref_weights)
    for rank, history in enumerate(histories):  # the final weights: held by _pp_worker
        assert_same_run(history, ref_history, f"gpipe rank {rank}")
