"""tools/preprocess_data.py: text corpora -> Megatron mmap datasets (PREFIX_{key}_document.*).

Pipeline: the main process streams raw records in chunks of a few MB (preprocess_inputs) ->
workers decode, check and batch-tokenize a whole chunk at a time (HF tokenizers' Rust batch
encoder) and return flat numpy arrays -> the main process appends them in input order. At most
2 chunks per worker are in flight, so memory stays flat for any corpus size. Outputs are written
under temporary names and renamed only when the whole run succeeded.

Workers are plain processes, each returning results over its own pipe, and the main process
waits on those pipes and on the processes themselves: a worker that dies (the OOM killer's
SIGKILL) fails the run at once with a message naming it. (multiprocessing.Pool silently
replaces a dead worker and waits forever for the result it took with it.) Ctrl-C (SIGINT to
the whole process group) and SIGTERM (to the main process, or to the group, as `timeout` and
Slurm send it) are the main process's alone: the workers ignore both, and the main process
stops them, removes its temporary files and exits 130 (SIGINT) or 143 (SIGTERM) with one line.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from megatron.config.declare import section_from_args
from megatron.config.schema_data import TokenizerConfig
from megatron.data.dataset_pair import tokenizer_fingerprint
from megatron.data.preprocess_args import build_parser
from megatron.data.preprocess_inputs import (
    TEXT,
    BadRecord,
    Chunk,
    ProgressFile,
    decode_record,
    expand_inputs,
    input_kind,
    input_size,
    read_chunks,
    split_sentences,
)
from megatron.data.preprocess_outputs import (
    Outputs,
    OutputWriteError,
    token_dtype,
)
from megatron.data.tokenizers import build_tokenizer
from megatron.progress import Progress, is_terminal

_MAX_REPORTED = 20


@dataclass
class KeyResult:
    tokens: np.ndarray  # all documents' tokens, flat
    seq_lengths: np.ndarray  # int32, one per sequence
    seqs_per_doc: np.ndarray  # int32, one per kept document
    empty: int  # documents dropped because they have no tokens


@dataclass
class ChunkResult:
    bad: list[BadRecord]
    per_key: dict[str, KeyResult] = field(default_factory=dict)
    documents: int = 0
    blank_lines: int = 0  # of a one-document-per-line input, left out by the reader


_TOKENIZER = None
_OPTIONS: dict = {}


def _init_worker(tokenizer_type: str, tokenizer_kwargs: dict, options: dict) -> None:
    global _TOKENIZER, _OPTIONS
    _TOKENIZER = build_tokenizer(tokenizer_type, **tokenizer_kwargs)
    _OPTIONS = options


def encode_chunk(chunk: Chunk) -> ChunkResult:
    """Decode, check and tokenize one chunk (runs in a worker)."""
    keys, dtype = _OPTIONS["keys"], _OPTIONS["dtype"]
    result = ChunkResult(bad=list(chunk.bad), blank_lines=chunk.blank_lines)
    docs: dict[str, list[str]] = {k: [] for k in keys}
    for line, payload in chunk.items:
        record, reason = decode_record(chunk.kind, payload, keys)
        if reason is not None:
            result.bad.append(BadRecord(chunk.path, line, reason))
            continue
        for k in keys:
            docs[k].append(record[k])
    result.documents = len(docs[keys[0]])
    for k in keys:
        result.per_key[k] = _tokenize_docs(docs[k], dtype)
    return result


def _tokenize_docs(texts: list[str], dtype) -> KeyResult:
    """Tokenize a batch of documents into flat arrays; drop empty sequences and documents, and
    append the end-of-document id after each document's last sequence."""
    tok = _TOKENIZER
    if _OPTIONS["split_sentences"]:
        if _OPTIONS.get("presplit_sentences"):  # the corpus has one sentence per line
            sentences = [[s for s in t.split("\n") if s.strip()] for t in texts]
        else:
            sentences = [split_sentences(t, _OPTIONS["keep_newlines"]) for t in texts]
        per_doc = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
        flat, seq_len = tok.tokenize_batch_arrays(list(itertools.chain.from_iterable(sentences)))
    else:
        per_doc = np.ones(len(texts), dtype=np.int64)
        flat, seq_len = tok.tokenize_batch_arrays(texts)
    doc_of_seq = np.repeat(np.arange(len(texts)), per_doc)
    keep = seq_len > 0
    seq_len, doc_of_seq = seq_len[keep], doc_of_seq[keep]
    seqs_per_doc = np.bincount(doc_of_seq, minlength=len(texts))
    seqs_per_doc = seqs_per_doc[seqs_per_doc > 0]
    flat = flat.astype(dtype, copy=False)  # before the insert: a copy of the narrow ids only
    if _OPTIONS["append_eod"] and len(seq_len):
        last = np.cumsum(seqs_per_doc) - 1  # each kept document's last sequence
        flat = np.insert(flat, np.cumsum(seq_len)[last], tok.eod)
        seq_len = seq_len.copy()
        seq_len[last] += 1
    return KeyResult(
        tokens=flat,
        seq_lengths=seq_len.astype(np.int32),
        seqs_per_doc=seqs_per_doc.astype(np.int32),
        empty=len(texts) - len(seqs_per_doc),
    )


