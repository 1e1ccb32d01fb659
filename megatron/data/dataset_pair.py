"""PREFIX.idx.json: the record that ties a `.bin` to its `.idx`, so a mixed pair is refused.

Megatron's `.idx` header has no room for a pair id and its `.bin` has no header at all, and our
files must stay byte for byte Megatron's (FORMATS.md). So the tie lives in a sidecar beside them:

    {"format": "megatron-dataset-pair", "version": 1, "pair_id": "<random hex>",
     "bin": {"bytes": 19187294, "digest": "<sampled blake2b>"}, "idx": {...},
     "sequences": N, "documents": D, "dtype": "uint16",
     "max_token_id": 50256, "tokenizer": {...}}          (the last two from preprocessing)

A writer makes a new pair visible with `commit_pair`: every file complete and fsynced under a
temporary name, then the sidecar renamed first, the `.bin` next and the `.idx` last. A kill at
any point leaves either the old, consistent trio, or a sidecar that does not match the files
beside it, which `verify_pair` (called by both readers at open) refuses naming both files.
Datasets without a sidecar (Megatron-LM's own, older runs') open as before.

The digest is a hash of the size and 64 KiB spread over the file (its first and last 16 KiB
and 48 blocks of 1 KiB between), so opening costs the same whatever the corpus size; a `.bin`
or `.idx` from another run differs in those bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

from megatron.fileio import fsync_path

SIDECAR_SUFFIX = ".idx.json"
FORMAT = "megatron-dataset-pair"
VERSION = 1
_EDGE, _BLOCK, _BLOCKS = 16 << 10, 1 << 10, 48


class PairMismatch(ValueError):
    """A .bin and .idx that were not written together."""


def sidecar_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}{SIDECAR_SUFFIX}"


def file_digest(path: str | os.PathLike) -> str:
    """blake2b of the file's size and 64 KiB sampled from its start, end and between."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= 2 * _EDGE + _BLOCK * _BLOCKS:
            h.update(f.read())
            return h.hexdigest()
        starts = [0, size - _EDGE]
        starts += [_EDGE + (size - 2 * _EDGE) * i // _BLOCKS for i in range(_BLOCKS)]
        for start in sorted(starts):
            f.seek(start)
            h.update(f.read(_EDGE if start in (0, size - _EDGE) else _BLOCK))
    return h.hexdigest()


def _describe(path: str) -> dict:
    return {"bytes": os.path.getsize(path), "digest": file_digest(path)}


def commit_pair(prefix: str, bin_tmp: str, idx_tmp: str, **facts) -> dict:
    """Rename the finished temporary files to PREFIX.bin/.idx (sidecar first, .idx last);
    `facts` (sequences, tokenizer, ...) go into the sidecar. Returns the sidecar's record."""
    record = {
        "format": FORMAT,
        "version": VERSION,
        "pair_id": uuid.uuid4().hex,
        "bin": _describe(bin_tmp),
        "idx": _describe(idx_tmp),
        **facts,
    }
    side_tmp = sidecar_path(prefix) + bin_tmp[bin_tmp.rindex(".tmp-") :]
    with open(side_tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    for path in (bin_tmp, idx_tmp, side_tmp):
        fsync_path(path)
    os.replace(side_tmp, sidecar_path(prefix))
    os.replace(bin_tmp, f"{prefix}.bin")
    os.replace(idx_tmp, f"{prefix}.idx")
    fsync_path(os.path.dirname(os.path.abspath(prefix)))
    return record


def read_record(prefix: str | os.PathLike) -> dict | None:
    """The sidecar's record, or None when there is none (a dataset written without one)."""
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise PairMismatch(
            f"{path}: unreadable ({e}); it records which {prefix}.bin and {prefix}.idx belong "
            "together. Fix: run the preprocessing again (or delete it to open the pair unchecked)"
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise PairMismatch(f"{path}: not a {FORMAT} record; delete it or rerun preprocessing")
    return record


def verify_pair(prefix: str | os.PathLike) -> dict | None:
    """Refuse a .bin/.idx that the sidecar says were not written together; returns the record
    (None without a sidecar). Call it after checking both files exist."""
    record = read_record(prefix)
    if record is None:
        return None
    wrong = []
    for ext in ("bin", "idx"):
        path, want = f"{prefix}.{ext}", record.get(ext) or {}
        size = os.path.getsize(path)
        if size != want.get("bytes"):
            wrong.append(f"{path} has {size} bytes, the pair's .{ext} had {want.get('bytes')}")
        elif file_digest(path) != want.get("digest"):
            wrong.append(f"{path} has other contents than the pair's .{ext}")
    if wrong:
        raise PairMismatch(
            f"{prefix}.bin and {prefix}.idx do not belong together: {'; '.join(wrong)} "
            f"(recorded in {sidecar_path(prefix)}, pair {record.get('pair_id')}). This is "
            "what an interrupted tools/preprocess_data.py rerun leaves (a new .bin beside an "
            "old .idx). Fix: run the preprocessing to completion again; if you replaced the "
            f"files with another tool on purpose, delete {sidecar_path(prefix)}"
        )
    return record


# Tokenizer fingerprints: what the ids of a fixed text are, so data made with another tokenizer
# of the same vocab size is caught (a retrained BPE, another language's SentencePiece). Two
# tokenizers that give the same ids (GPT-2 through tiktoken or HF tokenizer.json) agree.
_PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{} 'quotes' \"too\"\n"
    "\tdef f(x):\n        return x ** 2  # a comment\n"
    "Ünïcödé café naïve façade — “curly” … ¿qué? 分布式训练 日本語 한국어 🚀\n"
)


def tokenizer_fingerprint(tokenizer) -> dict:
    """{"type", "vocab_size", "eod", "probe"}: probe is a digest of the ids of a fixed text
    (None where the tokenizer cannot read text, e.g. NullTokenizer's ids)."""
    try:
        ids = [int(i) for i in tokenizer.tokenize(_PROBE)]
        probe = hashlib.blake2b(json.dumps(ids).encode(), digest_size=8).hexdigest()
    except (ValueError, KeyError, TypeError):
        probe = None
    return {
        "type": type(tokenizer).__name__,
        "vocab_size": int(tokenizer.vocab_size),
        "eod": None if tokenizer.eod is None else int(tokenizer.eod),
        "probe": probe,
    }


def tokenizer_mismatch(recorded: dict | None, current: dict | None) -> str | None:
    """Why data tokenized as `recorded` does not fit the `current` tokenizer, or None.

    Only tokenizers that read text are compared (NullTokenizer's ids have no probe; the largest
    id is checked against the vocab instead). Another vocab size with the same ids and
    end-of-document id (added or padded entries) still fits."""
    if not recorded or not current or not recorded.get("probe") or not current.get("probe"):
        return None
    if recorded["probe"] != current["probe"]:
        return (
            f"other ids for the same text: fingerprint {recorded['probe']} (vocab "
            f"{recorded.get('vocab_size')}) at preprocessing, {current['probe']} (vocab "
            f"{current.get('vocab_size')}) now"
        )
    if recorded.get("eod") != current.get("eod"):
        return f"end-of-document id {recorded.get('eod')} at preprocessing, {current['eod']} now"
    return None
