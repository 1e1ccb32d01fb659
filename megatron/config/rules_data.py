"""Rules of the data settings (--data-path / --split / blends, loose JSON input); each
setting's own limits are declared on it (megatron.config.schema)."""

from __future__ import annotations

from megatron.config.declare import ConfigError, fail
from megatron.config.schema_data import DataConfig, parse_blend, prefix_names_a_file, split_weights
from megatron.config.schema_data_corpora import parse_corpus_list


def validate_data(d: DataConfig) -> None:
    problem = d.tokenizer.pretrained_problem()
    if problem:
        fail(*problem)
    _validate_loose_json(d)
    separate = d.train_data_path or d.valid_data_path or d.test_data_path
    if d.data_path and separate:
        fail(
            "--data-path",
            "given together with --train/valid/test-data-path",
            "use either --data-path with --split, or the three separate paths",
        )
    for flag, paths in (
        ("--data-path", d.data_path),
        ("--train-data-path", d.train_data_path),
        ("--valid-data-path", d.valid_data_path),
        ("--test-data-path", d.test_data_path),
    ):
        for _, prefix in parse_blend(paths, flag):
            named_file = prefix_names_a_file(prefix, flag)
            if named_file:
                fail(flag, *named_file)
    try:
        split_weights(d.split)
    except ValueError as e:
        fail("--split", str(e), "pass three non-negative weights such as 969,30,1")
    if d.uses_documents and d.tokenizer.tokenizer_type is None:
        flag = next(
            f
            for f, on in (
                ("--reset-position-ids", d.reset_position_ids),
                ("--reset-attention-mask", d.reset_attention_mask),
                ("--eod-mask-loss", d.eod_mask_loss),
            )
            if on
        )
        fail(
            flag,
            "needs the end-of-document id, which comes from the tokenizer, and no "
            "--tokenizer-type is set",
            "pass the --tokenizer-type the data was preprocessed with (NullTokenizer for "
            "pre-tokenized ids: its end-of-document id is --vocab-size)",
        )


def _given(*flags: tuple[str, object]) -> list[tuple[str, object]]:
    """The (flag, value) pairs whose value is given (not empty)."""
    return [(f, v) for f, v in flags if v]


def _validate_loose_json(d: DataConfig) -> None:
    """--train-data & co. (loose JSON, cached in --cache-dir) replace the mmap data flags."""
    lj = d.loose_json
    loose = _given(
        ("--train-data", lj.train_data),
        ("--valid-data", lj.valid_data),
        ("--test-data", lj.test_data),
    )
    if not loose:
        return
    mmap = _given(
        ("--data-path", d.data_path),
        ("--train-data-path", d.train_data_path),
        ("--valid-data-path", d.valid_data_path),
        ("--test-data-path", d.test_data_path),
    )
    if mmap:
        fail(
            loose[0][0],
            f"given together with {mmap[0][0]}: one names loose JSON corpora to tokenize, the "
            "other preprocessed .bin/.idx prefixes",
            f"use either {loose[0][0]} (loose JSON) or {mmap[0][0]} (prefixes), not both",
        )
    if not lj.train_data:
        fail(loose[0][0], "needs --train-data", "name the training corpus with --train-data")
    for flag, values in loose:
        try:
            parse_corpus_list(values, flag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if not d.tokenizer.cache_dir:
        fail(
            loose[0][0],
            "the corpora are tokenized once into --cache-dir, which is not set",
            "pass --cache-dir DIR (a directory every node can read)",
        )
    if d.tokenizer.tokenizer_type is None:
        fail(
            loose[0][0],
            "loose JSON needs a tokenizer",
            "pass --tokenizer-type (with its --vocab-file etc.) or --tokenizer-model-type",
        )
