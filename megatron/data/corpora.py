"""Corpus names: a user's YAML file maps each name to its files (and an optional weight), so
`--train-data wikipedia webtext` works as in Megatron-LM's 2019 README. Nothing is built in and
nothing is downloaded: every name comes from the file given by `--corpora-file` (or
`$MEGATRON_CORPORA`).

    # corpora.yaml (relative paths are relative to this file)
    wikipedia: /data/wiki/*.jsonl           # a file, a glob or a directory
    webtext: [webtext/a.jsonl, webtext/b.json]
    chinese:
      paths: zh/train.json
      weight: 2.0                           # used when blending several corpora

A value of `--train-data` that is not a name may be a path (file, glob or directory).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import yaml

from megatron.config.declare import ConfigError
from megatron.config.schema_data_corpora import CORPORA_ENV, parse_corpus_list


@dataclass(frozen=True)
class Corpus:
    name: str  # the alias, or the file's stem for a plain path
    paths: tuple[str, ...]  # files, globs or directories (expanded when tokenized)
    weight: float | None  # None: blend by size


def corpora_file_path(flag_value: str | None) -> tuple[str | None, str]:
    """(path of the corpora file or None, how it was chosen, for messages)."""
    if flag_value:
        return flag_value, f"--corpora-file {flag_value}"
    env = os.environ.get(CORPORA_ENV)
    if env:
        return env, f"${CORPORA_ENV}={env}"
    return None, ""


def _paths_of(name: str, value, where: str) -> tuple[tuple[str, ...], float | None]:
    weight = None
    if isinstance(value, dict):
        unknown = set(value) - {"paths", "weight"}
        if unknown or "paths" not in value:
            raise ConfigError(
                f"{where}: corpus {name!r} has keys {sorted(value)}. Fix: give it 'paths' "
                "(a path or a list) and optionally 'weight'"
            )
        weight = value.get("weight")
        if weight is not None and (not isinstance(weight, int | float) or weight < 0):
            raise ConfigError(f"{where}: corpus {name!r}: weight {weight!r} is not a number >= 0")
        value = value["paths"]
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise ConfigError(
            f"{where}: corpus {name!r} must map to a path, a list of paths, or "
            "{paths: ..., weight: ...}"
        )
    return tuple(paths), None if weight is None else float(weight)


def read_corpora_file(path: str, where: str) -> dict[str, tuple[tuple[str, ...], float | None]]:
    """{name: (absolute paths, weight or None)} from a corpora YAML file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror}). Fix: check the path") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({e}). Fix: correct it") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must map corpus names to paths, got {type(data).__name__}")
    base = os.path.dirname(os.path.abspath(path))
    out = {}
    for name, value in data.items():
        paths, weight = _paths_of(str(name), value, where)
        out[str(name)] = (tuple(os.path.join(base, os.path.expanduser(p)) for p in paths), weight)
    return out


def _exists(path: str) -> bool:
    return os.path.exists(path) or bool(glob.glob(path))


def _stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path)) or "corpus"
    for suffix in (".gz", ".jsonl", ".json", ".txt"):
        base = base.removesuffix(suffix)
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in base) or "corpus"


def resolve_corpora(values: tuple[str, ...], flag: str, corpora_file: str | None) -> list[Corpus]:
    """The corpora named by one of --train-data/--valid-data/--test-data, in order."""
    path, where = corpora_file_path(corpora_file)
    aliases = read_corpora_file(path, where) if path else {}
    out = []
    for weight, item in parse_corpus_list(values, flag):
        if item in aliases:
            paths, alias_weight = aliases[item]
            out.append(Corpus(item, paths, weight if weight is not None else alias_weight))
        elif _exists(item):
            out.append(Corpus(_stem(item), (item,), weight))
        else:
            raise ConfigError(_unknown(item, flag, where, sorted(aliases)))
    if len(out) > 1 and len({c.weight is None for c in out}) > 1:
        raise ConfigError(
            f"{flag}: some corpora have a weight and some do not "
            f"({', '.join(f'{c.name}={c.weight}' for c in out)}). Fix: give every corpus a "
            "weight (W1 NAME1 W2 NAME2 ... or 'weight:' in the corpora file), or none to blend "
            "by size"
        )
    return out


def _unknown(item: str, flag: str, where: str, known: list[str]) -> str:
    if where:
        names = f"known names in {where}: {', '.join(known) or '(none)'}"
    else:
        names = f"no corpora file (pass --corpora-file FILE.yaml or set ${CORPORA_ENV})"
    return (
        f"{flag}: unknown corpus {item!r}: it is not a corpus name and no file, glob or "
        f"directory matches it; {names}. Fix: add {item!r} to the corpora file, or pass a path"
    )
