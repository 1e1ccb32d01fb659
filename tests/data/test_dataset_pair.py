"""A .bin and .idx become visible together or are refused together (PREFIX.idx.json); killed
runs' temporary files are cleaned; Ctrl-C ends preprocessing with one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from megatron.data import preprocess_outputs
from megatron.data.dataset_pair import sidecar_path, tokenizer_fingerprint
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from megatron.data.tokenizers import build_tokenizer
from tests.helpers.data import TOK, _run
from tests.helpers.paths import MMAP, ROOT

TOK_ARGS = ("GPT2BPETokenizer", MMAP / "vocab.json", MMAP / "merges.txt")


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (discard() is stubbed out too)."""


def _reversed_corpus(tmp_path):
    """The fixture corpus in reverse order: the same tokens (the same .bin size), every
    document boundary elsewhere."""
    lines = (MMAP / "corpus.jsonl").read_text().splitlines()
    path = tmp_path / "in" / "reversed.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(reversed(lines)) + "\n")
    return path


def _docs(prefix):
    ds = MMapIndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def _kill_at_rename(monkeypatch, victim: str):
    """os.replace raises _Killed when it would create a final name ending in `victim`."""
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith(victim) and ".tmp-" in str(src):
            raise _Killed
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(preprocess_outputs.Outputs, "discard", lambda self: None)


def test_kill_between_the_renames_over_megatrons_files_is_refused_naming_both(
    tmp_path, monkeypatch
):
    """The issue's probe: an older output (Megatron-LM's own files, no sidecar) under the
    prefix, a rerun on other documents of the same total size killed after its .bin was
    renamed and before its .idx was. Before: the new .bin opened with the old .idx, silently
    putting every end-of-document in the wrong place."""
    prefix = tmp_path / "out_text_document"
    for ext in (".bin", ".idx"):
        shutil.copy(MMAP / f"megatron_text_document{ext}", f"{prefix}{ext}")
    _kill_at_rename(monkeypatch, "_text_document.idx")
    with pytest.raises(_Killed):
        _run(tmp_path, [_reversed_corpus(tmp_path)])
    monkeypatch.undo()
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    message = str(err.value)
    assert f"{prefix}.bin and {prefix}.idx do not belong together" in message, message
    assert "interrupted" in message and sidecar_path(prefix) in message


@pytest.mark.parametrize("victim", [".idx.json", "_text_document.bin", "_text_document.idx"])
def test_a_kill_at_any_rename_leaves_the_old_pair_or_a_refusal(tmp_path, monkeypatch, victim):
    """Over an output of our own (with its sidecar): after a kill before any of the three
    renames, the prefix reads as the complete old dataset or is refused, never a mix."""
    prefix = tmp_path / "out_text_document"
    assert _run(tmp_path, [MMAP / "corpus.jsonl"]) == 0
    old = _docs(prefix)
    _kill_at_rename(monkeypatch, victim)
    with pytest.raises(_Killed):
        _run(tmp_path, [_reversed_corpus(tmp_path)])
    monkeypatch.undo()
    try:
        assert _docs(prefix) == old
    except IndexedDatasetError as e:
        assert f"{prefix}.bin and {prefix}.idx do not belong together" in str(e)


def test_the_sidecar_records_the_pair_and_the_tokenizer(tmp_path):
    assert _run(tmp_path, [MMAP / "corpus.jsonl"]) == 0
    prefix = tmp_path / "out_text_document"
    record = json.loads(open(sidecar_path(prefix)).read())
    assert record["bin"]["bytes"] == os.path.getsize(f"{prefix}.bin")
    assert record["idx"]["bytes"] == os.path.getsize(f"{prefix}.idx")
    tok = build_tokenizer(TOK_ARGS[0], vocab_file=TOK_ARGS[1], merge_file=TOK_ARGS[2])
    assert record["tokenizer"] == tokenizer_fingerprint(tok) and record["tokenizer"]["probe"]
    assert record["max_token_id"] == max(max(d) for d in _docs(prefix))
    assert MMapIndexedDataset(prefix).pair["pair_id"] == record["pair_id"]
    # Megatron's bytes are unchanged: the tie lives beside them.
    assert open(f"{prefix}.idx", "rb").read() == (MMAP / "megatron_text_document.idx").read_bytes()


def test_temporary_files_of_killed_runs_are_removed_and_live_ones_reported(tmp_path, capsys):
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    dead, alive = pid_max + 1, os.getppid()  # no process has a pid above pid_max
    stale = [tmp_path / f"out_text_document{ext}.tmp-{dead}" for ext in (".bin", ".idx")]
    live = tmp_path / f"out_text_document.bin.tmp-{alive}"
    other = tmp_path / f"another_text_document.bin.tmp-{dead}"  # not this run's prefix
    for p in [*stale, live, other]:
        p.write_bytes(b"partial")
    assert _run(tmp_path, [MMAP / "corpus.jsonl"]) == 0
    err = capsys.readouterr().err
    for p in stale:
        assert not p.exists() and f"removed {p}, left by a killed run (pid {dead})" in err
    assert live.exists() and f"kept {live}: process {alive}" in err
    assert other.exists()


