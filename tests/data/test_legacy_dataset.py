"""v1.x's TNTIDX (lazy/cached) datasets: read, written by preprocess, converted to mmap, trained
on with --data-impl lazy/cached/infer; --mmap-warmup; --num-workers keeps losses and resume."""

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules import validate
from megatron.config.schema_data import DataConfig
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.convert_indexed_dataset import main as convert_main
from megatron.data.dataset_impl import infer_dataset_impl, make_indexed_dataset
from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from megatron.data.legacy_indexed_dataset import LegacyIndexedDataset
from megatron.data.preprocess import main as preprocess_main
from megatron.data.tokenizers import build_tokenizer
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import MMAP
from tests.helpers.training import VOCAB, _losses, _train, flags

TOK = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(MMAP / "vocab.json")]
TOK += ["--merge-file", str(MMAP / "merges.txt")]


def write_tntidx(prefix, docs, code=4, dtype="<i4"):
    """An independent TNTIDX writer from the documented layout: docs = [[seq, ...], ...].

    .idx: b"TNTIDX\\0\\0", then uint64 version 1, dtype code, element size, N items, S sizes,
    D doc-index entries; int64 dim_offsets[N+1], data_offsets[N+1] (elements), sizes[S],
    doc_idx[D]. .bin: the items' elements concatenated.
    """
    seqs = [np.asarray(s, dtype=dtype) for doc in docs for s in doc]
    n, sizes = len(seqs), [len(s) for s in seqs]
    doc_idx = [0, *np.cumsum([len(doc) for doc in docs]).tolist()]
    data_offsets = [0, *np.cumsum(sizes).tolist()]
    Path(f"{prefix}.bin").write_bytes(b"".join(s.tobytes() for s in seqs))
    head = b"TNTIDX\x00\x00" + struct.pack(
        "<6Q", 1, code, np.dtype(dtype).itemsize, n, n, len(doc_idx)
    )
    longs = [*range(n + 1), *data_offsets, *sizes, *doc_idx]
    Path(f"{prefix}.idx").write_bytes(head + struct.pack(f"<{len(longs)}q", *longs))


DOCS = [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]], [[10], [11, 12], [13]]]
# Its .idx: header 56 bytes, dim_offsets at 56 (7 longs), data_offsets at 112 (7), sizes at
# 168 (6), doc_idx at 216 (4).


@pytest.mark.parametrize("impl", ["lazy", "cached", "infer"])
def test_reader_gives_the_written_tokens(tmp_path, impl):
    write_tntidx(tmp_path / "t", DOCS)
    ds = make_indexed_dataset(tmp_path / "t", impl)
    assert isinstance(ds, LegacyIndexedDataset) and ds.cached == (impl == "cached")
    flat = [s for doc in DOCS for s in doc]
    assert len(ds) == 6 and ds.num_documents == 3 and ds.dtype == np.int32
    assert ds.sizes.tolist() == [len(s) for s in flat] and ds.doc_idx.tolist() == [0, 2, 3, 6]
    assert [ds[i].tolist() for i in range(len(ds))] == flat
    assert ds.get(2, 1, 3).tolist() == [6, 7, 8] and ds[-1].tolist() == [13]
    assert [a.tolist() for a in ds[4:6]] == flat[4:6]
    again = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker gets
    assert again.get(2, 1, 3).tolist() == [6, 7, 8]
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)


def _patch(path: Path, at: int, value: bytes) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:at] + value + raw[at + len(value) :])


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: _patch(p / "t.idx", 8, struct.pack("<Q", 2)), "t.idx: TNTIDX version 2"),
        (lambda p: _patch(p / "t.idx", 16, struct.pack("<Q", 9)), "unknown dtype code 9"),
        (lambda p: _patch(p / "t.idx", 24, struct.pack("<Q", 2)), "element size 2"),
        (lambda p: _patch(p / "t.idx", 56 + 8 * 8, struct.pack("<q", 4)), "sequence 0 has"),
        (lambda p: (p / "t.idx").write_bytes((p / "t.idx").read_bytes()[:-8]), "header promises"),
        (lambda p: (p / "t.bin").write_bytes(b"\0" * 8), "t.bin: 8 bytes, but the index"),
        (lambda p: _patch(p / "t.idx", 56 + 8 * 20, struct.pack("<q", 5)), "document index"),
    ],
)
def test_damaged_tntidx_is_named(tmp_path, damage, message):
    write_tntidx(tmp_path / "t", DOCS)
    damage(tmp_path)
    with pytest.raises(IndexedDatasetError, match="t\\.(idx|bin)") as err:
        LegacyIndexedDataset(tmp_path / "t")
    assert message in str(err.value)


