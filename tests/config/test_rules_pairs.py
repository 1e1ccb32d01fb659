"""The table of pairwise refusals (megatron/config/rules_pairs.py): each pair once, every
feature it names has its test of being on, and a row's message is the one validation raises."""

import re

import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules_pairs import GIVEN, PAIRS
from tests.helpers.training import BASE


def test_each_pair_once_and_every_feature_known():
    pairs = [frozenset((row.a, row.b)) for row in PAIRS]
    assert len(pairs) == len(set(pairs)), "a pair of features is refused twice"
    named = {row.a for row in PAIRS} | {row.b for row in PAIRS}
    assert named <= set(GIVEN), f"features without a test of being on: {named - set(GIVEN)}"
    for row in PAIRS:
        assert row.a != row.b and row.why and row.fix


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (
            ["--use-torch-fsdp2", "--torch-compile"],
            2,
            "--use-torch-fsdp2: given with --torch-compile: each chunk is compiled as one module",
        ),
        (
            ["--fault-tolerance", "--allreduce-dtype", "params"],
            1,  # a replica group is one model copy
            "--allreduce-dtype params: cannot run with --fault-tolerance: the cross-replica "
            "all-reduce runs in fp32. Fix: use --allreduce-dtype fp32.",
        ),
        (
            ["--sdpa-backend", "math", "--context-parallel-size", "2"],
            2,
            "--sdpa-backend: math given with --context-parallel-size > 1, whose ring attention",
        ),
    ],
)
def test_a_row_is_the_message_validation_raises(flags, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([*BASE, *flags], world_size=world)
