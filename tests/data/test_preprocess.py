"""tools/preprocess_data.py: Megatron's bytes, every input kind, every bad record kind."""

import errno
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.tokenizers import build_tokenizer
from tests.helpers.data import DOCS, TOK, _run
from tests.helpers.paths import MMAP, ROOT


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(
        "GPT2BPETokenizer", vocab_file=MMAP / "vocab.json", merge_file=MMAP / "merges.txt"
    )


def _docs(path):
    ds = MMapIndexedDataset(path)
    return [ds[i].tolist() for i in range(len(ds))]


def _expected(tok, texts):
    return [tok.tokenize(t) + [tok.eod] for t in texts]


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_fixture_corpus_is_byte_identical_to_megatron(tmp_path, workers):
    # A small --chunk-bytes makes the 2-worker run span many chunks; order must be kept.
    assert (
        _run(tmp_path, [MMAP / "corpus.jsonl"], "--workers", workers, "--chunk-bytes", "300") == 0
    )
    for ext in (".bin", ".idx"):
        ours = (tmp_path / f"out_text_document{ext}").read_bytes()
        assert ours == (MMAP / f"megatron_text_document{ext}").read_bytes()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.slow
def test_command_line_entry_point(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(MMAP / "corpus.jsonl"),
            "--output-prefix",
            str(tmp_path / "cli"),
            *TOK,
            "--append-eod",
            "--log-interval",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "MB/s" in out.stderr and "ETA" in out.stderr and "19 documents" in out.stderr


def test_every_input_kind_round_trips(tmp_path, tok):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:2]))
    (tmp_path / "b.json").write_text(json.dumps([DOCS[2], {"text": DOCS[3]}], indent=2))
    (tmp_path / "c.txt").write_text("plain line one\n\nplain line two\n")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "gzipped doc"}) + "\n")
    with gzip.open(tmp_path / "e.json.gz", "wt") as f:
        json.dump(["gz array doc"], f)
    assert _run(tmp_path, [tmp_path / "*.json*", tmp_path / "c.txt"]) == 0
    texts = [*DOCS, "gzipped doc", "gz array doc", "plain line one", "plain line two"]
    assert _docs(tmp_path / "out_text_document") == _expected(tok, texts)


