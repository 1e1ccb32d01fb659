"""A checkpoint's windows and softmax (--window-size, --window-attn-skip-freq, --softmax-type)
are kept on resume: another attention span is refused naming both and the fix, --finetune may
change it, and a checkpoint from before these settings resumes a global, vanilla model."""

from __future__ import annotations

import pytest

from megatron.checkpoint.storage import CheckpointError
from megatron.config.cli import parse_args
from megatron.training.checkpoint_args import check_model_args, checkpoint_args
from tests.helpers.training import BASE

RUN = [*BASE, "--train-iters", "2", "--lr", "1e-3", "--global-batch-size", "4"]
WINDOW = ["--window-size", "8,0", "--window-attn-skip-freq", "2"]


@pytest.mark.parametrize(
    "saved, now, message",
    [
        (WINDOW, [], "trained with --window-size 8,0 --window-attn-skip-freq 2 --softmax-type"),
        ([], WINDOW, "trained with no --window-size, --softmax-type vanilla"),
        (WINDOW, ["--window-size", "8,0"], "but this run has --window-size 8,0 --softmax"),
        ([], ["--softmax-type", "off-by-one"], "this run has no --window-size, --softmax-type off"),
    ],
)
def test_another_attention_span_is_refused_on_resume(saved, now, message):
    args = checkpoint_args(parse_args([*RUN, *saved], world_size=1))
    with pytest.raises(CheckpointError, match=message) as err:
        check_model_args({"args": args}, parse_args([*RUN, *now], world_size=1), "ckpt")
    assert "Fix: resume with" in str(err.value) and "--finetune" in str(err.value)
    check_model_args({"args": args}, parse_args([*RUN, *now, "--finetune"], world_size=1), "c")


def test_the_same_span_spelled_otherwise_and_older_checkpoints_resume():
    args = checkpoint_args(parse_args([*RUN, *WINDOW], world_size=1))
    # every other layer of 4, as a list: the same layers windowed
    same = ["--window-size", "8,0", "--window-attn-skip-freq", "[1,0,1,0]"]
    check_model_args({"args": args}, parse_args([*RUN, *same], world_size=1), "ckpt")
    old = checkpoint_args(parse_args(RUN, world_size=1))
    for name in ("window_size", "window_attn_skip_freq", "softmax_type"):
        del old["model"][name]  # as a checkpoint written before these fields existed
    check_model_args({"args": old}, parse_args(RUN, world_size=1), "ckpt")
