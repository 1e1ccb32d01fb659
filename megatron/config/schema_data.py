"""The data section of the configuration tree: the tokenizer and the corpora (paths, blends,
splits, loose JSON input), and the parsers of their values shared by the rules
(megatron.config.rules_data) and megatron/data/builder.py. Part of the one tree of
megatron.config.schema, declared here for size."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron.config.declare import Section, fail, setting
from megatron.config.pretrained_vocab import PRETRAINED, find_files
from megatron.config.pretrained_vocab import problem as pretrained_problem
from megatron.config.schema_data_corpora import LooseJsonConfig

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "NullTokenizer",
    "WhitespaceTokenizer",
    "CharTokenizer",
)


@dataclass(frozen=True)
class TokenizerConfig(Section):
    """The tokenizer (shared with tools/preprocess_data.py and the other data tools)."""

    tokenizer_type: str | None = setting(
        None,
        "tokenizer kind (pretrain_gpt2.py default, as Megatron v1.x: GPT2BPETokenizer when "
        "--vocab-file is given; without --vocab-file the ids come pre-tokenized and "
        "--vocab-size sets the vocab)",
        choices=TOKENIZER_TYPES,
    )
    vocab_file: str | None = setting(
        None,
        "vocab.json (GPT-2 BPE / whitespace / character vocab) or vocab.txt (BERT WordPiece); "
        "GPT2BPETokenizer with neither file uses GPT-2's own, shipped in the package",
    )
    merge_file: str | None = setting(None, "merges.txt of a GPT-2 BPE tokenizer")
    tokenizer_model: str | None = setting(
        None,
        "tokenizer.json (or its directory) for HuggingFaceTokenizer, "
        ".model for SentencePieceTokenizer",
    )
    tokenizer_model_type: str | None = setting(
        None,
        "a named pretrained vocab (older Megatron): sets --tokenizer-type and finds its files in "
        "--cache-dir unless --vocab-file/--merge-file are given; nothing is downloaded",
        choices=tuple(PRETRAINED),
    )
    cache_dir: str | None = setting(
        None,
        "directory holding the --tokenizer-model-type vocab files (e.g. gpt2-vocab.json); "
        "--train-data/--valid-data/--test-data write their tokenized corpora under DIR/loose_json",
    )

    def with_pretrained_files(self) -> TokenizerConfig:
        """The resolution step of --tokenizer-model-type (called by megatron.config.rules.validate
        and by the tools that build a tokenizer): it fills the tokenizer type and the files not
        given from --cache-dir. This searches the disk, so building the section never does; the
        rules check what is still missing or conflicting."""
        name = self.tokenizer_model_type
        if name not in PRETRAINED:
            return self
        fill = {} if self.tokenizer_type is not None else {"tokenizer_type": PRETRAINED[name][0]}
        if any(getattr(self, kwarg) is None for kwarg in PRETRAINED[name][1]):
            for kwarg, path in find_files(name, self.cache_dir).items():
                if getattr(self, kwarg) is None and path is not None:
                    fill[kwarg] = path
        return dataclasses.replace(self, **fill) if fill else self

    def pretrained_problem(self) -> tuple[str, str, str] | None:
        """(flag, problem, fix) when --tokenizer-model-type cannot be honoured (the rules and
        tools/preprocess_data.py report it), else None."""
        if self.tokenizer_model_type is None:
            return None
        given = {"vocab_file": self.vocab_file, "merge_file": self.merge_file}
        return pretrained_problem(
            self.tokenizer_model_type, self.tokenizer_type, self.cache_dir, given
        )

    def kwargs(self) -> dict:
        """Keyword arguments of megatron.data.tokenizers.build_tokenizer."""
        return {
            "vocab_file": self.vocab_file,
            "merge_file": self.merge_file,
            "tokenizer_model": self.tokenizer_model,
        }


@dataclass(frozen=True)
class DataConfig(Section):
    """.bin/.idx datasets written by preprocess_data.py: where, split, blend, format."""

    data_path: tuple[str, ...] = setting(
        (), "PREFIX, or a blend W1 PREFIX1 W2 PREFIX2 ... (weights are normalized)"
    )
    split: str = setting("969,30,1", "train,valid,test weights over the documents of --data-path")
    train_data_path: tuple[str, ...] = setting(
        (), "separate train data (PREFIX or a blend); replaces --data-path/--split"
    )
    valid_data_path: tuple[str, ...] = setting((), "separate validation data")
    test_data_path: tuple[str, ...] = setting((), "separate test data")
    data_cache_path: str | None = setting(
        None, "directory for the cached sample indices (default: beside the data)"
    )
    data_impl: str = setting(
        "infer",
        "dataset format: mmap (what tools/preprocess_data.py writes), lazy / cached (v1.x's "
        "older TNTIDX files, read on demand / held in memory), infer (from the index's magic)",
        choices=("infer", "mmap", "lazy", "cached"),
    )
    mmap_warmup: bool = setting(
        False, "read every page of each .bin (and mmap .idx) once at load, so reads never fault"
    )
    sequence_packing: str = setting(
        "concat",
        "how GPT samples are made of documents: concat (concatenate the shuffled documents and "
        "cut every --seq-length tokens), first-fit (whole documents packed first-fit "
        "decreasing, the tail padded, each attending within itself: docs/packing.md)",
        choices=("concat", "first-fit"),
    )
    # Document boundaries inside a packed sample (the tokenizer's end-of-document id marks them;
    # an EOD token ends the document it follows). Training semantics, never saved with a model.
    reset_position_ids: bool = setting(
        False, "position ids restart at 0 after each end-of-document token of a sample"
    )
    reset_attention_mask: bool = setting(
        False,
        "a token attends only to earlier tokens of its own document: none before or at an "
        "end-of-document token that precedes it",
    )
    eod_mask_loss: bool = setting(
        False, "no loss where the input token is end-of-document (predicting across documents)"
    )

    @property
    def uses_documents(self) -> bool:
        """Any option that needs the end-of-document id."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    loose_json: LooseJsonConfig = field(default_factory=LooseJsonConfig)