def test_data_impl_mismatch_names_the_flag_and_the_value(tmp_path):
    write_tntidx(tmp_path / "t", DOCS)
    with pytest.raises(IndexedDatasetError, match="--data-impl mmap does not read") as err:
        make_indexed_dataset(tmp_path / "t", "mmap")
    assert "Fix: pass --data-impl lazy (or cached)" in str(err.value)
    with pytest.raises(IndexedDatasetError, match="TNTIDX.*--data-impl infer"):
        MMapIndexedDataset(tmp_path / "t")  # the mmap reader alone says so too
    mm = MMAP / "megatron_text_document"
    assert infer_dataset_impl(mm) == "mmap" and infer_dataset_impl(tmp_path / "t") == "lazy"
    with pytest.raises(
        IndexedDatasetError, match="--data-impl cached does not .* pass --data-impl mmap"
    ):
        make_indexed_dataset(mm, "cached")
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX\0" + bytes(40))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(IndexedDatasetError, match="x.idx: magic .* neither"):
        make_indexed_dataset(tmp_path / "x", "infer")


def test_preprocess_lazy_cached_write_tntidx_and_convert_to_the_mmap_bytes(tmp_path, capsys):
    """preprocess --dataset-impl lazy == cached == our TNTIDX writer on the same ids; the
    converter's output == preprocess --dataset-impl mmap, byte for byte."""
    corpus = MMAP / "corpus.jsonl"
    for impl in ("mmap", "lazy", "cached"):
        argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / impl), *TOK]
        assert preprocess_main([*argv, "--append-eod", "--dataset-impl", impl]) == 0
    lazy, cached = tmp_path / "lazy_text_document", tmp_path / "cached_text_document"
    mmap = MMapIndexedDataset(tmp_path / "mmap_text_document")
    write_tntidx(tmp_path / "ours", [[mmap[i].tolist()] for i in range(len(mmap))])
    for ext in (".bin", ".idx"):
        assert Path(f"{lazy}{ext}").read_bytes() == Path(f"{cached}{ext}").read_bytes()
        assert Path(f"{lazy}{ext}").read_bytes() == (tmp_path / f"ours{ext}").read_bytes()
    vocab = str(build_tokenizer(TOK[1], vocab_file=TOK[3], merge_file=TOK[5]).vocab_size)
    for extra in (["--vocab-size", vocab], []):
        assert (
            convert_main(["--input", str(lazy), "--output-prefix", str(tmp_path / "conv"), *extra])
            == 0
        )
        for ext in (".bin", ".idx"):
            ours = (tmp_path / f"conv{ext}").read_bytes()
            assert ours == (MMAP / f"megatron_text_document{ext}").read_bytes()
    assert "wrote" in capsys.readouterr().err


def test_converter_validates_its_input_naming_the_file(tmp_path, capsys):
    write_tntidx(tmp_path / "t", DOCS)
    assert (
        convert_main(
            [
                "--input",
                str(tmp_path / "t"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--vocab-size",
                "12",
            ]
        )
        == 1
    )
    assert (
        "t.bin: token id 13 in sequence 5 is outside the vocab [0, 12)" in capsys.readouterr().err
    )
    assert not list(tmp_path.glob("o*"))
    assert (
        convert_main(
            [
                "--input",
                str(MMAP / "megatron_text_document"),
                "--output-prefix",
                str(tmp_path / "o"),
            ]
        )
        == 1
    )
    assert "megatron_text_document.idx: already the mmap format" in capsys.readouterr().err
    assert (
        convert_main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "o")])
        == 1
    )
    assert "nope.idx: index file not found" in capsys.readouterr().err


def test_keep_newlines_keeps_the_whitespace_after_each_sentence(tmp_path):
    text = "One two.\nThree four!  Five.\n\nSix"
    (tmp_path / "s.jsonl").write_text(json.dumps({"text": text}) + "\n")
    tok = build_tokenizer(TOK[1], vocab_file=TOK[3], merge_file=TOK[5])
    out = {}
    for keep in (False, True):
        argv = ["--input", str(tmp_path / "s.jsonl"), "--output-prefix", str(tmp_path / str(keep))]
        assert preprocess_main([*argv, *TOK, "--split-sentences"] + ["--keep-newlines"] * keep) == 0
        ds = MMapIndexedDataset(tmp_path / f"{keep}_text_sentence")
        out[keep] = [ds[i].tolist() for i in range(len(ds))]
    sentences = ["One two.", "Three four!", "Five.", "Six"]
    assert out[False] == [tok.tokenize(s) for s in sentences]
    kept = ["One two.\n", "Three four!  ", "Five.\n\n", "Six"]
    assert out[True] == [tok.tokenize(s) for s in kept]
    assert tok.detokenize(sum(out[True], [])) == text  # nothing dropped


