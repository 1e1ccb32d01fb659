"""Command line -> a validated `MegatronConfig`.

This is the only module that reads argv. The flags are derived from the declarations in
megatron.config.schema (Megatron-LM's names; where Megatron renamed a flag both spellings are
one option, e.g. `--model-parallel-size` = `--tensor-model-parallel-size`).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence

from megatron.config.declare import Tree
from megatron.config.rules import validate
from megatron.config.schema import MegatronConfig


@functools.cache
def config_tree() -> Tree:
    """Every setting of MegatronConfig, by dotted path (model.hidden_size, ...)."""
    return Tree(MegatronConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Megatron-style GPT pretraining (tensor x pipeline x data parallel)",
        allow_abbrev=False,
    )
    config_tree().add_arguments(parser, given_only=True)
    return parser


def world_size_from_env() -> int:
    """Processes in the job, as torchrun / deepspeed (WORLD_SIZE) or Slurm (SLURM_NTASKS) say."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def resolve(ns: argparse.Namespace, world_size: int) -> MegatronConfig:
    """The declared defaults, replaced by the flags given (not yet validated)."""
    tree = config_tree()
    values = tree.given(ns)
    values["parallel.world_size"] = world_size
    return tree.build(values)


def parse_args(
    argv: Sequence[str] | None = None,
    world_size: int | None = None,
) -> MegatronConfig:
    """Parse argv (default sys.argv) into a validated, frozen config.

    `world_size` defaults to the launcher's environment, so the layout is checked before any
    process group exists.
    """
    ns = build_parser().parse_args(argv)
    cfg = resolve(ns, world_size if world_size is not None else world_size_from_env())
    validate(cfg)
    return cfg
