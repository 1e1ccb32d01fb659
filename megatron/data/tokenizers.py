"""Text <-> token ids for pretraining, selected by Megatron's `--tokenizer-type` names.

Every tokenizer answers the same five questions: how many ids the model must embed
(`vocab_size`), which id ends a document (`eod`), and how to go text -> ids one document or a
batch at a time (`tokenize`, `tokenize_batch`) and back (`detokenize`). `tokenize` never adds
BOS/CLS/SEP: documents are delimited by `eod`, which the preprocessing tool appends itself.
`detokenize_window` decodes a few ids from the middle of a text (the incremental detokenizer
that streams a generation, megatron/inference/detokenizer.py).

A tokenizer pickles as its `build_args`, so a worker process rebuilds it from the same files
instead of receiving a copy of its tables.
"""

from __future__ import annotations

import functools
import itertools
import json
import numbers
import os
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from megatron.config.schema_data import TOKENIZER_TYPES  # declared once, with the flag
from megatron.data.char_tokenizer import CHAR_EOD
from megatron.data.fast_bpe import TiktokenBPE
from megatron.data.gpt2_files import builtin_gpt2_files
from megatron.data.text_pieces import WHITESPACE_CUT, encode_in_pieces
from megatron.data.wordpiece_text import join_wordpieces

HF_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
WHITESPACE_EOD_TOKENS = ("<eod>", "<|endoftext|>", "</s>", "<eos>")
# GPT-2 has no dropout and no unknown token (every byte has an id), and merges whole words even
# when a word is itself in the vocab (ignore_merges=False); older `tokenizers` ignore that kwarg.
GPT2_BPE_OPTIONS = dict(
    dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=False
)


class Tokenizer(ABC):
    """The interface the data pipeline and the model rely on.

    `vocab_size` is the number of ids the model must embed (max id + 1, before Megatron pads
    it); `eod` is the id appended after every document. `piece_cut`: where a long text may be
    cut without changing its ids (text_pieces), None where no place is known to be safe.
    """

    piece_cut: re.Pattern | None = None
    # A text whose ids detokenize_window puts before a window: set where detokenize treats the
    # start of a text specially (SentencePiece drops the leading spaces of its first pieces).
    window_anchor: str | None = None
    # Ids whose text may still change with the ids after them: HF's ByteFallback decoder
    # decodes a run of byte tokens (<0xE4>) as a whole, all U+FFFD if any of it is invalid.
    byte_run_ids: frozenset[int] = frozenset()
    # The most characters of text one id can stand for (byte-level BPE: its longest token's
    # bytes), so a text of more than n * max_token_chars characters has more than n ids.
    # None where one id may stand for any amount of text (an unknown-word id).
    max_token_chars: int | None = None

    def __init__(self, name: str, build_kwargs: dict, vocab_size: int, eod: int):
        self.name = name
        self._build_kwargs = {k: v for k, v in build_kwargs.items() if v is not None}
        self._vocab_size, self._eod = vocab_size, eod

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def build_args(self) -> tuple[str, dict]:
        """`(tokenizer_type, kwargs)` such that `build_tokenizer(t, **kwargs)` rebuilds self."""
        return self.name, dict(self._build_kwargs)

    def __reduce__(self):
        # Rebuild from the files in the receiving process: cheap, and works for every backend.
        return _rebuild, self.build_args

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str: ...

    def detokenize_window(self, ids: Sequence[int]) -> str:
        """`ids` decoded as they read in the middle of a text (after text that is not empty):
        what a text's start gets (SentencePiece drops its leading spaces) is left out. Only
        the difference between two windows that start at the same id means something."""
        if self.window_anchor is None:
            return self.detokenize(ids)
        head, skip = self._window_head
        return self.detokenize([*head, *ids])[skip:]

    @functools.cached_property
    def _window_head(self) -> tuple[list[int], int]:
        """The anchor's ids and the length of their text."""
        head = self.tokenize(self.window_anchor)
        return head, len(self.detokenize(head))

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many documents at once; backends with a native batch path override this."""
        return [self.tokenize(t) for t in texts]

    def tokenize_batch_arrays(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Many documents -> (all their ids as one int64 array, the number of ids of each). A
        document longer than text_pieces.PIECE_CHARS is encoded in pieces cut where
        `piece_cut` says the ids cannot change, so memory does not grow with the document."""
        return encode_in_pieces(self._encode_arrays, list(texts), self.piece_cut)

    def _encode_arrays(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        docs = self.tokenize_batch(texts)
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(
            itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lengths.sum())
        )
        return flat, lengths

    def __repr__(self) -> str:
        return f"{self.name}(vocab_size={self.vocab_size}, eod={self.eod})"


