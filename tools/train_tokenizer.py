"""Train a tokenizer for pretraining, offline, streaming the corpus.

    python tools/train_tokenizer.py --input corpus.jsonl more.txt.gz --type bpe \\
        --vocab-size 32000 --output-dir tok/

`--type bpe` trains GPT-2's byte-level BPE with HF `tokenizers` and writes `vocab.json` +
`merges.txt` (for `--tokenizer-type GPT2BPETokenizer`) and `tokenizer.json` (for
`HuggingFaceTokenizer`); `--type sentencepiece` writes `spm.model` + `spm.vocab` (for
`SentencePieceTokenizer`). The first `--special-tokens` entry is the end-of-document token: id 0
in the BPE vocab, the eos piece of the SentencePiece model.

`--type char` (GPT2-Chinese's make_vocab: every character seen at least `--min-frequency`
times, plus the special tokens; `--vocab-size` optional, a cap) and `--type wordpiece` (BERT's
WordPiece) write `vocab.txt` for `--tokenizer-type BertWordPieceCase` (or
`BertWordPieceLowerCase` with `--lowercase`); their special tokens default to BERT's
([PAD] [UNK] [CLS] [SEP] [MASK]; [SEP] ends a document).

`--type char-level` (nanoGPT's shakespeare_char: every character of the corpus a token, spaces
and newlines kept, ids by code point, then `<|endoftext|>`) writes `vocab.json` for
`--tokenizer-type CharTokenizer`; it has no size or frequency to choose.

Inputs are `.jsonl` (one object a line, text under `--json-keys`), `.json` (an array of strings
or objects) or plain text (any other name), each optionally `.gz`; they are read lazily, never
all at once.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data import vocab_builder  # noqa: E402
from megatron.data.char_tokenizer import CHAR_EOD, char_vocab  # noqa: E402

CHUNK_CHARS = 1 << 20  # .json arrays are decoded from chunks of this many characters
TXT_BLOCK_CHARS = 1 << 16  # .txt lines are grouped so BPE sees newlines with their context
SPM_MAX_SENTENCES = 10_000_000  # SentencePiece holds its input in memory: sample this many lines


class InputError(ValueError):
    """Bad input or flag; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl/.json/.txt files, or .gz")
    p.add_argument(
        "--type",
        choices=("bpe", "sentencepiece", "char", "wordpiece", "char-level"),
        required=True,
        help="model type (char-level: every character a token, spaces and newlines kept, "
        "nanoGPT's shakespeare_char, for --tokenizer-type CharTokenizer)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="ids in the trained vocab (required except for char, where it caps the size)",
    )
    p.add_argument(
        "--lowercase",
        action="store_true",
        help="char/wordpiece: lowercase first (for BertWordPieceLowerCase)",
    )
    p.add_argument("--output-dir", required=True, help="directory to write to (created)")
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys holding text (default: text)"
    )
    p.add_argument(
        "--min-frequency",
        type=int,
        default=None,
        help="bpe/wordpiece: min count to merge (2); char: min count of a character (1)",
    )
    p.add_argument(
        "--special-tokens",
        nargs="+",
        default=None,
        help="special tokens; bpe/sentencepiece: the first is end-of-document (default "
        "<|endoftext|>); char/wordpiece: default [PAD] [UNK] [CLS] [SEP] [MASK] ([UNK] and "
        "[SEP] are always added)",
    )
    return p


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _texts(value, where: str, keys: list[str]) -> Iterator[str]:
    """The text in one JSON record: a string, or the `--json-keys` fields of an object."""
    if isinstance(value, str):
        yield value
        return
    if not isinstance(value, dict):
        raise InputError(f"--input {where}: expected a string or an object, got {value!r:.40}")
    for key in keys:
        if not isinstance(value.get(key), str):
            raise InputError(f"--input {where}: no string under --json-keys {key!r}")
        yield value[key]


def _iter_jsonl(f, path: str, keys: list[str]) -> Iterator[str]:
    for lineno, line in enumerate(f, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"--input {path}:{lineno}: not JSON ({err})") from None
            yield from _texts(record, f"{path}:{lineno}", keys)


def _iter_json_array(f, path: str, keys: list[str]) -> Iterator[str]:
    """Elements of a top-level JSON array, decoded one by one as chunks arrive."""
    decoder, buf = json.JSONDecoder(), f.read(CHUNK_CHARS).lstrip()
    if not buf.startswith("["):
        raise InputError(f"--input {path}: a .json input must be an array")
    pos, index = 1, 0
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = f.read(CHUNK_CHARS)  # the element may continue in the next chunk
            if not more:
                raise InputError(f"--input {path}: element {index} is not valid JSON") from None
            buf, pos = buf[pos:] + more, 0
            continue
        yield from _texts(value, f"{path}[{index}]", keys)
        pos, index = end, index + 1


def _iter_txt(f) -> Iterator[str]:
    block, size = [], 0
    for line in f:
        block.append(line)
        size += len(line)
        if size >= TXT_BLOCK_CHARS:
            yield "".join(block)
            block, size = [], 0
    if block:
        yield "".join(block)


def iter_documents(paths: Iterable[str], keys: list[str]) -> Iterator[str]:
    """Every text of every input, in order, one at a time."""
    for path in paths:
        kind = path.removesuffix(".gz").rsplit(".", 1)[-1]
        with _open_text(path) as f:
            if kind == "jsonl":
                yield from _iter_jsonl(f, path, keys)
            elif kind == "json":
                yield from _iter_json_array(f, path, keys)
            else:
                yield from _iter_txt(f)


