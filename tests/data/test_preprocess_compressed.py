"""Damaged and misnamed compressed inputs: one bad record naming the file, the byte offset and
the likely cause, under either --bad-records policy (before: a traceback naming no file, or a
"not valid UTF-8" line per record)."""

import gzip
import json

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.helpers.data import _run

LINES = "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(2000))


def _bad_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("bad record: ")]


def _input(tmp_path, name: str, data: bytes):
    (tmp_path / "in").mkdir(exist_ok=True)
    path = tmp_path / "in" / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_fake_gz_names_the_file_and_says_it_is_not_gzip(tmp_path, capsys, policy):
    path = _input(tmp_path, "fake.jsonl.gz", LINES.encode())
    assert _run(tmp_path, [path], "--bad-records", policy) == (1 if policy == "fail" else 0)
    bad = _bad_lines(capsys)
    assert bad == [
        f"bad record: {path}:1: not a gzip file although named .gz: not compressed (it starts "
        f"with {LINES.encode()[:8]!r}) at byte 0; drop the .gz from its name"
    ]


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_truncated_gz_names_the_offset_and_keeps_what_was_read_with_skip(
    tmp_path, capsys, policy
):
    whole = gzip.compress(LINES.encode())
    path = _input(tmp_path, "cut.jsonl.gz", whole[: len(whole) // 2])
    assert _run(tmp_path, [path], "--bad-records", policy) == (1 if policy == "fail" else 0)
    (bad,) = _bad_lines(capsys)
    assert bad.startswith(f"bad record: {path}:") and "truncated gzip: the compressed data " in bad
    assert f"stops at byte {len(whole) // 2} (the end of the file)" in bad and "fetch it" in bad
    if policy == "skip":
        kept = MMapIndexedDataset(tmp_path / "out_text_document").num_documents
        line = int(bad[len(f"bad record: {path}:") :].split(":")[0])
        assert 0 < kept == line - 1 < 2000  # the documents before the damage


def test_corrupt_gzip_data_names_the_offset(tmp_path, capsys):
    whole = bytearray(gzip.compress(LINES.encode()))
    whole[len(whole) // 2 : len(whole) // 2 + 64] = b"\xff" * 64
    path = _input(tmp_path, "corrupt.jsonl.gz", bytes(whole))
    assert _run(tmp_path, [path]) == 1
    (bad,) = _bad_lines(capsys)
    assert f"{path}:" in bad and "corrupt gzip data near compressed byte " in bad


def test_a_truncated_json_array_gz_names_the_file(tmp_path, capsys):
    whole = gzip.compress(json.dumps([f"doc {i} " * 30 for i in range(3000)]).encode())
    path = _input(tmp_path, "cut.json.gz", whole[: len(whole) // 2])
    assert _run(tmp_path, [path]) == 1
    (bad,) = _bad_lines(capsys)
    assert f"{path}:" in bad and "truncated gzip" in bad


@pytest.mark.parametrize("name", ["gz-named.jsonl", "gz-named.txt"])
def test_a_gzip_file_without_the_gz_suffix_is_one_line_saying_so(tmp_path, capsys, name):
    path = _input(tmp_path, name, gzip.compress(LINES.encode()))
    assert _run(tmp_path, [path], "--bad-records", "skip") == 0
    assert _bad_lines(capsys) == [
        f"bad record: {path}:1: this file is gzip-compressed (its first bytes, at byte 0, are "
        f"1f 8b 08 00) but its name does not end in .gz; rename it to {name}.gz"
    ]


def test_a_truncated_txt_gz_read_whole_names_the_file(tmp_path, capsys):
    """--txt-documents file reads the whole file at once: its damage is a bad record too."""
    whole = gzip.compress(("one long stream of text\n" * 4000).encode())
    path = _input(tmp_path, "cut.txt.gz", whole[: len(whole) // 2])
    assert _run(tmp_path, [path], "--txt-documents", "file") == 1
    (bad,) = _bad_lines(capsys)
    assert bad.startswith(f"bad record: {path}:1:") and "truncated gzip" in bad


def test_contradicting_txt_flags_are_refused_before_any_output_is_opened(tmp_path, capsys):
    path = _input(tmp_path, "a.txt", b"hello\n")
    assert _run(tmp_path, [path], "--txt-paragraphs", "--txt-documents", "file") == 2
    assert "--txt-paragraphs contradicts --txt-documents file" in capsys.readouterr().err
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]