def _rebuild(name: str, kwargs: dict) -> Tokenizer:
    return build_tokenizer(name, **kwargs)


def _require_file(path, flag: str, tokenizer_type: str, what: str) -> str:
    """The path as a string, or an error that names the flag and says what to pass."""
    if path is None:
        raise ValueError(f"{flag} is required for --tokenizer-type {tokenizer_type}: pass {what}")
    if not os.path.isfile(path):
        problem = "is a directory" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"{flag} {path} {problem}: pass {what}")
    return str(path)


def _bad_file(flag: str, path: str, what: str, err: Exception) -> ValueError:
    return ValueError(f"{flag} {path}: cannot read it as {what} ({err}); check the file")


def _read_json_vocab(vocab_file, tokenizer_type: str, what: str) -> tuple[str, dict]:
    """(path, the JSON object in --vocab-file), or an error naming the file and `what` to pass."""
    path = _require_file(vocab_file, "--vocab-file", tokenizer_type, what)
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad_file("--vocab-file", path, "JSON", err) from err
    if not isinstance(vocab, dict):
        raise ValueError(f"--vocab-file {path}: pass {what}")
    return path, vocab


def _max_id_plus_one(vocab: dict[str, int]) -> int:
    # Ids need not be dense (added tokens may leave gaps): embed up to the largest one.
    return max(vocab.values()) + 1