class WorkerDied(RuntimeError):
    """A tokenizer worker ended while the run still needed it; its results are lost."""


def _worker_main(init_args: tuple, tasks, conn) -> None:
    """A worker: encode (index, chunk) tasks until a None arrives; send (index, result, error)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the main process stops us (module docstring)
    try:
        _init_worker(*init_args)
    except Exception as e:  # noqa: BLE001 - reported to the main process, which re-raises it
        _send(conn, None, None, e)
        return
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the main process died (no one will read the results): do not linger
            continue
        if task is None:
            return
        index, chunk = task
        try:
            result, error = encode_chunk(chunk), None
        except Exception as e:  # noqa: BLE001 - as above
            result, error = None, e
        _send(conn, index, result, error)


def _send(conn, index, result, error) -> None:
    try:
        conn.send((index, result, error))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: send its traceback
        conn.send((index, None, RuntimeError("".join(traceback.format_exception(error)))))


class _Workers:
    """`workers` spawned tokenizer processes sharing one task queue, each with its own result
    pipe. The main process holds no write end of those pipes, so a worker's death shows up as
    its pipe's EOF and its process sentinel, whichever `wait` sees first."""

    def __init__(self, workers: int, init_args: tuple):
        ctx = mp.get_context("spawn")
        self.tasks = ctx.Queue()
        self.procs, self.conns = [], []
        # An ignored SIGINT survives exec and Python then installs no KeyboardInterrupt handler:
        # a Ctrl-C reaches the workers too (the whole process group), and must not print their
        # tracebacks; the main process stops them.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for _ in range(workers):
                receive, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker_main, args=(init_args, self.tasks, send), daemon=True
                )
                proc.start()
                send.close()
                self.procs.append(proc)
                self.conns.append(receive)
        finally:
            signal.signal(signal.SIGINT, previous)

    def submit(self, index: int, chunk: Chunk) -> None:
        self.tasks.put((index, chunk))

    def collect(self) -> dict[int, ChunkResult]:
        """Block until results arrive; raise the worker's exception, or WorkerDied."""
        ready = multiprocessing.connection.wait(self.conns + [p.sentinel for p in self.procs])
        results = {}
        for i, conn in enumerate(self.conns):
            if conn in ready:
                try:
                    index, result, error = conn.recv()
                except (EOFError, OSError):
                    raise self._died(i) from None
                if error is not None:
                    raise error
                results[index] = result
        for i, proc in enumerate(self.procs):
            if proc.sentinel in ready:  # a worker only exits when close() tells it to
                raise self._died(i)
        return results

    def _died(self, i: int) -> WorkerDied:
        proc = self.procs[i]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (what the out-of-memory killer sends: lower --workers or --chunk-bytes)"
        else:
            how = f"exited with status {code}"
        return WorkerDied(
            f"tokenizer worker {i + 1} of {len(self.procs)} (pid {proc.pid}) {how} while "
            "chunks were in flight; stopping, no output was written"
        )

    def close(self, graceful: bool) -> None:
        """Stop the workers: let them finish (after a successful run) or terminate them."""
        if graceful:
            for _ in self.procs:
                self.tasks.put(None)
        for proc in self.procs:
            if graceful:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()  # SIGKILL: the workers ignore SIGTERM
            proc.join(timeout=10)
        # Tasks still buffered for dead workers must not block this process's exit.
        self.tasks.cancel_join_thread()
        self.tasks.close()
        for conn in self.conns:
            conn.close()


