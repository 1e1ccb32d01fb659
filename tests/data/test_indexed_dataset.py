"""The mmap .bin/.idx format: Megatron's files read back, our files round-trip, damage is named."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)
from megatron.data.merge_datasets import main as merge_main
from tests.helpers.paths import MMAP

MEGATRON = MMAP / "megatron_text_document"


def _expected_ids():
    return json.loads((MMAP / "expected_ids.json").read_text())["documents"]


def test_reads_megatron_files():
    ds = MMapIndexedDataset(MEGATRON)
    expected = _expected_ids()
    assert len(ds) == len(expected) == 19 and ds.num_documents == 19
    assert ds.dtype == np.uint16
    assert list(ds.doc_idx) == list(range(20))
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids
    assert ds.get(2, offset=3, length=4).tolist() == expected[2][3:7]
    assert [a.tolist() for a in ds[1:3]] == expected[1:3]


def _write(prefix, docs, dtype=np.uint16):
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        b.add_document(doc)
    b.finalize(f"{prefix}.idx")


def test_writer_reproduces_megatron_bytes(tmp_path):
    _write(tmp_path / "ours", [[ids] for ids in _expected_ids()])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == Path(f"{MEGATRON}{ext}").read_bytes()


def test_round_trip_sentences_int32_and_batch(tmp_path):
    docs = [[[1, 2, 3], [70000]], [[5]], [[6, 7], [8], [9, 10, 11]]]
    _write(tmp_path / "a", docs, np.int32)
    ds = MMapIndexedDataset(tmp_path / "a")
    assert ds.dtype == np.int32 and len(ds) == 6 and ds.doc_idx.tolist() == [0, 2, 3, 6]
    assert ds[1].tolist() == [70000] and ds[5].tolist() == [9, 10, 11]
    b = MMapIndexedDatasetBuilder(tmp_path / "b.bin", np.int32)
    b.add_batch(np.array([1, 2, 3, 70000, 5, 6, 7, 8, 9, 10, 11]), [3, 1, 1, 2, 1, 3], [2, 1, 3])
    b.finalize(tmp_path / "b.idx")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


def test_merge_tool_concatenates(tmp_path, capsys):
    _write(tmp_path / "x", [[[1, 2]], [[3]]])
    _write(tmp_path / "y", [[[4], [5, 6]]])
    assert (
        merge_main(
            [
                "--input",
                str(tmp_path / "x"),
                str(tmp_path / "y"),
                "--output-prefix",
                str(tmp_path / "xy"),
            ]
        )
        == 0
    )
    ds = MMapIndexedDataset(tmp_path / "xy")
    assert [a.tolist() for a in ds[0:4]] == [[1, 2], [3], [4], [5, 6]]
    assert ds.doc_idx.tolist() == [0, 1, 2, 4]
    assert (
        merge_main(["--input", str(tmp_path / "missing"), "--output-prefix", str(tmp_path / "z")])
        == 1
    )
    assert "missing" in capsys.readouterr().err


_N = 19  # sequences in the Megatron fixture
_SIZES, _POINTERS = 34, 34 + 4 * _N  # offsets of sizes int32[N], pointers int64[N] in the .idx


def _scale_size(idx: bytes, i: int, factor: int, add: int = 0) -> bytes:
    (size,) = struct.unpack_from("<i", idx, _SIZES + 4 * i)
    at = _SIZES + 4 * i
    return idx[:at] + struct.pack("<i", size * factor + add) + idx[at + 4 :]


def _set_pointer(idx: bytes, i: int, value: int) -> bytes:
    at = _POINTERS + 8 * i
    return idx[:at] + struct.pack("<q", value) + idx[at + 8 :]


def _damaged(tmp_path, patch_idx=None, patch_bin=None):
    for ext in (".bin", ".idx"):
        shutil.copy(f"{MEGATRON}{ext}", tmp_path / f"d{ext}")
    if patch_idx:
        p = tmp_path / "d.idx"
        p.write_bytes(patch_idx(p.read_bytes()))
    if patch_bin:
        p = tmp_path / "d.bin"
        p.write_bytes(patch_bin(p.read_bytes()))
    return tmp_path / "d"


@pytest.mark.parametrize(
    "damage,message",
    [
        ({"patch_bin": lambda b: b[:-2]}, "d.bin: 2164 bytes, but the index points to 2166"),
        ({"patch_bin": lambda b: b + b"\0\0"}, "truncated or the two files do not belong together"),
        ({"patch_idx": lambda b: b[:-8]}, "d.idx: 414 bytes, but its header promises 422"),
        ({"patch_idx": lambda b: b"XXXXXXXXX" + b[9:]}, "bad magic"),
        ({"patch_idx": lambda b: b"TNTIDX\0\0" + b[8:]}, "legacy 'TNTIDX'"),
        ({"patch_idx": lambda b: b[:9] + struct.pack("<Q", 2) + b[17:]}, "index version 2"),
        ({"patch_idx": lambda b: b[:17] + bytes([9]) + b[18:]}, "unknown dtype code 9"),
        ({"patch_idx": lambda b: b[:17] + bytes([4]) + b[18:]}, "(dtype int32)"),  # flipped dtype
        ({"patch_idx": lambda b: b[:-8] + struct.pack("<q", 18)}, "document index must run"),
        # The case: the first document claims twice its tokens, the last one is right.
        ({"patch_idx": lambda b: _scale_size(b, 0, 2)}, "d.idx: sequence 0 (document 0) has"),
        ({"patch_idx": lambda b: _scale_size(b, 5, 1, add=1)}, "sequence 5 (document 5) has"),
        ({"patch_idx": lambda b: _set_pointer(b, 0, 2)}, "sequence 0 (document 0) starts at"),
    ],
)
def test_damaged_files_raise_named_errors(tmp_path, damage, message):
    prefix = _damaged(tmp_path, **damage)
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(prefix)
    assert message in str(err.value) and "d." in str(err.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        MMapIndexedDataset(tmp_path / "nope")
    prefix = _damaged(tmp_path)
    (tmp_path / "d.bin").unlink()
    with pytest.raises(FileNotFoundError, match="d.bin"):
        MMapIndexedDataset(prefix)


@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_a_prefix_naming_its_bin_says_to_drop_it(ext):
    """The readers give the config rule's fix (one check: schema_data.prefix_names_a_file)."""
    with pytest.raises(FileNotFoundError) as err:
        MMapIndexedDataset(f"{MEGATRON}{ext}")
    assert f"{MEGATRON}{ext} names the {ext} file" in str(err.value)
    assert f"drop {ext}: --data-path {MEGATRON})" in str(err.value)