def _interrupted_preprocessing(tmp_path, sig, kill) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of a preprocessing run (2 workers) sent `sig` by `kill(pid,
    sig)` at its first progress line; its output directory must be left empty."""
    words = "the quick brown fox jumps over a lazy dog while ranks reduce gradients ".split()
    with open(tmp_path / "big.jsonl", "w") as f:  # ~25 MB: several seconds of tokenizing
        for i in range(40000):
            f.write(json.dumps({"text": " ".join(words[i % 7 :] * 8)}) + "\n")
    out_dir = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py")]
        + ["--input", str(tmp_path / "big.jsonl"), "--output-prefix", str(out_dir / "big")]
        + [*TOK, "--workers", "2", "--chunk-bytes", "65536", "--log-interval", "2000"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a job
    )
    lines, busy = [], threading.Event()

    def pump():
        for line in proc.stderr:
            lines.append(line)
            busy.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert busy.wait(timeout=120), "no progress line"
        kill(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    err = "".join(lines)
    assert "Traceback" not in err and "leaked" not in err and "KeyboardInterrupt" not in err
    assert os.listdir(out_dir) == [], err
    return proc.returncode, [line for line in lines if not line.startswith("processed ")]


def test_ctrl_c_ends_preprocessing_with_one_line_and_exit_130(tmp_path):
    """SIGINT to the whole process group (what Ctrl-C sends) mid-run: before, every process
    printed a KeyboardInterrupt traceback."""
    code, lines = _interrupted_preprocessing(tmp_path, signal.SIGINT, os.killpg)
    assert code == 130, lines
    assert lines == [
        "interrupted (SIGINT): stopped; no output was written and the temporary files "
        "were removed\n"
    ]


@pytest.mark.parametrize(
    "kill",
    [os.killpg, pytest.param(os.kill, marks=pytest.mark.slow)],  # seconds each
    ids=["process-group", "main-process"],
)
def test_sigterm_ends_preprocessing_as_ctrl_c_does_with_exit_143(tmp_path, kill):
    """SIGTERM (`kill PID`; `timeout` and Slurm send it to the group): before, the main process
    died at once, leaving PREFIX.bin.tmp-PID and the leaked-semaphore warnings."""
    code, lines = _interrupted_preprocessing(tmp_path, signal.SIGTERM, kill)
    assert code == 143, lines
    assert lines == [
        "interrupted (SIGTERM): stopped; no output was written and the temporary files "
        "were removed\n"
    ]


def test_a_merge_is_committed_as_a_pair_and_keeps_the_shared_tokenizer(tmp_path):
    from megatron.data.merge_datasets import main as merge_main

    assert _run(tmp_path, [MMAP / "corpus.jsonl"], prefix="a") == 0
    assert _run(tmp_path, [_reversed_corpus(tmp_path)], prefix="b") == 0
    a, b, ab = (tmp_path / f"{n}_text_document" for n in ("a", "b", "ab"))
    assert merge_main(["--input", str(a), str(b), "--output-prefix", str(ab)]) == 0
    merged = MMapIndexedDataset(ab).pair
    assert merged["tokenizer"] == MMapIndexedDataset(a).pair["tokenizer"]
    assert merged["max_token_id"] == MMapIndexedDataset(a).pair["max_token_id"]
    for ext in (".bin", ".idx"):  # Megatron's files have no sidecar: nothing shared to keep
        shutil.copy(MMAP / f"megatron_text_document{ext}", tmp_path / f"m{ext}")
    mixed = tmp_path / "am"
    assert merge_main(["--input", str(a), str(tmp_path / "m"), "--output-prefix", str(mixed)]) == 0
    assert "tokenizer" not in MMapIndexedDataset(mixed).pair


def test_a_rebuilt_dataset_with_as_many_documents_gets_new_sample_indices(tmp_path):
    """The cached indices were keyed by the prefix and the number of sequences: a rerun over
    other documents of the same count reused them, cutting samples at the old sizes."""
    from megatron.data.gpt_dataset import GPTDataset

    def samples(cache):
        indexed = MMapIndexedDataset(prefix)
        ds = GPTDataset("train", indexed, range(0, 19), 8, 16, 1, cache_dir=str(cache))
        return [ds[i]["text"].tolist() for i in range(len(ds))]

    prefix = tmp_path / "out_text_document"
    assert _run(tmp_path, [MMAP / "corpus.jsonl"]) == 0
    samples(tmp_path / "cache")
    assert _run(tmp_path, [_reversed_corpus(tmp_path)]) == 0
    assert samples(tmp_path / "cache") == samples(tmp_path / "fresh-cache")