def test_mmap_warmup_touches_every_byte(tmp_path):
    write_tntidx(tmp_path / "t", DOCS)
    mm = MMAP / "megatron_text_document"
    sizes = {p: Path(p).stat().st_size for p in (f"{mm}.bin", f"{mm}.idx", tmp_path / "t.bin")}
    assert MMapIndexedDataset(mm).warmed_bytes == 0
    assert (
        MMapIndexedDataset(mm, warmup=True).warmed_bytes == sizes[f"{mm}.bin"] + sizes[f"{mm}.idx"]
    )
    assert LegacyIndexedDataset(tmp_path / "t", warmup=True).warmed_bytes == 4 * 13
    cfg = parse_args(["--mmap-warmup", "--data-impl", "mmap", "--data-path", str(mm)], world_size=1)
    assert cfg.data.mmap_warmup and cfg.data.data_impl == "mmap"
    data = DataConfig(
        data_path=(str(mm),), split="1", mmap_warmup=True, data_cache_path=str(tmp_path / "c")
    )
    (train, _, _) = build_train_valid_test_datasets(data, (4, 0, 0), 8, 1)
    assert train.indexed.warmed_bytes == sizes[f"{mm}.bin"] + sizes[f"{mm}.idx"]


def test_bad_num_workers_and_data_impl_fail_naming_the_flag():
    argv = flags("prefix")
    with pytest.raises(ConfigError, match="--num-workers: must be >= 0, got -1. Fix:"):
        validate(parse_args([*argv, "--num-workers", "-1"], world_size=1), "train-gpt")
    with pytest.raises(SystemExit):  # argparse: invalid choice, listing the four
        parse_args([*argv, "--data-impl", "fast"], world_size=1)


def _formats_and_workers_worker(rank, world, argv, tnt, mmap, save):
    """One spawn: the converted mmap files with 0 workers (6 steps) against the TNTIDX files
    under each --data-impl (3 steps), and 2 DataLoader workers: 3 steps + save + resume 3."""
    six = lambda *extra: [*argv, "--data-path", mmap, *extra]  # noqa: E731
    three = lambda *extra: [a if a != "6" else "3" for a in six(*extra)]  # noqa: E731
    out = {"ref": _train(rank, world, six())[0]}
    for impl, workers in (("lazy", "2"), ("cached", "0"), ("infer", "0")):
        run = [*three("--data-impl", impl, "--num-workers", workers)]
        run[run.index(mmap)] = tnt
        out[impl] = _train(rank, world, run)[0]
    out["first"] = _train(rank, world, three("--num-workers", "2", "--save", save))[0]
    resume = six("--num-workers", "2", "--load", save, "--save", save)
    out["resumed"] = _train(rank, world, resume)[0]
    return out


def test_training_on_tntidx_and_with_workers_gives_the_same_losses(tmp_path):
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(200):  # counting sequences, as in test_training
        start, stride, n = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(5, 60)
        docs.append([((start + stride * np.arange(n)) % VOCAB).tolist()])
    write_tntidx(tmp_path / "tnt", docs)
    assert (
        convert_main(["--input", str(tmp_path / "tnt"), "--output-prefix", str(tmp_path / "mm")])
        == 0
    )
    base = flags("unused")
    del base[base.index("--data-path") : base.index("--data-path") + 2]
    args = (base, str(tmp_path / "tnt"), str(tmp_path / "mm"), str(tmp_path / "ckpt"))
    (out,) = run_distributed(_formats_and_workers_worker, 1, *args)
    ref = _losses(out["ref"])
    assert len(ref) == 6 and len(set(ref)) == 6
    for impl in ("lazy", "cached", "infer"):
        assert _losses(out[impl]) == ref[:3], impl
    assert _losses(out["first"]) == ref[:3], "--num-workers 2 must read the same samples"
    assert _losses(out["resumed"]) == ref[3:], "a resume with workers must continue exactly"


def test_merge_datasets_takes_tntidx_inputs_beside_mmap_ones(tmp_path, capsys):
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.data.merge_datasets import main as merge_main

    write_tntidx(tmp_path / "old", DOCS)  # int32 (code 4)
    b = MMapIndexedDatasetBuilder(f"{tmp_path / 'new'}.bin", np.int32)
    b.add_document([[20, 21], [22]])
    b.finalize(f"{tmp_path / 'new'}.idx")
    out = tmp_path / "both"
    argv = ["--input", str(tmp_path / "old"), str(tmp_path / "new"), "--output-prefix", str(out)]
    assert merge_main(argv) == 0
    ds = MMapIndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == [s for d in DOCS for s in d] + [
        [20, 21],
        [22],
    ]
    assert ds.doc_idx.tolist() == [0, 2, 3, 6, 8], "each input's document boundaries kept"
    write_tntidx(tmp_path / "u16", DOCS, code=8, dtype="<u2")  # another tokenizer's width
    bad = ["--input", str(tmp_path / "u16"), str(tmp_path / "new"), "--output-prefix", str(out)]
    assert merge_main(bad) == 1
    assert "new.idx: dtype int32 differs from uint16" in capsys.readouterr().err
