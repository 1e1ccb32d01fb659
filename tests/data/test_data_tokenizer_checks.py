"""Data that does not fit the run's tokenizer is one line naming the file, before training:
ids beyond the vocab, another tokenizer of the same size; `--data-path x.bin` says to drop
`.bin`."""

import json
import shutil

import numpy as np
import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.schema_data import DataConfig
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.dataset_pair import tokenizer_fingerprint
from megatron.data.gpt_dataset import DataError, GPTDataset
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.tokenizers import build_tokenizer
from megatron.models.gpt.train import run_tokenizer_fingerprint
from tests.helpers.data import TOK, _run
from tests.helpers.paths import MMAP
from tests.helpers.training import BASE


def _gpt2(vocab=MMAP / "vocab.json"):
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=MMAP / "merges.txt")


def _build(tmp_path, prefix, vocab_size, tokenizer=None):
    data = DataConfig(data_path=(str(prefix),), split="1,0,0", data_cache_path=str(tmp_path / "c"))
    return build_train_valid_test_datasets(
        data, (10, 0, 0), 16, 1, vocab_size=vocab_size, tokenizer=tokenizer
    )


@pytest.fixture
def ours(tmp_path):
    """The fixture corpus preprocessed by us (with its PREFIX.idx.json)."""
    assert _run(tmp_path, [MMAP / "corpus.jsonl"]) == 0
    return tmp_path / "out_text_document"


def test_ids_beyond_the_vocab_stop_the_build_in_one_line(tmp_path, ours):
    """Before: the build passed and the first sample's check raised inside a DataLoader worker,
    which the trainer printed with the worker's whole traceback."""
    with pytest.raises(DataError) as err:
        _build(tmp_path, ours, vocab_size=1000)
    msg = str(err.value)
    assert msg.startswith(f"{ours}: token id ") and "recorded in " in msg and "\n" not in msg
    assert "outside the model's vocab [0, 1000)" in msg and "tools/preprocess_data.py" in msg


def test_megatrons_files_without_a_sidecar_are_checked_on_a_sample(tmp_path):
    for ext in (".bin", ".idx"):
        shutil.copy(MMAP / f"megatron_text_document{ext}", tmp_path / f"m{ext}")
    with pytest.raises(DataError) as err:
        _build(tmp_path, tmp_path / "m", vocab_size=1000)
    assert "in a sample of its sequences" in str(err.value)
    assert _build(tmp_path, tmp_path / "m", vocab_size=_gpt2().vocab_size)[0] is not None


def test_another_tokenizer_of_the_same_size_is_caught(tmp_path, ours):
    # The same vocab with two ids swapped: same size, same eod, other ids for the same text.
    vocab = json.loads((MMAP / "vocab.json").read_text())
    first_two = _gpt2().tokenize("The quick")[:2]
    a, b = (t for t, i in vocab.items() if i in first_two)
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "swapped.json").write_text(json.dumps(vocab))
    other = tokenizer_fingerprint(_gpt2(tmp_path / "swapped.json"))
    size = _gpt2().vocab_size
    assert other["vocab_size"] == size
    with pytest.raises(DataError) as err:
        _build(tmp_path, ours, vocab_size=size, tokenizer=other)
    msg = str(err.value)
    assert msg.startswith(f"{ours}: made with another tokenizer than this run's (other ids")
    assert f"{ours}.idx.json" in msg and "\n" not in msg
    # The same ids through another backend (HF tokenizer.json) are the same tokenizer.
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=MMAP / "tokenizer.json")
    same = tokenizer_fingerprint(hf)
    assert _build(tmp_path, ours, vocab_size=size, tokenizer=same)[0] is not None


def test_the_trainer_fingerprints_its_tokenizer_as_preprocessing_did(ours):
    cfg = parse_args([*BASE, *TOK, "--data-path", str(ours)], world_size=1)
    recorded = MMapIndexedDataset(ours).pair["tokenizer"]
    assert run_tokenizer_fingerprint(cfg) == recorded


def test_a_data_error_rethrown_by_the_dataloader_is_one_line():
    """How torch's DataLoader hands a worker's exception to the main process."""
    from torch._utils import ExceptionWrapper

    try:
        raise DataError("d: token id 9 in train sample 3 is outside the model's vocab [0, 5)")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError) as err:
        wrapped.reraise()
    assert str(err.value) == (
        "d: token id 9 in train sample 3 is outside the model's vocab [0, 5) "
        "(in DataLoader worker process 0)"
    )


@pytest.mark.slow
def test_a_dataloader_worker_data_error_is_one_line(tmp_path, ours):
    indexed = MMapIndexedDataset(ours)
    ds = GPTDataset("train", indexed, range(0, 19), 4, 8, 1, cache_dir=str(tmp_path / "c"))
    ds.vocab_size = 100  # past the build's checks: the per-sample one is the last line
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1)
    with pytest.raises(DataError) as err:
        next(iter(loader))
    msg = str(err.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert msg.startswith(f"{ours}: token id ") and msg.endswith("(in DataLoader worker process 0)")


@pytest.mark.parametrize("ext", [".bin", ".idx"])
def test_a_data_path_naming_the_bin_says_to_drop_it(ours, ext):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, "--data-path", f"{ours}{ext}"], world_size=1)
    assert f"--data-path: {ours}{ext} names the {ext} file" in str(err.value)
    assert f"Fix: drop {ext}: --data-path {ours}." in str(err.value)


def test_sampled_ids_stay_bounded(tmp_path):
    from megatron.data.builder import sampled_max_id
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    b = MMapIndexedDatasetBuilder(tmp_path / "s.bin", np.uint16)
    for i in range(1000):
        b.add_document([np.full(10, i % 300)])
    b.finalize(tmp_path / "s.idx")
    assert sampled_max_id(MMapIndexedDataset(tmp_path / "s")) == 299