def _encode_in_order(chunks, workers: int, init_args):
    """Yield encode_chunk results in input order, with at most 2 chunks per worker in flight."""
    if workers <= 1:
        _init_worker(*init_args)
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    pool = _Workers(workers, init_args)
    finished = False
    try:
        chunks = iter(chunks)
        submitted = yielded = 0
        done: dict[int, ChunkResult] = {}
        more = True
        while True:
            while more and submitted - yielded < 2 * workers:
                chunk = next(chunks, None)
                if chunk is None:
                    more = False
                else:
                    pool.submit(submitted, chunk)
                    submitted += 1
            if yielded == submitted:
                break
            while yielded not in done:
                done.update(pool.collect())
            yield done.pop(yielded)
            yielded += 1
        finished = True
    finally:
        pool.close(graceful=finished)


@dataclass
class Stats:
    documents: int = 0
    empty: int = 0
    blank_lines: int = 0
    tokens: int = 0
    bad: list[BadRecord] = field(default_factory=list)
    bad_count: int = 0
    start: float = field(default_factory=time.monotonic)

    def add(self, result: ChunkResult, first_key: str) -> None:
        r = result.per_key.get(first_key)
        self.documents += len(r.seqs_per_doc) if r is not None else 0
        self.empty += r.empty if r is not None else 0
        self.blank_lines += result.blank_lines
        self.tokens += int(sum(len(x.tokens) for x in result.per_key.values()))
        self.bad_count += len(result.bad)
        self.bad.extend(result.bad[: max(0, _MAX_REPORTED - len(self.bad))])


def _progress_line(stats: Stats, read: int, total: int) -> str:
    elapsed = max(time.monotonic() - stats.start, 1e-9)
    rate = read / elapsed / 1e6
    eta = (total - read) / (read / elapsed) if read else float("nan")
    eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
    return (
        f"processed {stats.documents} documents ({read / 1e6:.1f} of {total / 1e6:.1f} MB) "
        f"| {rate:.2f} MB/s | ETA {eta_s}"
    )


