"""Loose JSON corpora tokenized once into `--cache-dir`, then read as mmap datasets.

A corpus (megatron/data/corpora.py) is tokenized by tools/preprocess_data.py's own pipeline
(megatron/data/preprocess.py) into one cache entry:

    CACHE_DIR/loose_json/NAME-<hash of the source paths and options>/
        NAME-<build digest>_text_document.bin/.idx   (or _sentence with --presplit-sentences)
        manifest.json                                 sources (path, size, mtime), tokenizer, counts

An entry is reused while every source file keeps its size and mtime and the tokenizer (its type
and the bytes of its files) is the same; otherwise it is rebuilt, saying why. A build writes
into a temporary directory that is renamed into place only when it is complete, so a failed
build (a bad record, a full disk) leaves no entry, and a stale entry is replaced in one rename.
The file prefix carries a digest of the build, so the sample indices cached for an older build
are never mistaken for this one's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from megatron.config.declare import ConfigError
from megatron.config.schema_data import DataConfig, TokenizerConfig
from megatron.data import preprocess
from megatron.data.corpora import Corpus, resolve_corpora
from megatron.data.indexed_dataset import MMapIndexedDataset, dataset_exists
from megatron.data.preprocess_inputs import expand_inputs
from megatron.fileio import probe_writable

CACHE_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CacheSpec:
    """Everything that decides the tokens of a cached corpus (besides the sources' bytes)."""

    root: str  # --cache-dir
    tokenizer: TokenizerConfig
    vocab_size: int | None  # for the NullTokenizer
    text_key: str = "text"
    presplit_sentences: bool = False
    workers: int = 1

    @property
    def level(self) -> str:
        return "sentence" if self.presplit_sentences else "document"


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _file_digest(path: str) -> str:
    h = hashlib.sha1()
    paths = [path]
    if os.path.isdir(path):
        paths = sorted(os.path.join(path, f) for f in os.listdir(path))
    for p in paths:
        if os.path.isfile(p):
            with open(p, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def _tokenizer_files_key(spec: CacheSpec) -> dict:
    """The tokenizer's type and the content digests of its files: the cache key's tokenizer
    part. Not dataset_pair.tokenizer_fingerprint (the ids of a probe text, which the entry's
    sidecar records too): a cache is rebuilt on any change to the files, even one the probe
    text does not show (an added token)."""
    t = spec.tokenizer
    files = {k: v for k, v in t.kwargs().items() if v is not None}
    out = {"type": t.tokenizer_type, "files": {k: _file_digest(v) for k, v in files.items()}}
    if t.tokenizer_type == "NullTokenizer":
        out["vocab_size"] = spec.vocab_size
    return out


def source_stats(corpus: Corpus) -> list[list]:
    """[[absolute path, size, mtime_ns]] of every file of the corpus, in reading order."""
    try:
        files = expand_inputs(list(corpus.paths))
    except FileNotFoundError as e:
        raise ConfigError(f"corpus {corpus.name!r}: {e}") from None
    return [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in files]


def entry_dir(spec: CacheSpec, corpus: Corpus) -> str:
    paths = sorted(os.path.abspath(p) for p in corpus.paths)
    key = _digest([CACHE_VERSION, paths, spec.text_key, spec.presplit_sentences])
    return os.path.join(spec.root, "loose_json", f"{corpus.name}-{key}")


def _wanted_manifest(spec: CacheSpec, corpus: Corpus) -> dict:
    return {
        "version": CACHE_VERSION,
        "corpus": corpus.name,
        "sources": source_stats(corpus),
        "tokenizer": _tokenizer_files_key(spec),
        "text_key": spec.text_key,
        "level": spec.level,
    }


def _read_manifest(entry: str) -> dict | None:
    try:
        with open(os.path.join(entry, MANIFEST), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stale_reasons(old: dict, new: dict) -> list[str]:
    """Why a cached entry no longer matches its sources or tokenizer (empty: reusable)."""
    if old.get("version") != new["version"] or old.get("level") != new["level"]:
        return ["the cache format changed"]
    reasons = []
    before = {p: (size, mtime) for p, size, mtime in old.get("sources", [])}
    now = {p: (size, mtime) for p, size, mtime in new["sources"]}
    for path in sorted(set(before) | set(now)):
        if path not in now:
            reasons.append(f"{path} is gone")
        elif path not in before:
            reasons.append(f"{path} is new")
        elif before[path][0] != now[path][0]:
            reasons.append(f"{path} changed size ({before[path][0]} -> {now[path][0]} bytes)")
        elif before[path][1] != now[path][1]:
            reasons.append(f"{path} was modified (mtime changed)")
    if old.get("tokenizer") != new["tokenizer"]:
        reasons.append(f"the tokenizer changed ({new['tokenizer']['type']} or its files)")
    return reasons


def cached_prefix(spec: CacheSpec, corpus: Corpus) -> tuple[str | None, list[str]]:
    """(prefix of a reusable entry or None, why the existing entry is stale)."""
    entry = entry_dir(spec, corpus)
    old = _read_manifest(entry)
    if old is None:
        return None, []
    reasons = stale_reasons(old, _wanted_manifest(spec, corpus))
    if reasons:
        return None, reasons
    return os.path.join(entry, old["prefix"]), []


class CorpusError(ValueError):
    """A corpus that cannot be tokenized (bad records, unreadable files); nothing was cached."""


class _Tee(io.TextIOBase):
    """Writes through to a stream and keeps the lines, to quote preprocessing's report."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []

    def write(self, s: str) -> int:
        self.stream.write(s)
        self.lines.extend(s.splitlines())
        return len(s)

    def flush(self) -> None:
        self.stream.flush()


def check_writable(root: str) -> None:
    """Fail before any work when the cache directory cannot take files."""
    where = os.path.join(root, "loose_json")
    try:
        probe_writable(where)
    except OSError as e:
        raise ConfigError(
            f"--cache-dir {root}: cannot write the tokenized corpora there ({e.strerror or e}). "
            "Fix: pass a writable --cache-dir (one every node can read)"
        ) from None


def _preprocess_argv(spec: CacheSpec, corpus: Corpus, prefix: str) -> list[str]:
    t = spec.tokenizer
    argv = ["--input", *corpus.paths, "--json-keys", spec.text_key, "--output-prefix", prefix]
    argv += ["--tokenizer-type", t.tokenizer_type, "--workers", str(spec.workers)]
    for flag, value in (
        ("--vocab-file", t.vocab_file),
        ("--merge-file", t.merge_file),
        ("--tokenizer-model", t.tokenizer_model),
        ("--vocab-size", spec.vocab_size if t.tokenizer_type == "NullTokenizer" else None),
    ):
        if value is not None:
            argv += [flag, str(value)]
    # GPT samples cross documents at the end-of-document token; sentences keep their
    # document boundaries in the index instead (what BERT's sentence pairs need).
    argv.append("--presplit-sentences" if spec.presplit_sentences else "--append-eod")
    return argv + ["--log-interval", "1000000"]


def _tokenize(spec: CacheSpec, corpus: Corpus, prefix: str) -> str:
    """Run tools/preprocess_data.py's pipeline; the written prefix, or CorpusError."""
    args = preprocess.build_parser().parse_args(_preprocess_argv(spec, corpus, prefix))
    tee = _Tee(sys.stderr)
    with contextlib.redirect_stderr(tee):
        status = preprocess.run(args)
    if status != 0:
        bad = [line[12:] for line in tee.lines if line.startswith("bad record: ")]
        raise CorpusError(
            f"corpus {corpus.name!r}: {len(bad)} bad record(s), nothing was cached: "
            + "; ".join(bad[:5])
            + f". Fix: correct them (each record needs a string under --text-key {spec.text_key})"
        )
    return f"{prefix}_{spec.text_key}_{spec.level}"


def _swap_in(tmp: str, entry: str) -> None:
    """Replace `entry` by the complete directory `tmp` (a stale entry goes in one rename)."""
    if not os.path.exists(entry):
        os.rename(tmp, entry)
        return
    old = f"{entry}.old-{os.getpid()}"
    os.rename(entry, old)
    os.rename(tmp, entry)
    shutil.rmtree(old, ignore_errors=True)


def build_entry(spec: CacheSpec, corpus: Corpus) -> str:
    """Tokenize a corpus into its cache entry (replacing a stale one); its prefix."""
    manifest = _wanted_manifest(spec, corpus)
    entry = entry_dir(spec, corpus)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(entry)}.tmp-", dir=os.path.dirname(entry))
    try:
        written = _tokenize(spec, corpus, os.path.join(tmp, f"{corpus.name}-{_digest(manifest)}"))
        if source_stats(corpus) != manifest["sources"]:
            raise CorpusError(
                f"corpus {corpus.name!r} changed while it was being tokenized; nothing was "
                "cached. Fix: run again once its files are complete"
            )
        ds = MMapIndexedDataset(written)
        manifest.update(
            prefix=os.path.basename(written),
            documents=len(ds.doc_idx) - 1,
            sequences=len(ds),
            tokens=int(ds.sizes.sum()),
        )
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _swap_in(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(entry, manifest["prefix"])


def ensure_cached(spec: CacheSpec, corpus: Corpus, log=print) -> tuple[str, int]:
    """(prefix, token count) of a corpus's cache entry, built or rebuilt when needed."""
    prefix, reasons = cached_prefix(spec, corpus)
    if prefix is None:
        entry = entry_dir(spec, corpus)
        if reasons:
            log(f"loose JSON: rebuilding {entry}: {'; '.join(reasons)}")
        else:
            log(f"loose JSON: tokenizing corpus {corpus.name!r} into {entry} (once)")
        prefix = build_entry(spec, corpus)
    else:
        log(f"loose JSON: reusing {prefix} for corpus {corpus.name!r}")
    return prefix, int(_read_manifest(os.path.dirname(prefix))["tokens"])


_FLAGS = (
    ("--train-data", "train_data"),
    ("--valid-data", "valid_data"),
    ("--test-data", "test_data"),
)


def _spec(data: DataConfig, vocab_size: int | None) -> CacheSpec:
    lj = data.loose_json
    workers = max(1, min(8, (os.cpu_count() or 2) - 1))
    return CacheSpec(
        data.tokenizer.cache_dir,
        data.tokenizer,
        vocab_size,
        lj.text_key,
        lj.presplit_sentences,
        workers,
    )


def build_all(data: DataConfig, vocab_size: int | None, log=print) -> dict[str, list]:
    """{field: [[prefix, weight], ...]} for each of --train/valid/test-data that is given; a
    corpus without a weight is weighted by its token count (the builder rank runs this)."""
    spec = _spec(data, vocab_size)
    lj = data.loose_json
    named = {
        field: resolve_corpora(getattr(lj, field), flag, lj.corpora_file)
        for flag, field in _FLAGS
        if getattr(lj, field)
    }
    check_writable(spec.root)
    out = {}
    for field, corpora in named.items():
        out[field] = []
        for corpus in corpora:
            prefix, tokens = ensure_cached(spec, corpus, log)
            weight = corpus.weight if corpus.weight is not None else float(tokens)
            out[field].append([prefix, weight])
    return out


def _blend_values(members: list) -> tuple[str, ...]:
    if len(members) == 1:
        return (members[0][0],)
    return tuple(v for prefix, weight in members for v in (repr(float(weight)), prefix))


def with_cached_prefixes(data: DataConfig, built: dict[str, list]) -> DataConfig:
    """The DataConfig that trains from the cache: --train-data alone acts as --data-path
    (split by --split); with --valid-data/--test-data each acts as its --*-data-path."""
    for members in built.values():
        for prefix, _ in members:
            if not dataset_exists(prefix):
                raise CorpusError(
                    f"{prefix}.bin/.idx: written by rank 0 but not visible here. Fix: put "
                    f"--cache-dir {data.tokenizer.cache_dir} on a filesystem every node shares"
                )
    if set(built) == {"train_data"}:
        return dataclasses.replace(data, data_path=_blend_values(built["train_data"]))
    return dataclasses.replace(
        data,
        **{f"{field}_path": _blend_values(m) for field, m in built.items()},
    )


def prepare_loose_json(
    data: DataConfig,
    vocab_size: int | None,
    *,
    is_builder: bool,
    share: Callable[[dict | None], dict],
    log=print,
) -> DataConfig:
    """Tokenize the --train/valid/test-data corpora once (on the builder rank) and return the
    DataConfig that reads them. `share(status)`: the builder's status dict sent to every rank
    (the builder passes it, the others pass None and receive it)."""
    if not data.loose_json.given:
        return data
    status, error = None, None
    if is_builder:
        try:
            status = {"ok": build_all(data, vocab_size, log)}
        except (ValueError, OSError) as e:
            status, error = {"error": str(e)}, e
    status = share(status)
    if error is not None:
        raise error
    if "error" in status:
        raise CorpusError(f"rank 0 could not prepare the corpora: {status['error']}")
    return with_cached_prefixes(data, status["ok"])
