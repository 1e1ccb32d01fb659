"""Command line and run configs -> a validated `MegatronConfig`.

This is the only module that reads argv. The flags are derived from the declarations in
megatron.config.schema (Megatron-LM's names; where Megatron renamed a flag both spellings are
one option, e.g. `--model-parallel-size` = `--tensor-model-parallel-size`).

Precedence, lowest first: the declared defaults < `-c/--config FILE` < the flags given on the
command line < `-o section.key=value`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import sys
from collections.abc import Callable, Sequence

from megatron.config.compat_v1 import (
    V1_DEFAULT_TOKENIZER,
    add_refused_arguments,
    apply_v1_defaults,
    check_refused,
)
from megatron.config.declare import Tree
from megatron.config.files import parse_overrides, read_config_file, to_yaml
from megatron.config.rules import validate
from megatron.config.schema import MegatronConfig
from megatron.config.schema_parallel import LAUNCHER_VARIABLES


@functools.cache
def config_tree() -> Tree:
    """Every setting of MegatronConfig, by dotted path (model.hidden_size, ...)."""
    return Tree(MegatronConfig)


def unrecognized(extras: Sequence[str], *parsers: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments: ..." with the closest flag `parsers` know for each
    unknown one (`--hiden-size`: did you mean --hidden-size?)."""
    known = sorted({o for p in parsers for o in p._option_string_actions if o.startswith("--")})
    hints = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        if flag.startswith("-") and close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return f"{message} ({'; '.join(hints)})" if hints else message


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose unknown-flag error suggests the closest known flag."""

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras, self))
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        description="Megatron-style GPT pretraining (tensor x pipeline x data parallel). "
        "Settings come from the defaults, then -c FILE, then the flags, then -o.",
        allow_abbrev=False,
    )
    g = parser.add_argument_group("run config")
    g.add_argument(
        "-c",
        "--config",
        dest="run_config",
        metavar="FILE",
        default=None,
        help="YAML (or JSON) run config nested by section, e.g. model: {hidden_size: 1024}; "
        "flags given on the command line override it",
    )
    g.add_argument(
        "-o",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting, last word over file and flags (repeatable; the value is "
        "read as YAML, e.g. -o optimizer.lr=1e-4 -o data.data_path=[a,b])",
    )
    g.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (a valid -c file) and exit",
    )
    config_tree().add_arguments(parser, given_only=True)
    add_refused_arguments(parser)
    return parser


def world_size_from_env() -> int:
    """Processes in the job, as the launcher says (torchrun/deepspeed, Slurm, or MPI)."""
    for _, var, _ in LAUNCHER_VARIABLES:
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def resolve(
    ns: argparse.Namespace, world_size: int, default_tokenizer: str = V1_DEFAULT_TOKENIZER["gpt"]
) -> MegatronConfig:
    """defaults < config file < flags on the command line < -o (not yet validated)."""
    tree = config_tree()
    values: dict[str, object] = {}
    if ns.run_config:
        values.update(read_config_file(ns.run_config, tree))
    later = {**tree.given(ns), **parse_overrides(ns.overrides, tree)}
    _drop_replaced_tokenizer_files(values, later)
    values.update(later)
    apply_v1_defaults(values, default_tokenizer)
    values["parallel.world_size"] = world_size
    return tree.build(values)


_TOKENIZER = "data.tokenizer."
_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model", "tokenizer_model_type")


def _drop_replaced_tokenizer_files(from_file: dict, later: dict) -> None:
    """A run file's tokenizer files belong to its tokenizer: a flag (or -o) naming another
    tokenizer type drops the file's vocab / merges / model unless those are given again
    (so `-c char_config.yaml --tokenizer-type GPT2BPETokenizer` means GPT-2's own files)."""
    key = _TOKENIZER + "tokenizer_type"
    if key not in later or later[key] == from_file.get(key, later[key]):
        return
    for name in _TOKENIZER_FILES:
        if _TOKENIZER + name not in later:
            from_file.pop(_TOKENIZER + name, None)


def parse_args(
    argv: Sequence[str] | None = None,
    world_size: int | None = None,
    plan: Callable[[MegatronConfig], MegatronConfig] | None = None,
    purpose: str = "config",
) -> MegatronConfig:
    """Parse argv (default sys.argv) into a config validated for `purpose` (see
    megatron.config.rules.validate: "config", "train-gpt", "train-bert", "eval-bert").

    `world_size` defaults to the launcher's environment, so the layout is checked before any
    process group exists. With --print-config the config is printed and the process exits 0
    here, before any distributed or data work. `plan` (pretrain_gpt2.py's --auto-parallel)
    may replace the layout settings of the resolved config before it is validated.
    A --vocab-file without --tokenizer-type means the purpose's v1.x tokenizer (GPT-2 BPE, or
    BertWordPieceLowerCase for BERT).
    """
    ns = build_parser().parse_args(argv)
    check_refused(ns)
    world = world_size if world_size is not None else world_size_from_env()
    family = "bert" if purpose.endswith("-bert") else "gpt"
    cfg = resolve(ns, world, V1_DEFAULT_TOKENIZER[family])
    if plan is not None:
        cfg = plan(cfg)
    if ns.print_config:  # the settings alone: a template may still lack e.g. --lr
        cfg = validate(cfg)
        sys.stdout.write(to_yaml(cfg, "resolved by --print-config; run it with -c FILE"))
        sys.stdout.flush()
        raise SystemExit(0)
    return validate(cfg, purpose)