def test_txt_paragraphs_and_two_json_keys(tmp_path, tok):
    (tmp_path / "p.txt").write_text("para one\nstill one\n\n\npara two\n")
    assert _run(tmp_path, [tmp_path / "p.txt"], "--txt-paragraphs", prefix="p") == 0
    assert _docs(tmp_path / "p_text_document") == _expected(
        tok, ["para one\nstill one", "para two"]
    )
    rows = [{"title": f"T{i}", "body": d} for i, d in enumerate(DOCS)]
    (tmp_path / "k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run(tmp_path, [tmp_path / "k.jsonl"], "--json-keys", "title", "body", prefix="k") == 0
    assert _docs(tmp_path / "k_title_document") == _expected(tok, [r["title"] for r in rows])
    assert _docs(tmp_path / "k_body_document") == _expected(tok, DOCS)


PLAY = "First Citizen:\nBefore we proceed.\n\nAll:\n  Speak, speak.\n\n"


def test_txt_file_is_one_stream_and_blank_lines_are_counted(tmp_path, capsys, tok):
    # nanoGPT's input.txt: one document, every space and newline kept.
    (tmp_path / "play.txt").write_text(PLAY, encoding="utf-8")
    assert _run(tmp_path, [tmp_path / "play.txt"], "--txt-documents", "file", prefix="f") == 0
    assert _docs(tmp_path / "f_text_document") == _expected(tok, [PLAY])
    assert "0 blank lines skipped" in capsys.readouterr().err
    # One document per line (the default) leaves the blank lines out and says how many.
    assert _run(tmp_path, [tmp_path / "play.txt"], prefix="l") == 0
    lines = ["First Citizen:", "Before we proceed.", "All:", "  Speak, speak."]
    assert _docs(tmp_path / "l_text_document") == _expected(tok, lines)
    assert "2 blank lines skipped" in capsys.readouterr().err
    assert _run(tmp_path, [tmp_path / "play.txt"], "--txt-documents", "paragraph", prefix="p") == 0
    paragraphs = ["First Citizen:\nBefore we proceed.", "All:\n  Speak, speak."]
    assert _docs(tmp_path / "p_text_document") == _expected(tok, paragraphs)


def test_split_sentences_writes_one_sequence_per_sentence(tmp_path, tok):
    (tmp_path / "s.jsonl").write_text(json.dumps({"text": "One two. Three four! 五六。"}) + "\n")
    assert _run(tmp_path, [tmp_path / "s.jsonl"], "--split-sentences") == 0
    ds = MMapIndexedDataset(tmp_path / "out_text_sentence")
    assert ds.doc_idx.tolist() == [0, 3]
    assert [ds[i].tolist() for i in range(3)] == [
        tok.tokenize("One two."),
        tok.tokenize("Three four!"),
        tok.tokenize("五六。") + [tok.eod],
    ]


BAD_LINES = [
    (b'{"text": "fine"}\n', None),
    (b'{"text": "broken"\n', "malformed JSON"),
    (b'{"text": "bad \xff byte"}\n', "not valid UTF-8 (byte 0xff"),
    (b'{"body": "no text key"}\n', "missing key 'text'"),
    (b'{"text": 42}\n', "key 'text' is a int, not a string"),
    (b"[1, 2]\n", "expected a JSON object"),
    (b'{"text": ""}\n', None),  # empty: dropped and counted, not bad
    (b'{"text": "also fine"}\n', None),
]


def _bad_corpus(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(line for line, _ in BAD_LINES))
    return path


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_fail_policy_reports_file_and_line_and_leaves_nothing(tmp_path, capsys, workers):
    path = _bad_corpus(tmp_path)
    assert _run(tmp_path, [path], "--workers", workers) == 1
    err = capsys.readouterr().err
    for line_no, (_, reason) in enumerate(BAD_LINES, start=1):
        if reason:
            assert f"{path}:{line_no}: {reason}" in err
    assert "no output was written" in err and "--bad-records skip" in err
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"], "no .bin/.idx or temp file may remain"


def test_skip_policy_drops_and_lists_bad_records_and_counts_empty(tmp_path, capsys, tok):
    path = _bad_corpus(tmp_path)
    assert _run(tmp_path, [path], "--bad-records", "skip") == 0
    err = capsys.readouterr().err
    assert "skipped 5 bad record(s)" in err and f"{path}:2: malformed JSON" in err
    assert "1 empty documents dropped" in err
    assert _docs(tmp_path / "out_text_document") == _expected(tok, ["fine", "also fine"])


def test_broken_json_array_and_bad_flags(tmp_path, capsys):
    (tmp_path / "arr.json").write_text('[\n"one",\n"two" "three"\n]')
    assert _run(tmp_path, [tmp_path / "arr.json"]) == 1
    assert f"{tmp_path / 'arr.json'}:3: expected ','" in capsys.readouterr().err
    assert _run(tmp_path, [tmp_path / "nothing*.jsonl"]) == 2
    assert "--input" in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("x\n")
    assert _run(tmp_path, [tmp_path / "t.txt"], "--json-keys", "a", "b") == 2
    assert "plain text" in capsys.readouterr().err


def _spawned_workers(pid: int) -> list[int]:
    """Pids of the multiprocessing 'spawn' children of `pid` (not its resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return sorted(found)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker pids in /proc")
def test_a_killed_worker_fails_the_run_within_seconds_naming_it(tmp_path):
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while ranks reduce gradients".split()
    with open(tmp_path / "big.jsonl", "w") as f:  # ~25 MB: several seconds of tokenizing
        for _ in range(40000):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=120))}) + "\n")
    out_dir = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(tmp_path / "big.jsonl"),
            "--output-prefix",
            str(out_dir / "big"),
            *TOK,
            "--workers",
            "2",
            "--chunk-bytes",
            "65536",
            "--log-interval",
            "500",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines, busy = [], threading.Event()

    def pump():
        for line in proc.stderr:
            lines.append(line)
            busy.set()  # the first progress line: the workers are tokenizing

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert busy.wait(timeout=120), "no progress line"
        assert lines[0].startswith("processed "), lines
        victim = _spawned_workers(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=60)  # today: the main process waits forever for the lost chunk
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 1, err
    assert elapsed < 15, f"took {elapsed:.1f} s to notice the dead worker"
    assert f"(pid {victim}) was killed by SIGKILL" in err and "tokenizer worker" in err, err
    assert "done:" not in err
    assert os.listdir(out_dir) == [], "nothing under the final names, no temp files either"


def test_a_full_disk_is_one_line_naming_the_file_and_the_free_space(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing the .bin (the default --workers): a one-line error naming the output
    file and the free space, as checkpoint saves give, and nothing left behind (before: a raw
    OSError traceback)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MMapIndexedDatasetBuilder, "add_batch", full)
    (tmp_path / "in").mkdir()
    corpus = tmp_path / "in" / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    assert _run(tmp_path, [corpus]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    want = f"error: cannot write {tmp_path}/out_text_document.bin: [Errno 28] No space left"
    assert err[-1].startswith(want) and " MiB free on " in err[-1], err
    assert "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