# Parsers of DataConfig values, shared by the rules (checked at start-up) and data/builder.py.


def parse_blend(
    paths: Sequence[str], flag: str = "--data-path", on_merge: Callable[[str], None] | None = None
) -> list[tuple[float, str]]:
    """`PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...` -> [(normalized weight, prefix)].

    A prefix listed twice (an old way to up-weight a corpus) becomes one entry with the summed
    weight: two entries would share one cached sample order, so every sample came twice, back
    to back in the same batch. `on_merge(message)` hears about each merge."""
    if not paths:
        return []
    if len(paths) == 1:
        return [(1.0, paths[0])]
    if len(paths) % 2:
        fail(
            flag,
            f"{len(paths)} values: a blend needs weight/prefix pairs",
            "write W1 PREFIX1 W2 PREFIX2 ... (or a single prefix)",
        )
    pairs = []
    for w, prefix in zip(paths[0::2], paths[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            fail(flag, f"{w!r} is not a weight", "put a number before each prefix")
        if weight < 0:
            fail(flag, f"negative weight {weight}", "use weights >= 0")
        pairs.append((weight, prefix))
    pairs = _merge_repeated_prefixes(pairs, flag, on_merge)
    total = sum(w for w, _ in pairs)
    if total <= 0:
        fail(flag, "the weights sum to 0", "give at least one dataset a positive weight")
    return [(w / total, p) for w, p in pairs]


def _merge_repeated_prefixes(pairs, flag: str, on_merge) -> list[tuple[float, str]]:
    merged: dict[str, list] = {}  # normalized path -> [summed weight, prefix as given, count]
    for weight, prefix in pairs:
        entry = merged.setdefault(os.path.normpath(os.path.abspath(prefix)), [0.0, prefix, 0])
        entry[0] += weight
        entry[2] += 1
    for weight, prefix, count in merged.values():
        if count > 1 and on_merge is not None:
            on_merge(
                f"{flag}: {prefix} is listed {count} times; merged into one entry with the "
                f"summed weight {weight:g}, so its samples are not drawn twice in one order"
            )
    return [(w, p) for w, p, _ in merged.values()]


def prefix_names_a_file(prefix: str, flag: str = "--data-path") -> tuple[str, str] | None:
    """(problem, fix) when a dataset prefix names its .bin or .idx file (`x.bin`, with no
    x.bin.idx beside it) instead of the prefix of the pair; None otherwise. The rules refuse it
    at start-up; the readers (megatron.data.indexed_dataset.prefix_hint) say it when a prefix
    reaches them without the rules."""
    prefix = str(prefix)
    stem, ext = os.path.splitext(prefix)
    if ext not in (".bin", ".idx") or os.path.exists(f"{prefix}.idx"):
        return None
    return (
        f"{prefix} names the {ext} file, but the flag takes the prefix of the .bin/.idx pair",
        f"drop {ext}: {flag} {stem}",
    )


def split_weights(split: str) -> list[float]:
    """'949,50,1' (or '949/50/1', or fewer values) -> three normalized weights."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    values = [float(p) for p in parts]
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"{split!r} is not up to three non-negative weights with a positive sum")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]