class _HFBackedTokenizer(Tokenizer):
    """Shared code for tokenizers that run on HF `tokenizers` (Rust, multi-threaded batches)."""

    def __init__(self, name: str, build_kwargs: dict, tok: HFTokenizer, eod: int):
        super().__init__(name, build_kwargs, _max_id_plus_one(tok.get_vocab(True)), eod)
        self._tok = tok

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips offset tracking, which we never use.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_HFBackedTokenizer):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`; ids match Megatron-LM's.
    Neither file given: GPT-2's own, shipped in the package (megatron.data.gpt2_files).

    HF's BPE with GPT2_BPE_OPTIONS behind GPT-2's regex pre-tokenizer does what Megatron's
    pure-Python encoder does, in Rust and with a multi-threaded batch path.
    """

    piece_cut = WHITESPACE_CUT  # no pre-token spans a non-space -> space/newline boundary

    def __init__(self, vocab_file, merge_file):
        name = "GPT2BPETokenizer"
        if vocab_file is None and merge_file is None:  # GPT-2's own, shipped in the package
            vocab_file, merge_file = builtin_gpt2_files()
        vocab_file = _require_file(vocab_file, "--vocab-file", name, "GPT-2's vocab.json")
        merge_file = _require_file(merge_file, "--merge-file", name, "GPT-2's merges.txt")
        try:
            vocab, merges = models.BPE.read_file(vocab_file, merge_file)
        except Exception as err:
            files = f"{vocab_file} / --merge-file {merge_file}"
            raise _bad_file("--vocab-file", files, "a GPT-2 vocab.json/merges.txt", err) from err
        if "<|endoftext|>" not in vocab:
            raise ValueError(f"--vocab-file {vocab_file} has no <|endoftext|>: pass GPT-2's vocab")
        tok = HFTokenizer(models.BPE(vocab, merges, **GPT2_BPE_OPTIONS))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        kwargs = {"vocab_file": vocab_file, "merge_file": merge_file}
        super().__init__(name, kwargs, tok, vocab["<|endoftext|>"])
        # Byte-level: one character of a vocab entry is one byte, and a text character is at
        # least one byte.
        self.max_token_chars = max(len(token) for token in vocab)
        self._fast = TiktokenBPE.build(vocab, merges)
        self._fast_checked = False

    def _encode_arrays(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """tiktoken when it is installed and agrees with HF on the first batch; else HF."""
        if self._fast is None:
            return super()._encode_arrays(texts)
        flat, lengths = self._fast.encode_arrays(texts)
        if not self._fast_checked:
            ref_flat, ref_lengths = super()._encode_arrays(texts)
            if not (np.array_equal(flat, ref_flat) and np.array_equal(lengths, ref_lengths)):
                warnings.warn(
                    "tiktoken disagrees with HF tokenizers on this vocab; using HF "
                    "(slower, same ids as Megatron-LM)",
                    stacklevel=2,
                )
                self._fast = None
                return ref_flat, ref_lengths
            self._fast_checked = True
        return flat, lengths


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """Any `tokenizer.json` (a file or a directory holding one), loaded offline."""

    window_anchor = "a"  # its decoder may strip a text's start (Metaspace, Strip)

    def __init__(self, tokenizer_model):
        name = "HuggingFaceTokenizer"
        what = "a tokenizer.json file or a directory that holds one"
        if tokenizer_model is not None and os.path.isdir(tokenizer_model):
            tokenizer_model = os.path.join(tokenizer_model, "tokenizer.json")
        path = _require_file(tokenizer_model, "--tokenizer-model", name, what)
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as err:
            raise _bad_file("--tokenizer-model", path, "an HF tokenizer.json", err) from err
        found = [tok.token_to_id(t) for t in HF_EOD_TOKENS if tok.token_to_id(t) is not None]
        if not found:
            raise ValueError(
                f"--tokenizer-model {path}: none of the end-of-document tokens "
                f"{', '.join(HF_EOD_TOKENS)} is in its vocabulary; add one to the tokenizer"
            )
        super().__init__(name, {"tokenizer_model": path}, tok, found[0])
        if '"type": "ByteFallback"' in json.dumps(json.loads(tok.to_str()).get("decoder")):
            byte = re.compile(r"<0x[0-9A-Fa-f]{2}>")
            vocab = tok.get_vocab(True).items()
            self.byte_run_ids = frozenset(i for t, i in vocab if byte.fullmatch(t))


class BertWordPieceTokenizer(_HFBackedTokenizer):
    """BERT's WordPiece from `vocab.txt`; CJK characters become one token each.

    With a BERT-Chinese vocab this is the character-level GPT2-Chinese setup. `[SEP]` ends a
    document, as in Megatron.
    """

    piece_cut = WHITESPACE_CUT  # words never span whitespace

    def __init__(self, vocab_file, lowercase: bool):
        name = "BertWordPieceLowerCase" if lowercase else "BertWordPieceCase"
        vocab_file = _require_file(vocab_file, "--vocab-file", name, "a BERT vocab.txt")
        try:
            vocab = models.WordPiece.read_file(vocab_file)
        except Exception as err:
            raise _bad_file("--vocab-file", vocab_file, "a BERT vocab.txt", err) from err
        missing = [t for t in ("[UNK]", "[SEP]") if t not in vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file} lacks {missing}: pass a BERT vocab.txt")
        tok = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, handle_chinese_chars=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        super().__init__(name, {"vocab_file": vocab_file}, tok, vocab["[SEP]"])

    def detokenize(self, ids: Iterable[int]) -> str:
        to_token = self._tok.id_to_token
        return join_wordpieces(to_token(int(i)) or "[UNK]" for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` (Llama-style); `sentencepiece` is needed only for this type."""

    window_anchor = "a"  # decode drops the leading '▁' of a text's first pieces

    def __init__(self, tokenizer_model):
        name = "SentencePieceTokenizer"
        path = _require_file(tokenizer_model, "--tokenizer-model", name, "a SentencePiece .model")
        spm = _import_sentencepiece()
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as err:
            raise _bad_file("--tokenizer-model", path, "a SentencePiece model", err) from err
        eod = self._find_eod(path)
        super().__init__(name, {"tokenizer_model": path}, self._sp.get_piece_size(), eod)

    def _find_eod(self, path: str) -> int:
        if self._sp.eos_id() >= 0:
            return self._sp.eos_id()
        for piece in ("</s>", "<|endoftext|>"):
            # piece_to_id maps unknown pieces to <unk>, so check the round trip.
            i = self._sp.piece_to_id(piece)
            if self._sp.id_to_piece(i) == piece:
                return i
        raise ValueError(
            f"--tokenizer-model {path} has no eos id and no </s> or <|endoftext|> piece; "
            "retrain it with an eos piece (tools/train_tokenizer.py does)"
        )

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))  # one C++ call for the whole batch

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as err:
        raise ImportError(
            "--tokenizer-type SentencePieceTokenizer needs the sentencepiece package: "
            "pip install sentencepiece"
        ) from err
    return sentencepiece


class NullTokenizer(Tokenizer):
    """Text is already ids ("3 17 4"); eod is one past the vocab, as in Megatron."""

    piece_cut = WHITESPACE_CUT  # ids are whitespace-separated

    def __init__(self, vocab_size):
        if not isinstance(vocab_size, numbers.Integral) or vocab_size < 1:
            raise ValueError(
                "--vocab-size must be a positive integer for --tokenizer-type NullTokenizer, "
                f"got {vocab_size!r}"
            )
        self._n = n = int(vocab_size)
        super().__init__("NullTokenizer", {"vocab_size": n}, vocab_size=n + 1, eod=n)

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer: {word!r} is not an integer id") from None
            if not 0 <= i < self._n:
                raise ValueError(f"NullTokenizer: id {i} is outside [0, --vocab-size {self._n})")
            ids.append(i)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class WhitespaceTokenizer(Tokenizer):
    """Word-level: a JSON vocab {token: id}, words split on whitespace, `<unk>` for the rest.

    This is the ASC/Yuan setup, where the corpus is already segmented into words.
    """

    piece_cut = WHITESPACE_CUT

    def __init__(self, vocab_file):
        name = "WhitespaceTokenizer"
        what = "a JSON object {token: id} with <unk> and an end-of-text token"
        path, vocab = _read_json_vocab(vocab_file, name, what)
        if not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
            raise ValueError(f"--vocab-file {path}: pass {what} (ids non-negative integers)")
        eod_token = next((t for t in WHITESPACE_EOD_TOKENS if t in vocab), None)
        if "<unk>" not in vocab or eod_token is None:
            raise ValueError(
                f"--vocab-file {path} needs <unk> and one of {', '.join(WHITESPACE_EOD_TOKENS)}"
            )
        super().__init__(name, {"vocab_file": path}, _max_id_plus_one(vocab), vocab[eod_token])
        self._vocab, self._unk = vocab, vocab["<unk>"]
        self._inv = {i: t for t, i in vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return [self._vocab.get(w, self._unk) for w in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        try:
            return " ".join(self._inv[int(i)] for i in ids)
        except KeyError as err:
            raise ValueError(f"WhitespaceTokenizer: id {err.args[0]} is not in the vocab") from None


class CharTokenizer(Tokenizer):
    """Every character a token (nanoGPT's shakespeare_char), from a JSON {char: id} vocab."""

    piece_cut = WHITESPACE_CUT  # any cut between characters keeps the ids

    def __init__(self, vocab_file):
        name = "CharTokenizer"
        what = "a JSON {character: id} with <|endoftext|> (train_tokenizer.py --type char-level)"
        path, vocab = _read_json_vocab(vocab_file, name, what)
        if CHAR_EOD not in vocab:
            raise ValueError(f"--vocab-file {path}: pass {what}")
        bad = [t for t, i in vocab.items() if not (isinstance(i, int) and i >= 0)]
        bad += [t for t in vocab if len(t) != 1 and t != CHAR_EOD]
        if bad:
            raise ValueError(
                f"--vocab-file {path}: {bad[0]!r} is not one character with an id >= 0; pass {what}"
            )
        super().__init__(name, {"vocab_file": path}, _max_id_plus_one(vocab), vocab[CHAR_EOD])
        self._path, self._vocab = path, vocab
        self._inv = {i: t for t, i in vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        try:
            return [self._vocab[c] for c in text]
        except KeyError as err:
            c = err.args[0]
            raise ValueError(
                f"CharTokenizer: character {c!r} (U+{ord(c):04X}, at offset {text.index(c)}) is "
                f"not in --vocab-file {self._path}; rebuild it from a corpus that has it "
                "(tools/train_tokenizer.py --type char-level)"
            ) from None

    def detokenize(self, ids: Iterable[int]) -> str:
        try:
            return "".join(self._inv[int(i)] for i in ids)
        except KeyError as err:
            raise ValueError(f"CharTokenizer: id {err.args[0]} is not in the vocab") from None


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer for `--tokenizer-type`; arguments a type does not use are ignored."""
    as_str = lambda p: None if p is None else os.fspath(Path(p))
    vocab_file, merge_file, tokenizer_model = map(as_str, (vocab_file, merge_file, tokenizer_model))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(vocab_file, lowercase=tokenizer_type.endswith("LowerCase"))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "WhitespaceTokenizer":
        return WhitespaceTokenizer(vocab_file)
    if tokenizer_type == "CharTokenizer":
        return CharTokenizer(vocab_file)
    valid = ", ".join(TOKENIZER_TYPES)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is unknown; choose one of {valid}")
