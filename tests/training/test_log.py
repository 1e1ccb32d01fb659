"""What a training run says once (megatron/training/log.py): at start, and why an fp16 run's
first steps were skipped."""

import io

import pytest

from megatron.config.cli import parse_args
from megatron.model.families import get_spec
from megatron.models.gpt.model import GPTModel
from megatron.training.log import loss_scale_warmup_line, start_lines
from megatron.training.loop import pretrain
from tests.helpers.distributed import run_distributed
from tests.helpers.training import counting_corpus, flags


def test_start_lines_give_the_parameter_count_and_say_there_is_no_save():
    cfg = parse_args(flags("data/x"), world_size=1)
    n = sum(p.numel() for p in GPTModel(cfg.model).parameters())
    lines = start_lines(cfg, get_spec("gpt"))
    assert lines[0] == f" number of parameters: {n / 1e6:.2f}M ({n:,}, the whole model)"
    assert lines[1].startswith("note: no --save: this run writes no checkpoint")
    saving = parse_args(flags("data/x", "--save", "ck"), world_size=1)
    assert len(start_lines(saving, get_spec("gpt"))) == 1


def _rows(*steps):
    """History rows of (updated, loss, scale after the step) from iteration 1."""
    return [
        {"iteration": i, "updated": u, "lm_loss": loss, "loss_scale": scale}
        for i, (u, loss, scale) in enumerate(steps, start=1)
    ]


def test_the_loss_scale_warm_up_is_said_for_the_first_skipped_steps_only():
    warm_up = _rows((False, 7.0, 2.0**32), (False, 7.0, 2.0**31), (True, 7.0, 2.0**31))
    line = loss_scale_warmup_line(warm_up, 2, 2.0**32)
    assert line.startswith(" iterations 1-2 were skipped for fp16 loss scaling: ")
    assert "--initial-loss-scale 4294967296 (2^32)" in line and "now 2147483648 (2^31)" in line
    assert "--hysteresis 2" in line and "--initial-loss-scale 65536" in line
    assert (
        loss_scale_warmup_line(_rows((True, 7.0, 1024.0), (False, 7.0, 512.0)), 2, 1024.0) is None
    )
    nan = float("nan")  # a non-finite loss is not the scaler's search
    assert loss_scale_warmup_line(_rows((False, nan, 2.0**32)), 2, 2.0**32) is None


def _fp16_run(rank, world, argv):
    cfg = parse_args(argv, world_size=world)
    out = io.StringIO()
    result = pretrain(cfg, out=out)
    return [row["updated"] for row in result.history], out.getvalue()


@pytest.mark.slow  # a 1-rank run: seconds
def test_a_short_fp16_run_says_why_its_steps_were_skipped(tmp_path):
    """Six steps at the default scale 2^32 all overflow; the run said nothing about it (its
    log line every 10 iterations never came)."""
    argv = flags(counting_corpus(tmp_path), "--fp16", "--log-interval", "10", "--eval-iters", "0")
    ((updated, out),) = run_distributed(_fp16_run, 1, argv)
    assert updated == [False] * 6
    said = [line for line in out.splitlines() if "skipped for fp16 loss scaling" in line]
    assert said == [said[0]] and said[0].startswith(" iterations 1-6 were skipped")


def test_the_start_lines_say_which_pipeline_schedule_runs_and_which_pairs_overlap():
    def schedule_line(*extra, world=2):
        cfg = parse_args(flags("data/x", "--save", "ck", *extra), world_size=world)
        found = [x for x in start_lines(cfg, get_spec("gpt")) if x.startswith("pipeline")]
        return found[0] if found else None

    assert schedule_line(world=1) is None  # no pipeline, no schedule
    pp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    assert schedule_line(*pp) == "pipeline schedule: 1f1b (2 stages x 1 chunk, 4 micro batches)"
    assert schedule_line(*pp, "--pipeline-schedule", "zbv") == (
        "pipeline schedule: zbv (2 stages x 2 chunks in a V, 4 micro batches, backward split "
        "into B and W)"
    )
    dualpipev = [*pp, "--pipeline-schedule", "dualpipev", "--global-batch-size", "16"]
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    assert "its forward/backward pairs run in turn" in schedule_line(*dualpipev)
    overlapped = schedule_line(*dualpipev, *moe, "--moe-token-dispatcher-type", "alltoall", world=4)
    # 4 micro batches per DP rank (16 / (2 x 2)): 3 pairs on stage 0, 4 - 1 on the last
    assert overlapped.endswith(
        "overlapped forward/backward pairs per stage: [3, 3] (the last stage's first pair runs "
        "alone)"
    )