def train_bpe(docs: Iterator[str], args: argparse.Namespace, out: Path) -> list[Path]:
    """GPT-2 byte-level BPE: every byte is in the alphabet, so no text is ever unknown."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=args.special_tokens,  # ids 0.. in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(docs, trainer=trainer)
    _say_if_smaller(tok.get_vocab_size(), args)
    written = [Path(p) for p in tok.model.save(str(out))]  # vocab.json, merges.txt
    tok.save(str(out / "tokenizer.json"))
    return [*written, out / "tokenizer.json"]


def _say_if_smaller(got: int, args: argparse.Namespace) -> None:
    """BPE stops merging when no pair is left that occurs --min-frequency times: say so, with
    the numbers, instead of leaving a smaller vocab to be found later."""
    if got < args.vocab_size:
        print(
            f"note: the vocab has {got:,} tokens, not the {args.vocab_size:,} asked for: the "
            f"corpus has no more pairs that occur at least --min-frequency {args.min_frequency} "
            "times to merge (a larger corpus, or a lower --min-frequency, gives more)",
            file=sys.stderr,
        )


def _lines(docs: Iterator[str], errors: list[Exception]) -> Iterator[str]:
    # SentencePiece trains on sentences; newlines are encoded through byte fallback.
    try:
        for doc in docs:
            yield from (line for line in doc.splitlines() if line.strip())
    except InputError as err:
        errors.append(err)  # SentencePiece turns it into a RuntimeError: keep the original
        raise


def train_sentencepiece(docs: Iterator[str], args: argparse.Namespace, out: Path) -> list[Path]:
    """SentencePiece BPE that round-trips any text (identity normalization, byte fallback)."""
    try:
        import sentencepiece as spm
    except ImportError:
        raise InputError("--type sentencepiece needs: pip install sentencepiece") from None
    eod, *others = args.special_tokens
    errors = []
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(docs, errors),
            model_prefix=str(out / "spm"),
            model_type="bpe",
            vocab_size=args.vocab_size,
            unk_id=0,
            eos_id=1,
            eos_piece=eod,
            bos_id=-1,
            pad_id=-1,
            user_defined_symbols=others,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            hard_vocab_limit=False,
            input_sentence_size=SPM_MAX_SENTENCES,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=1,
        )
    except RuntimeError as err:
        if errors:
            raise errors[0] from None
        msg = f"SentencePiece training failed (check --vocab-size {args.vocab_size}): {err}"
        raise InputError(msg) from None
    return [out / "spm.model", out / "spm.vocab"]


def _check(args: argparse.Namespace) -> None:
    for path in args.input:
        if not os.path.isfile(path):
            raise InputError(f"--input {path}: no such file")
    if args.type == "char-level":
        if args.vocab_size is not None or args.min_frequency is not None:
            raise InputError(
                "--type char-level keeps every character: drop --vocab-size and --min-frequency"
            )
        return
    if args.min_frequency is None:
        args.min_frequency = 1 if args.type == "char" else 2
    if args.min_frequency < 1:
        raise InputError("--min-frequency must be at least 1")
    if args.type in ("char", "wordpiece"):
        args.special_tokens = vocab_builder.special_tokens(args.special_tokens)
        if args.type == "wordpiece" and args.vocab_size is None:
            raise InputError("--vocab-size is required for --type wordpiece")
        if args.vocab_size is not None and args.vocab_size <= len(args.special_tokens):
            raise InputError(
                f"--vocab-size {args.vocab_size} leaves no room after "
                f"{len(args.special_tokens)} special tokens"
            )
        return
    args.special_tokens = args.special_tokens or ["<|endoftext|>"]
    if args.vocab_size is None:
        raise InputError(f"--vocab-size is required for --type {args.type}")
    minimum = 256 + len(args.special_tokens)
    if args.vocab_size < minimum:
        raise InputError(f"--vocab-size must be at least {minimum} (256 bytes + special tokens)")


def train_char(docs: Iterator[str], args: argparse.Namespace, out: Path) -> list[Path]:
    return vocab_builder.train_char(
        docs,
        out,
        min_frequency=args.min_frequency,
        specials=args.special_tokens,
        lowercase=args.lowercase,
        max_size=args.vocab_size,
    )


def train_wordpiece(docs: Iterator[str], args: argparse.Namespace, out: Path) -> list[Path]:
    return vocab_builder.train_wordpiece(
        docs,
        out,
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        specials=args.special_tokens,
        lowercase=args.lowercase,
    )


def train_char_level(docs: Iterator[str], args: argparse.Namespace, out: Path) -> list[Path]:
    vocab = char_vocab(docs)
    path = out / "vocab.json"
    path.write_text(json.dumps(vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(vocab) - 1} characters + {CHAR_EOD}")
    return [path]


TRAINERS = {
    "bpe": train_bpe,
    "sentencepiece": train_sentencepiece,
    "char": train_char,
    "wordpiece": train_wordpiece,
    "char-level": train_char_level,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    try:
        _check(args)
        out.mkdir(parents=True, exist_ok=True)
        docs = iter_documents(args.input, args.json_keys)
        written = TRAINERS[args.type](docs, args, out)
    except InputError as err:
        parser.error(str(err))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
