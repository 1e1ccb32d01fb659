"""Context parallelism (--context-parallel-size): the rules, the load-balanced split, ring
attention against plain causal attention, and the GPT trained at CP against one process.

Ranks are gloo processes on the CPU. The multi-rank checks are grouped into few spawns (each
spawn runs several layouts and checks), all marked slow.
"""

from __future__ import annotations

import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.schema import ConfigError
from megatron.mpu.context_parallel import (
    chunk_ids,
    context_parallel_positions,
    context_parallel_slice,
    context_parallel_unslice,
)

# ---- the rules ----

_BASE_ARGV = ["--vocab-size", "64", "--seq-length", "16"]


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["--seq-length", "18"], 4, "not divisible by 2 x CP = 4"),
        (["--context-parallel-size", "3"], 4, "world size 4 is not divisible by TP x CP x PP"),
        (["--deepspeed"], 4, "given with --deepspeed"),
        (
            ["--reset-attention-mask", "--tokenizer-type", "GPT2BPETokenizer"],
            2,
            "given with --reset-attention-mask",
        ),
        (["--attention-backend", "fused"], 2, "given with --attention-backend fused"),
        (
            ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "20"],
            8,
            "not divisible by --tensor-model-parallel-size 4",
        ),
        (["--context-parallel-size", "0"], 1, "must be >= 1"),
    ],
)
def test_bad_context_parallel_layouts_fail_before_any_work(extra, world, message):
    argv = [*_BASE_ARGV, "--context-parallel-size", "2", *extra]
    with pytest.raises(ConfigError, match=message) as err:
        parse_args(argv, world_size=world)
    text = str(err.value)
    assert text.startswith(("--context-parallel-size:", "--sequence-parallel:")), text
    assert "Fix:" in text


def test_context_parallel_divides_the_world_before_data_parallelism():
    cfg = parse_args([*_BASE_ARGV, "--context-parallel-size", "2"], world_size=8)
    assert cfg.parallel.context_parallel_size == 2
    assert cfg.parallel.data_parallel_size == 4
    cfg = parse_args(
        [*_BASE_ARGV, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2"],
        world_size=8,
    )
    assert cfg.parallel.data_parallel_size == 2


def test_bert_refuses_context_parallelism():
    from megatron.config.rules import validate_bert

    cfg = parse_args([*_BASE_ARGV, "--context-parallel-size", "2"], world_size=2)
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        validate_bert(cfg)


# ---- the load-balanced split ----


def test_load_balanced_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    seq = torch.arange(16).expand(2, 16)  # (b, s)
    parts = [context_parallel_slice(seq, r, 4) for r in range(4)]
    assert parts[0].tolist()[0] == [0, 1, 14, 15]
    assert parts[3].tolist()[0] == [6, 7, 8, 9]
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert torch.equal(context_parallel_unslice(parts), seq)
    assert torch.equal(context_parallel_positions(2, 16, 1, 4, "cpu"), parts[1])
    # causal work (keys seen) is equal on every rank
    work = [sum(int(t) + 1 for t in p[0]) for p in parts]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="not divisible"):
        context_parallel_slice(torch.zeros(1, 10), 0, 4)