def run(args: argparse.Namespace) -> int:
    paths = expand_inputs(args.input)
    keys = list(args.json_keys)
    if len(keys) > 1:
        for p in paths:
            if input_kind(p) == TEXT:
                raise ValueError(
                    f"--json-keys {' '.join(keys)}: {p} is plain text, which has no "
                    "keys; give one key (it names the output) or use JSON input"
                )
    if args.txt_paragraphs and args.txt_documents not in ("line", "paragraph"):
        raise ValueError(
            f"--txt-paragraphs contradicts --txt-documents {args.txt_documents}: give one"
        )
    tok = section_from_args(TokenizerConfig, args).with_pretrained_files()
    problem = tok.pretrained_problem()
    if problem:
        raise ValueError("{}: {}. Fix: {}.".format(*problem))
    tok_kwargs = {**tok.kwargs(), "vocab_size": args.vocab_size}
    tokenizer = build_tokenizer(tok.tokenizer_type, **tok_kwargs)  # fail fast on bad flags
    dtype = token_dtype(args.dataset_impl, tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    options = {
        "keys": keys,
        "dtype": dtype,
        "append_eod": args.append_eod,
        "split_sentences": args.split_sentences or args.presplit_sentences,
        "presplit_sentences": args.presplit_sentences,
        "keep_newlines": args.keep_newlines,
    }
    level = "sentence" if options["split_sentences"] else "document"
    fingerprint = tokenizer_fingerprint(tokenizer)
    outputs = Outputs(args.output_prefix, keys, level, dtype, args.dataset_impl, fingerprint)
    for line in outputs.clean_stale():
        print(line, file=sys.stderr)
    progress, stats = ProgressFile(), Stats()
    total = sum(input_size(p) for p in paths)
    txt_documents = "paragraph" if args.txt_paragraphs else args.txt_documents
    chunks = read_chunks(paths, args.chunk_bytes, progress, txt_documents, keys)
    ok, next_log = False, args.log_interval
    # a bar on a terminal; the log lines of --log-interval otherwise
    bar = Progress("preprocess", total, unit="B") if is_terminal(sys.stderr) else None
    results = _encode_in_order(chunks, args.workers, (tok.tokenizer_type, tok_kwargs, options))
    try:
        for result in results:
            stats.add(result, keys[0])
            if result.bad and args.bad_records == "fail":
                _report_bad(stats, failed=True)
                return 1
            outputs.add(result)
            if bar is not None:
                bar.update(progress.bytes_read, note=f"{stats.documents} documents")
            elif stats.documents >= next_log:
                print(
                    _progress_line(stats, progress.bytes_read, total), file=sys.stderr, flush=True
                )
                next_log = stats.documents + args.log_interval
        written = outputs.commit()
        ok = True
    finally:
        results.close()  # stops the worker pool at once on failure
        if bar is not None:
            bar.close()
        if not ok:
            outputs.discard()
    _summary(stats, progress.bytes_read, written, dtype)
    return 0


def _report_bad(stats: Stats, failed: bool) -> None:
    for b in stats.bad:
        print(f"bad record: {b}", file=sys.stderr)
    more = stats.bad_count - len(stats.bad)
    if more > 0:
        print(f"... and {more} more bad records", file=sys.stderr)
    if failed:
        print(
            f"error: stopped at {stats.bad_count} bad record(s) (--bad-records fail); no output "
            "was written. Fix the records above, or pass --bad-records skip to leave them out.",
            file=sys.stderr,
        )


def _summary(stats: Stats, read: int, written: list[str], dtype) -> None:
    elapsed = time.monotonic() - stats.start
    if stats.bad_count:
        print(f"skipped {stats.bad_count} bad record(s) (--bad-records skip):", file=sys.stderr)
        _report_bad(stats, failed=False)
    print(
        f"done: {stats.documents} documents, {stats.tokens} tokens ({np.dtype(dtype).name}), "
        f"{stats.empty} empty documents dropped, {stats.bad_count} bad records skipped, "
        f"{stats.blank_lines} blank lines skipped, {read / 1e6:.1f} MB in {elapsed:.1f} s "
        f"({read / 1e6 / max(elapsed, 1e-9):.2f} MB/s)",
        file=sys.stderr,
    )
    for prefix in written:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)


class Terminated(BaseException):
    """SIGTERM in the main process: raised there, so that the run stops as on Ctrl-C
    (KeyboardInterrupt), its workers stopped and its temporary files removed."""


def _terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokenizer_type is None and args.tokenizer_model_type is None:
        print("error: --tokenizer-type is required (e.g. GPT2BPETokenizer)", file=sys.stderr)
        return 2
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main_thread else None
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (WorkerDied, OutputWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        print(
            f"interrupted ({name}): stopped; no output was written and the temporary files "
            "were removed",
            file=sys.stderr,
        )
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
