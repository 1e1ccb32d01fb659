"""--sequence-packing first-fit (data/packing.py): pieces by the stated split rule, first-fit
decreasing, the per-token fields of a packed sample, a packed dataset over .bin/.idx data that is
deterministic per seed, resumable, never splits a document that fits and masks the padding's loss,
with --split and blends; the refusals; a short CPU pretrain with first-fit."""

import numpy as np
import pytest
import torch

from megatron.config.cli import parse_args
from megatron.config.declare import ConfigError
from megatron.config.rules_bert import validate_bert
from megatron.data.builder import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.packing import (
    PAD_ID,
    PackedGPTDataset,
    document_pieces,
    first_fit_decreasing,
    packed_fields,
)
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.models.gpt.train import make_forward_step
from megatron.training.data import collate, get_batch
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    _losses,
    _pp_worker,
    _ref_worker,
    assert_same_run,
    counting_corpus,
    flags,
    refusal,
    train_run,
)

SEQ = 16  # samples of SEQ + 1 tokens


def test_pieces_split_only_documents_longer_than_the_sequence():
    sizes = np.array([5, 17, 18, 40, 1, 0])
    rows = document_pieces(np.arange(6), sizes, SEQ).tolist()
    # 17 = SEQ + 1 fits whole; longer ones: pieces of 17 overlapping by one, the last the rest
    assert rows == [
        [0, 0, 5], [1, 0, 17], [2, 0, 17], [2, 16, 2],
        [3, 0, 17], [3, 16, 17], [3, 32, 8], [4, 0, 1],
    ]  # fmt: skip


def test_first_fit_decreasing():
    # longest first: 9 opens bin 0, 7 bin 1, 5 fills bin 1, 4 opens bin 2, 3 fills bin 0
    bins = first_fit_decreasing(np.array([3, 9, 4, 7, 5]), 12)
    assert bins == [[1, 0], [3, 4], [2]]