def test_out_of_range_access_raises():
    ds = MMapIndexedDataset(MEGATRON)
    with pytest.raises(IndexError):
        ds[19]
    with pytest.raises(IndexError):
        ds.get(0, offset=5, length=100)


def test_pointer_check_reports_the_first_bad_sequence_and_its_document(tmp_path):
    # Sentence-level data: sequence numbers and document numbers differ.
    b = MMapIndexedDatasetBuilder(tmp_path / "s.bin", np.uint16)
    b.add_document([[1, 2], [3]])
    b.add_document([[4, 5, 6], [7], [8, 9]])
    b.finalize(tmp_path / "s.idx")
    idx = (tmp_path / "s.idx").read_bytes()
    at = 34 + 4 * 3  # sizes[3] ([7]) claims 2 tokens; the last sequence still ends the .bin
    idx = idx[:at] + struct.pack("<i", 2) + idx[at + 4 :]
    (tmp_path / "s.idx").write_bytes(idx)
    with pytest.raises(IndexedDatasetError) as err:
        MMapIndexedDataset(tmp_path / "s")
    msg = str(err.value)
    assert f"{tmp_path / 's.idx'}: sequence 3 (document 1) has 2 tokens (4 bytes of uint16)" in msg
    assert "next sequence starts 2 bytes after it" in msg


def test_pointer_check_runs_in_blocks(tmp_path, monkeypatch):
    import megatron.data.indexed_dataset as indexed_dataset

    monkeypatch.setattr(indexed_dataset, "_CHECK_BLOCK", 4)  # 19 sequences: 5 blocks
    assert len(MMapIndexedDataset(MEGATRON)) == 19
    prefix = _damaged(tmp_path, patch_idx=lambda b: _scale_size(b, 13, 1, add=1))
    with pytest.raises(IndexedDatasetError, match="sequence 13 .document 13. has"):
        MMapIndexedDataset(prefix)


def test_dtype_that_cannot_hold_the_vocab():
    from megatron.data.indexed_dataset import dtype_vocab_problem

    assert dtype_vocab_problem(np.uint16, 50257) is None
    assert (
        dtype_vocab_problem(np.int32, 50257) is None and dtype_vocab_problem(np.int8, 128) is None
    )
    assert dtype_vocab_problem(np.uint16, None) is None
    assert "int16 (dtype code 3) holds ids up to 32767" in dtype_vocab_problem(np.int16, 50257)
    assert "int8 (dtype code 2) holds ids up to 127" in dtype_vocab_problem(np.int8, 129)
    assert "not an integer type" in dtype_vocab_problem(np.float32, 10)
