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

FIXTURES = Path(__file__).parent / "fixtures" / "megatron-mmap"
MEGATRON = FIXTURES / "megatron_text_document"


def _expected_ids():
    return json.loads((FIXTURES / "expected_ids.json").read_text())["documents"]


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
        ({"patch_bin": lambda b: b + b"\0\0"}, "truncated or belongs to another index"),
        ({"patch_idx": lambda b: b[:-8]}, "d.idx: 414 bytes, but its header promises 422"),
        ({"patch_idx": lambda b: b"XXXXXXXXX" + b[9:]}, "bad magic"),
        ({"patch_idx": lambda b: b"TNTIDX\0\0" + b[8:]}, "legacy 'TNTIDX'"),
        ({"patch_idx": lambda b: b[:9] + struct.pack("<Q", 2) + b[17:]}, "index version 2"),
        ({"patch_idx": lambda b: b[:17] + bytes([9]) + b[18:]}, "unknown dtype code 9"),
        ({"patch_idx": lambda b: b[:17] + bytes([4]) + b[18:]}, "(dtype int32)"),  # flipped dtype
        ({"patch_idx": lambda b: b[:-8] + struct.pack("<q", 18)}, "document index must run"),
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


def test_out_of_range_access_raises():
    ds = MMapIndexedDataset(MEGATRON)
    with pytest.raises(IndexError):
        ds[19]
    with pytest.raises(IndexError):
        ds.get(0, offset=5, length=100)