def test_fields_of_a_packed_sample():
    f = packed_fields([3, 2, 1], 8)  # 6 tokens of documents, 3 of padding (9 = 8 + 1)
    assert f["document_ids"].tolist() == [0, 0, 0, 1, 1, 2, 8, 8]  # the padding's id: 8
    assert f["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    # a document's last token predicts the next document's first: not trained; nor is padding
    assert f["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    full = packed_fields([4, 5], 8)  # exactly full: the last token is only a label
    assert full["loss_mask"].tolist() == [1, 1, 1, 0, 1, 1, 1, 1]


def _write_corpus(prefix: str, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for d in range(120):  # document d holds the id d + 1 throughout (0 is the padding's)
        b.add_document([np.full(int(rng.integers(1, 30)), d + 1)])
    b.finalize(f"{prefix}.idx")
    return prefix


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _write_corpus(str(tmp_path_factory.mktemp("packing") / "docs"))


def _dataset(prefix, cache, seed=3, num=60, docs=range(100)):
    return PackedGPTDataset("train", MMapIndexedDataset(prefix), docs, num, SEQ, seed,
                            cache_dir=str(cache), vocab_size=128)  # fmt: skip


def _samples(ds, indices):
    return [ds[i] for i in indices]


def test_packed_dataset_is_deterministic_whole_and_loss_masked(corpus, tmp_path, capsys):
    ds = _dataset(corpus, tmp_path / "a")
    assert "train split packed first-fit" in capsys.readouterr().out
    again, other = _dataset(corpus, tmp_path / "b"), _dataset(corpus, tmp_path / "c", seed=4)
    first = _samples(ds, range(len(ds)))
    for a, b in zip(first, _samples(again, range(len(again))), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a["text"], b["text"]) for a, b in zip(first, other, strict=False))
    sizes = MMapIndexedDataset(corpus).sizes
    for s in first:
        text, ids, mask = s["text"], s["document_ids"], s["loss_mask"]
        assert len(text) == SEQ + 1 and len(ids) == SEQ
        for doc in np.unique(ids):
            run = text[:SEQ][ids == doc]
            if run[0] == PAD_ID:  # the tail: padding only, never trained
                assert (run == PAD_ID).all() and (mask[ids == doc] == 0).all()
                assert doc == ids.max()
                continue
            assert (run == run[0]).all()  # one document per run: nothing packed across
            where = np.flatnonzero(ids == doc)
            crosses = where[-1] < SEQ - 1 or text[SEQ] != run[0]  # its last label: another's
            assert (mask[where[:-1]] == 1).all() and mask[where[-1]] == (0 if crosses else 1)
    # one epoch (94 sequences >= 60): a document that fits appears once, whole; a longer one
    # in pieces overlapping by one token
    counts = np.bincount(np.concatenate([s["text"] for s in first]), minlength=101)
    for d in range(100):
        pieces = max(1, -(-(int(sizes[d]) - 1) // SEQ))
        assert counts[d + 1] == sizes[d] + pieces - 1, d
    assert 0 < ds.padding_fraction() < 0.5


def test_resume_reads_the_same_samples(corpus, tmp_path):
    straight = _dataset(corpus, tmp_path)
    order = [i for batch in MegatronPretrainingSampler(len(straight), 0, 2, 0, 1) for i in batch]
    resumed = _dataset(corpus, tmp_path)  # from the cached index, as a restarted run
    rest = [i for batch in MegatronPretrainingSampler(len(resumed), 10, 2, 0, 1) for i in batch]
    assert rest == order[10:]
    for i in rest[:6]:
        assert np.array_equal(straight[i]["text"], resumed[i]["text"])


def test_blends_and_split_build_packed_datasets(corpus, tmp_path):
    other = _write_corpus(str(tmp_path / "other"), seed=1)
    blend = ["--data-path", "0.5", corpus, "0.5", other, "--data-cache-path", str(tmp_path)]
    argv = ["--vocab-size", "128", "--sequence-packing", "first-fit", "--split", "80,20,0"]
    data = parse_args(argv + blend).data
    train, valid, _ = build_train_valid_test_datasets(data, (20, 8, 0), SEQ, 1, vocab_size=128)
    batch = get_batch(iter([collate(None, [train[i] for i in range(4)])]), "cpu")
    assert batch.document_ids.shape == (4, SEQ) and batch.position_ids.shape == (4, SEQ)
    assert batch.loss_mask.dtype == torch.float32
    assert len(valid) == 8 and "document_ids" in valid[0]


def test_packing_refusals():
    cfg = parse_args(["--vocab-size", "128", "--sequence-packing", "first-fit"])
    with pytest.raises(ConfigError, match="--sequence-packing: packs GPT samples; BERT"):
        validate_bert(cfg)
    assert "--mtp-num-layers" in refusal("--sequence-packing", "first-fit", "--mtp-num-layers", "1")
    assert "--sequence-packing" in refusal(
        "--sequence-packing", "first-fit", "--mtp-num-layers", "1"
    )


def _ref_with_padding(rank, world, argv):
    """_ref_worker, and the history of a run through the GPT's own first-fit forward step
    (which logs the padding fraction; the helpers' runs take the plain one)."""
    step = make_forward_step(parse_args(argv, world_size=world))
    return (*_ref_worker(rank, world, argv), train_run(rank, world, argv, step).history)


def _layouts(rank, world, argv, layouts, ref_weights):
    return {name: _pp_worker(rank, world, argv + extra, ref_weights)["history"]
            for name, extra in layouts.items()}  # fmt: skip


@pytest.mark.slow
def test_first_fit_pretrain_on_the_cpu_and_its_tp2_pp2_cp2_layouts(tmp_path):
    """A short pretrain with first-fit learns; TP 2, PP 2 and CP 2 (ring attention within the
    packed documents) give one process's losses, grad norms and final weights."""
    counting = counting_corpus(tmp_path)  # learnable in a few steps
    argv = flags(counting, "--sequence-packing", "first-fit", "--position-embedding-type", "rope")
    argv[argv.index("--split") + 1] = "80,20,0"
    argv[argv.index("--seq-length") + 1] = "24"  # some of the first samples have padding
    ((ref, ref_weights, logged),) = run_distributed(_ref_with_padding, 1, argv)
    losses = _losses(ref)
    assert len(losses) == 6 and np.isfinite(losses).all() and losses[-1] < losses[0]
    assert _losses(logged) == losses
    padding = [h["padding fraction"] for h in logged]  # beside the loss in the log line
    assert all(0 <= p < 0.5 for p in padding) and max(padding) > 0
    layouts = {
        "tp2": ["--tensor-model-parallel-size", "2"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "cp2": ["--context-parallel-size", "2"],
    }
    for rank, histories in enumerate(run_distributed(_layouts, 2, argv, layouts, ref_weights)):
        for name, history in histories.items():
            assert_same_run(history, ref, f"{name} rank {rank}")
