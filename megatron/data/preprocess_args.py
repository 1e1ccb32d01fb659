"""The command line of tools/preprocess_data.py (megatron.data.preprocess runs it)."""

from __future__ import annotations

import argparse

from megatron.config.declare import add_section_args
from megatron.config.schema_data import TokenizerConfig
from megatron.data.preprocess_inputs import TXT_DOCUMENTS
from megatron.data.preprocess_outputs import DATASET_IMPLS

DESCRIPTION = (
    "tools/preprocess_data.py: text corpora -> Megatron mmap datasets (PREFIX_{key}_document.*)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False)
    _add_input_args(p.add_argument_group("input"))
    add_section_args(p, TokenizerConfig, title="tokenizer")
    p.add_argument("--vocab-size", type=int, default=None, help="vocab of the NullTokenizer")
    _add_output_args(p.add_argument_group("output"))
    _add_runtime_args(p.add_argument_group("runtime"))
    return p


def _add_input_args(g) -> None:
    g.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, globs or directories: .jsonl (one JSON object per line), .json "
        "(lines, or one array of strings/objects), .txt (see --txt-documents), any of "
        "them .gz; .parquet files and datasets.save_to_disk directories (needs pyarrow)",
    )
    g.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys (table columns) to extract; one output dataset per key (default: text)",
    )
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="one sequence per sentence (built-in rule-based splitter)",
    )
    g.add_argument(
        "--presplit-sentences",
        action="store_true",
        help="one sequence per sentence, where each non-empty line of a document is a "
        "sentence (the corpus is already split; Megatron-LM 2019's flag)",
    )
    g.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: keep the whitespace and newlines after each sentence at "
        "its end (v1.x; without it they are dropped). Whole documents always keep them",
    )
    g.add_argument(
        "--txt-paragraphs",
        action="store_true",
        help=".txt inputs: documents are separated by blank lines, not one per line "
        "(--txt-documents paragraph)",
    )
    g.add_argument(
        "--txt-documents",
        choices=TXT_DOCUMENTS,
        default="line",
        help=".txt inputs: a document is a line (default; blank lines skipped and counted), a "
        "paragraph (separated by blank lines, its newlines kept) or the whole file, every "
        "newline kept (one stream, as nanoGPT's input.txt; the file is read into memory)",
    )
    g.add_argument(
        "--bad-records",
        choices=["fail", "skip"],
        default="fail",
        help="malformed JSON, non-UTF-8 bytes, missing keys: fail (default; exit 1 and "
        "write nothing) or skip (leave them out and list where they were)",
    )


def _add_output_args(g) -> None:
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g.add_argument(
        "--dataset-impl",
        choices=DATASET_IMPLS,
        default="mmap",
        help="mmap (default): Megatron's mmap format; lazy / cached: v1.x's older TNTIDX format "
        "(int32 tokens; both names write the same files), read with --data-impl lazy/cached",
    )
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document",
    )


def _add_runtime_args(g) -> None:
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument(
        "--log-interval",
        type=int,
        default=10000,
        help="print progress every this many documents (default 10000)",
    )
    g.add_argument(
        "--chunk-bytes",
        type=int,
        default=1 << 20,
        help="input bytes per worker task (default 1 MiB)",
    )
