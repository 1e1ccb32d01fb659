"""tools/preprocess_data.py on Parquet files and datasets.save_to_disk directories: the same
bytes as the JSON lines path, bounded batches, bad rows named by file and row."""

import io
import json
import os
from pathlib import Path

import pytest

from megatron.data import preprocess_tables
from megatron.progress import Progress
from tests.helpers.data import DOCS, _run

pa = pytest.importorskip("pyarrow", reason="pip install pyarrow (the [data] extra)")
pq = pytest.importorskip("pyarrow.parquet", reason="pip install pyarrow")

# Many documents, so the tables span several record batches and chunks.
TEXTS = [f"{DOCS[i % len(DOCS)]} #{i}" for i in range(3000)]


def _jsonl(tmp_path: Path, texts, name="corpus.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _write_parquet(path: Path, texts, row_group_size=500) -> Path:
    table = pa.table({"id": list(range(len(texts))), "content": texts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _outputs(tmp_path: Path, prefix: str) -> tuple[bytes, bytes]:
    base = tmp_path / f"{prefix}_text_document"
    return Path(f"{base}.bin").read_bytes(), Path(f"{base}.idx").read_bytes()


def _outputs_key(tmp_path: Path, prefix: str, key: str) -> tuple[bytes, bytes]:
    base = tmp_path / f"{prefix}_{key}_document"
    return Path(f"{base}.bin").read_bytes(), Path(f"{base}.idx").read_bytes()


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_parquet_glob_is_byte_identical_to_jsonl(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(preprocess_tables, "_BATCH_ROWS", 256)  # many batches per file
    assert _run(tmp_path, [_jsonl(tmp_path, TEXTS)], "--chunk-bytes", "4096", prefix="j") == 0
    _write_parquet(tmp_path / "part-0.parquet", TEXTS[:1700])
    _write_parquet(tmp_path / "part-1.parquet", TEXTS[1700:])
    glob = tmp_path / "part-*.parquet"
    args = ("--json-keys", "content", "--chunk-bytes", "4096", "--workers", workers)
    assert _run(tmp_path, [glob], *args, prefix="p") == 0
    assert _outputs_key(tmp_path, "p", "content") == _outputs(tmp_path, "j")


@pytest.mark.slow  # over a second on 2 cores
def test_saved_dataset_is_byte_identical_and_dataset_dicts_name_their_splits(tmp_path, capsys):
    datasets = pytest.importorskip("datasets", reason="pip install datasets")
    assert _run(tmp_path, [_jsonl(tmp_path, TEXTS)], prefix="j") == 0
    ds = datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    assert _run(tmp_path, [tmp_path / "saved"], prefix="h") == 0
    assert _outputs(tmp_path, "h") == _outputs(tmp_path, "j")
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    capsys.readouterr()
    assert _run(tmp_path, [tmp_path / "dict"], prefix="d") == 2  # a usage error
    err = capsys.readouterr().err
    assert "a DatasetDict with splits ['train']" in err and f"--input {tmp_path}/dict/train" in err


@pytest.mark.slow  # over a second on 2 cores
def test_bad_rows_are_named_by_file_and_row_under_both_policies(tmp_path, capsys):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["fine", None, "also fine"]}), path)
    assert _run(tmp_path, [path]) == 1  # --bad-records fail (the default)
    err = capsys.readouterr().err
    assert f"{path}:2: key 'text' is a NoneType, not a string" in err
    assert sorted(os.listdir(tmp_path)) == ["bad.parquet"], "nothing written on failure"
    assert _run(tmp_path, [path], "--bad-records", "skip") == 0
    assert "skipped 1 bad record(s)" in capsys.readouterr().err
    assert _run(tmp_path, [path], "--json-keys", "body") == 2
    assert f"{path}: no column 'body' (columns: ['text'])" in capsys.readouterr().err


def test_tables_stream_in_bounded_batches(tmp_path, monkeypatch):
    """No chunk holds more than about --chunk-bytes of text plus one record batch."""
    monkeypatch.setattr(preprocess_tables, "_BATCH_ROWS", 100)
    path = _write_parquet(tmp_path / "t.parquet", TEXTS, row_group_size=100)
    position = preprocess_tables.RowPosition()
    sizes = [
        len(items)
        for _, items in preprocess_tables.table_rows(str(path), ["content"], 2000, position)
    ]
    assert sum(sizes) == len(TEXTS) and len(sizes) > 10
    assert max(sizes) <= 200  # 2000 bytes is under 100 rows; one batch more at most
    assert position.tell() == os.path.getsize(path)  # the progress line's bytes read


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise():
    pytest.importorskip("tqdm", reason="pip install tqdm (the [progress] extra)")
    log = _Stream(tty=False)
    p = Progress("preprocess", 4_000_000, unit="B", stream=log, every_s=3600)
    p.update(1_000_000)  # a quick job prints nothing
    p.close()
    assert log.getvalue() == ""
    p = Progress("preprocess", 4_000_000, unit="B", stream=log, every_s=0)
    p.update(1_000_000)
    p.update(4_000_000, note="9 documents")
    p.close()
    assert log.getvalue() == (
        "preprocess: 1 of 4 MB (25%)\npreprocess: 4 of 4 MB (100%) | 9 documents\n"
    )
    tty = _Stream(tty=True)
    p = Progress("evaluate", 10, stream=tty)
    for i in range(1, 11):
        p(i, 10)
    p.close()
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()  # tqdm redraws one line
