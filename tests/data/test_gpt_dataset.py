"""GPT sample indices, blending, the resumable sampler and the train/valid/test builder."""

import warnings

import numpy as np
import pytest

from megatron.config.schema_data import DataConfig
from megatron.data.blendable_dataset import BlendableDataset, build_blending_indices
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.gpt_dataset import (
    DataError,
    GPTDataset,
    build_indices,
    build_sample_idx,
    num_epochs_needed,
    separate_last_epoch,
    split_document_ranges,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.samplers import MegatronPretrainingSampler


def _sample_idx_loop(sizes, doc_idx, seq_length, num_samples):
    """A direct port of the walk Megatron-LM's C++ helper does, to check the numpy version."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    d, offset = 0, 0
    for i in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[d]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
        out[i] = (d, offset)
    return out


def _make_dataset(path, num_docs=50, vocab=100, seed=0, min_len=1, max_len=40):
    rng = np.random.default_rng(seed)
    b = MMapIndexedDatasetBuilder(f"{path}.bin", np.uint16)
    for _ in range(num_docs):
        b.add_document([rng.integers(0, vocab, rng.integers(min_len, max_len))])
    b.finalize(f"{path}.idx")
    return MMapIndexedDataset(path)


def test_split_ranges_follow_megatron_rounding():
    ranges = split_document_ranges(1000, [0.949, 0.05, 0.001])
    assert ranges == [range(0, 949), range(949, 999), range(999, 1000)]
    # round(7/3) = 2 each; the missing document goes to the first split (Megatron's rule)
    assert split_document_ranges(7, [1 / 3, 1 / 3, 1 / 3]) == [
        range(0, 3),
        range(3, 5),
        range(5, 7),
    ]


def test_vectorized_sample_idx_equals_the_reference_walk():
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 30, 200).astype(np.int32)  # zero-length documents included
    doc_idx = rng.permutation(np.tile(np.arange(200, dtype=np.int32), 2))
    n = (int(sizes.sum()) * 2 - 1) // 16
    ours = build_sample_idx(sizes, doc_idx, 16, n)
    np.testing.assert_array_equal(ours, _sample_idx_loop(sizes, doc_idx, 16, n))


def test_indices_are_deterministic_and_cover_each_epoch():
    sizes = np.random.default_rng(2).integers(1, 50, 300).astype(np.int32)
    docs = np.arange(10, 290, dtype=np.int32)
    # 1800 samples need 9 passes, but only 9 samples of the 9th: it is shuffled on its own.
    tokens = int(sizes[docs].sum())
    assert separate_last_epoch(tokens, 32, 1800, num_epochs_needed(tokens, 32, 1800))
    a = build_indices(sizes, docs, num_samples=1800, seq_length=32, seed=5)
    b = build_indices(sizes, docs, num_samples=1800, seq_length=32, seed=5)
    c = build_indices(sizes, docs, num_samples=1800, seq_length=32, seed=6)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["shuffle_idx"], c["shuffle_idx"])
    doc_idx = a["doc_idx"]
    epochs = len(doc_idx) // len(docs)
    assert epochs >= 2 and len(doc_idx) == epochs * len(docs)
    # Every document of the split appears once per epoch, and no other document appears.
    counts = np.bincount(doc_idx, minlength=300)
    assert (counts[docs] == epochs).all() and counts.sum() == epochs * len(docs)
    # The separately shuffled last epoch is one permutation of the documents.
    np.testing.assert_array_equal(np.sort(doc_idx[-len(docs) :]), docs)
    assert len(a["shuffle_idx"]) >= 1800
    np.testing.assert_array_equal(np.sort(a["shuffle_idx"]), np.arange(len(a["shuffle_idx"])))


def test_samples_are_windows_of_the_document_stream(tmp_path):
    indexed = _make_dataset(tmp_path / "d")
    ds = GPTDataset("train", indexed, range(0, 50), 60, 16, 3, cache_dir=str(tmp_path / "c"))
    stream = np.concatenate([indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)
    by_number = {int(s): i for i, s in enumerate(ds.shuffle_idx)}
    for sample in range(len(ds)):
        text = ds[by_number[sample]]["text"]
        assert len(text) == 17
        np.testing.assert_array_equal(text, stream[sample * 16 : sample * 16 + 17])


def test_cache_is_built_once_and_shared(tmp_path, monkeypatch):
    indexed = _make_dataset(tmp_path / "d")
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="shares"):
        GPTDataset("train", indexed, range(0, 40), 30, 16, 1, cache_dir=cache, is_builder=False)
    first = GPTDataset("train", indexed, range(0, 40), 30, 16, 1, cache_dir=cache)
    import megatron.data.gpt_dataset as gd

    monkeypatch.setattr(gd, "build_indices", lambda *a, **k: pytest.fail("rebuilt the cache"))
    waited = []
    second = GPTDataset(
        "train",
        indexed,
        range(0, 40),
        30,
        16,
        1,
        cache_dir=cache,
        is_builder=False,
        barrier=lambda: waited.append(True),
    )
    assert waited == [True]
    np.testing.assert_array_equal(first.shuffle_idx, second.shuffle_idx)
    assert sum(f.endswith(".npy") for f in __import__("os").listdir(cache)) == 3


def test_token_ids_are_checked_against_the_vocab(tmp_path):
    indexed = _make_dataset(tmp_path / "d", vocab=100)
    ds = GPTDataset(
        "train", indexed, range(0, 50), 20, 16, 1, cache_dir=str(tmp_path / "c"), vocab_size=50
    )
    with pytest.raises(DataError) as err:
        for i in range(len(ds)):
            ds[i]
    msg = str(err.value)
    assert str(tmp_path / "d") in msg and "outside the model's vocab [0, 50)" in msg


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.5, 0.3], [0.01, 0.99]])
def test_blend_stays_within_one_sample_of_the_weights_at_every_prefix(weights):
    which, within = build_blending_indices(weights, 20000)
    n = np.arange(1, len(which) + 1)
    for k, w in enumerate(weights):
        taken = np.cumsum(which == k)
        assert np.abs(taken - w * n).max() <= 1.0
        np.testing.assert_array_equal(within[which == k], np.arange(int(taken[-1])))


def test_blendable_dataset_draws_from_members():
    a, b = [("a", i) for i in range(10)], [("b", i) for i in range(10)]
    ds = BlendableDataset([a, b], [1, 3], 8)
    items = [ds[i] for i in range(8)]
    assert sum(x[0] == "a" for x in items) == 2
    assert [x for x in items if x[0] == "b"] == [("b", i) for i in range(6)]


def test_sampler_resume_is_exact_and_dp_ranks_partition_each_block():
    def run(consumed, rank, dp=2):
        return list(MegatronPretrainingSampler(100, consumed, 3, rank, dp))

    full = run(0, 0)
    for k in (0, 6, 30, 96):  # consumed_samples is always a multiple of micro x DP in training
        assert run(k, 0) == full[k // 6 :]
    for block in range(16):
        got = run(0, 0)[block] + run(0, 1)[block]
        assert got == list(range(block * 6, block * 6 + 6))
    tail = list(MegatronPretrainingSampler(10, 6, 3, 0, 2, drop_last=False))
    assert tail == [[6, 7, 8]]
    with pytest.raises(ValueError, match="consumed_samples"):
        MegatronPretrainingSampler(10, 11, 1, 0, 1)


def test_builder_split_blend_and_separate_paths(tmp_path):
    _make_dataset(tmp_path / "x", num_docs=200, seed=1)
    _make_dataset(tmp_path / "y", num_docs=200, seed=2)
    cache = str(tmp_path / "cache")
    single = build_train_valid_test_datasets(
        DataConfig(data_path=(str(tmp_path / "x"),), split="90,10,0", data_cache_path=cache),
        (50, 10, 0),
        16,
        1234,
    )
    assert len(single[0]) >= 50 and len(single[1]) >= 10 and single[2] is None
    assert single[0].doc_idx.max() < 180 <= single[1].doc_idx.min()
    blend = build_train_valid_test_datasets(
        DataConfig(
            data_path=("0.25", str(tmp_path / "x"), "0.75", str(tmp_path / "y")),
            split="1,1,0",
            data_cache_path=cache,
        ),
        (40, 8, 0),
        16,
        1234,
    )
    assert len(blend[0]) == 40 and list(blend[0].weights) == [0.25, 0.75]
    assert int((np.asarray(blend[0].dataset_index) == 0).sum()) == 10
    separate = build_train_valid_test_datasets(
        DataConfig(
            train_data_path=(str(tmp_path / "x"),),
            valid_data_path=(str(tmp_path / "y"),),
            data_cache_path=cache,
        ),
        (20, 5, 3),
        16,
        1234,
    )
    assert separate[0].indexed.prefix.endswith("x") and separate[1].indexed.prefix.endswith("y")
    assert separate[2] is None


def test_builder_warns_when_the_dtype_cannot_hold_the_vocab(tmp_path):
    # int16 and uint16 have the same byte width, so only the type tells: ids above 32767 of a
    # GPT-2 vocab would read back negative.
    for name, dtype in (("signed", np.int16), ("unsigned", np.uint16)):
        b = MMapIndexedDatasetBuilder(tmp_path / f"{name}.bin", dtype)
        for i in range(40):
            b.add_document([np.arange(i, i + 20) % 100])
        b.finalize(tmp_path / f"{name}.idx")

    def build(name):
        data = DataConfig(
            data_path=(str(tmp_path / name),), split="1,0,0", data_cache_path=str(tmp_path / "c")
        )
        return build_train_valid_test_datasets(data, (10, 0, 0), 16, 1, vocab_size=50257)

    with pytest.warns(UserWarning) as record:
        assert build("signed")[0] is not None
    messages = [str(w.message) for w in record]
    assert any(
        f"{tmp_path / 'signed.idx'}: token dtype int16 (dtype code 3) holds ids up to 32767" in m
        and "tools/preprocess_data.py" in m
        for m in messages
    ), messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build("unsigned")[0] is not None


def test_a_prefix_listed_twice_is_one_entry_with_the_summed_weight(tmp_path, capsys):
    """`--data-path 0.5 X 0.5 X` (an old way to up-weight a corpus) shared one cached order
    between both entries, so every sample came twice, back to back in the same batch."""
    _make_dataset(tmp_path / "x", num_docs=200, seed=1)
    _make_dataset(tmp_path / "y", num_docs=200, seed=2)
    x, y, cache = str(tmp_path / "x"), str(tmp_path / "y"), str(tmp_path / "cache")

    def train(*data_path):
        data = DataConfig(data_path=data_path, split="1,0,0", data_cache_path=cache)
        ds = build_train_valid_test_datasets(data, (40, 0, 0), 16, 1234)[0]
        return [tuple(ds[i]["text"].tolist()) for i in range(len(ds))]

    twice = train("0.5", x, "0.5", x)
    assert len(set(twice)) == len(twice), "a sample repeats"
    assert twice == train(x)  # the same as listing it once
    assert "x is listed 2 times; merged into one entry with the summed weight 1" in (
        capsys.readouterr().out
    )
    # with another corpus: X's weights add up (0.2 + 0.4 = 0.6 against Y's 0.4)
    mixed = build_train_valid_test_datasets(
        DataConfig(
            data_path=("0.2", x, "0.4", y, "0.4", f"{tmp_path}/./x"),
            split="1,0,0",
            data_cache_path=cache,
        ),
        (40, 0, 0),
        16,
        1234,
    )[0]
    assert [round(w, 6) for w in mixed.weights] == [0.6, 0.4]
    drawn = [tuple(mixed[i]["text"].tolist()) for i in range(len(mixed))]
    assert len(set(drawn)) == len(drawn)
