"""Train / valid / test datasets from DataConfig: one prefix with --split, a weighted blend of
prefixes, or separate --train/valid/test-data-path blends.

Before any sample is drawn, each dataset is checked against the training tokenizer, one line
naming the file when it does not fit: the largest token id its sidecar (PREFIX.idx.json)
records, or that a sample of its sequences holds, against the vocab; and the tokenizer
fingerprint the sidecar records (dataset_pair.tokenizer_fingerprint) against this tokenizer's,
which catches data made with another tokenizer of the same vocab size."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import numpy as np

from megatron.config.schema_data import DataConfig, parse_blend, split_weights
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_impl import make_indexed_dataset
from megatron.data.dataset_pair import sidecar_path, tokenizer_mismatch
from megatron.data.gpt_dataset import DataError, GPTDataset, split_document_ranges
from megatron.data.indexed_dataset import dtype_vocab_problem, index_file_path
from megatron.data.packing import PackedGPTDataset

SPLIT_NAMES = ("train", "valid", "test")


def _split_datasets(
    prefix: str,
    weights: list[float],
    num_samples: list[int],
    seq_length: int,
    seed: int,
    common: dict,
) -> list[GPTDataset | None]:
    reader = {k: common[k] for k in ("data_impl", "mmap_warmup", "tokenizer", "packing")}
    common = {k: v for k, v in common.items() if k not in reader}
    indexed = make_indexed_dataset(prefix, reader["data_impl"], reader["mmap_warmup"])
    check_tokenizer(prefix, indexed, common["vocab_size"], reader["tokenizer"])
    problem = dtype_vocab_problem(indexed.dtype, common["vocab_size"])
    if problem:
        warnings.warn(
            f"{index_file_path(prefix)}: {problem}; larger ids read back wrong. The data was "
            "made for another tokenizer, or its dtype code is damaged: re-run "
            "tools/preprocess_data.py with this tokenizer",
            stacklevel=2,
        )
    ranges = split_document_ranges(len(indexed), weights)
    kind = PackedGPTDataset if reader["packing"] == "first-fit" else GPTDataset
    return [
        kind(name, indexed, r, n, seq_length, seed, **common) if n > 0 and len(r) else None
        for name, r, n in zip(SPLIT_NAMES, ranges, num_samples, strict=True)
    ]


_FIX = (
    "Fix: pass the --tokenizer-type and files the data was preprocessed with, or re-run "
    "tools/preprocess_data.py with this tokenizer"
)


def check_tokenizer(prefix: str, indexed, vocab_size: int | None, tokenizer: dict | None):
    """DataError (one line) when the data cannot have been made with this tokenizer."""
    record = getattr(indexed, "pair", None) or {}
    if vocab_size is not None:
        top, where = record.get("max_token_id"), f"recorded in {sidecar_path(prefix)}"
        if top is None:
            top, where = sampled_max_id(indexed), "in a sample of its sequences"
        if top >= vocab_size:
            raise DataError(
                f"{prefix}: token id {top} ({where}) is outside the model's vocab "
                f"[0, {vocab_size}): the data was made with another tokenizer. {_FIX}"
            )
    why = tokenizer_mismatch(record.get("tokenizer"), tokenizer)
    if why:
        made = record["tokenizer"].get("type")
        raise DataError(
            f"{prefix}: made with another tokenizer than this run's ({why}; {made} at "
            f"preprocessing, per {sidecar_path(prefix)}). {_FIX}"
        )


def sampled_max_id(indexed, sequences: int = 256, tokens: int = 4096) -> int:
    """The largest token id in up to `sequences` evenly spaced sequences (their first `tokens`
    ids each): a bounded read whatever the dataset's size (-1 for an empty dataset)."""
    n = len(indexed)
    picks = np.unique(np.linspace(0, n - 1, num=min(n, sequences)).astype(np.int64)) if n else []
    top = -1
    for i in picks:
        ids = indexed.get(int(i), 0, min(int(indexed.sizes[i]), tokens))
        if len(ids):
            top = max(top, int(ids.max()))
    return top


def _blend(blend, weights, num_samples, seq_length, seed, common) -> list:
    if len(blend) == 1:
        return _split_datasets(blend[0][1], weights, num_samples, seq_length, seed, common)
    # Ask each part for slightly more than its share so rounding never runs a part dry.
    parts = [
        _split_datasets(
            prefix,
            weights,
            [math.ceil(n * w * 1.005) for n in num_samples],
            seq_length,
            seed,
            common,
        )
        for w, prefix in blend
    ]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        members = [(w, p[s]) for (w, _), p in zip(blend, parts, strict=True) if p[s] is not None]
        if not members or num_samples[s] <= 0:
            out.append(None)
            continue
        out.append(
            BlendableDataset(
                [d for _, d in members],
                [w for w, _ in members],
                num_samples[s],
                name=name,
                cache_dir=common.get("cache_dir") or _cache_dir_of(members[0][1]),
                is_builder=common["is_builder"],
                barrier=common["barrier"],
                description={"parts": [p for _, p in blend], "seed": seed, "seq": seq_length},
            )
        )
    return out


def _cache_dir_of(ds: GPTDataset) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(ds.indexed.prefix)), "index-cache")


def _print_warning(message: str) -> None:
    print(f"warning: {message}", flush=True)


def build_train_valid_test_datasets(
    data: DataConfig,
    num_samples: tuple[int, int, int],
    seq_length: int,
    seed: int,
    *,
    vocab_size: int | None = None,
    tokenizer: dict | None = None,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
) -> list:
    """[train, valid, test] datasets (None where a split is empty or not asked for);
    `tokenizer`: the run's tokenizer fingerprint (dataset_pair.tokenizer_fingerprint)."""
    common = {
        "tokenizer": tokenizer,
        "data_impl": data.data_impl,
        "mmap_warmup": data.mmap_warmup,
        "packing": data.sequence_packing,
        "cache_dir": data.data_cache_path,
        "vocab_size": vocab_size,
        "is_builder": is_builder,
        "barrier": barrier,
    }
    log = _print_warning if is_builder else None
    if data.data_path:
        return _blend(
            parse_blend(data.data_path, on_merge=log),
            split_weights(data.split),
            list(num_samples),
            seq_length,
            seed,
            common,
        )
    out = []
    for s, (flag, paths) in enumerate(
        (
            ("--train-data-path", data.train_data_path),
            ("--valid-data-path", data.valid_data_path),
            ("--test-data-path", data.test_data_path),
        )
    ):
        only = [1.0 if i == s else 0.0 for i in range(3)]
        wanted = [num_samples[s] if i == s else 0 for i in range(3)]
        out.append(
            _blend(parse_blend(paths, flag, log), only, wanted, seq_length, seed, common)[s]
            if paths
            else None
        )
    return out
