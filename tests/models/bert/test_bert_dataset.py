"""BertDataset: Megatron's BERT samples from a sentence-level corpus."""

import numpy as np
import pytest

from megatron.data.gpt_dataset import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.models.bert.dataset import BertDataset, BertOptions, BertTokens, build_samples

TOK = BertTokens(cls=1, sep=2, mask=3, pad=0, vocab_size=200)
WORDS = 10  # ids 10..199 are words


def write_corpus(prefix, docs):
    """docs: list of documents, each a list of sentences (lists of ids)."""
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        for sentence in doc:
            builder.add_item(np.asarray(sentence))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return MMapIndexedDataset(prefix)


def random_docs(n, seed=0, one_sentence_doc=True):
    rng = np.random.RandomState(seed)
    docs = [
        [list(rng.randint(WORDS, 200, rng.randint(3, 20))) for _ in range(rng.randint(2, 9))]
        for _ in range(n)
    ]
    if one_sentence_doc:
        docs.insert(3, [[50, 51, 52]])  # shorter than two sentences: skipped
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("bert") / "c_text_sentence"), random_docs(60))


def _dataset(corpus, tmp_path, seed=5, n=400, **kw):
    opts = BertOptions(seq_length=kw.pop("seq_length", 32), **kw)
    docs = range(corpus.num_documents)
    return BertDataset("train", corpus, docs, n, seed, opts, TOK, cache_dir=str(tmp_path))


def test_samples_fit_are_laid_out_and_nsp_is_balanced(corpus, tmp_path):
    ds = _dataset(corpus, tmp_path, short_seq_prob=0.2)
    assert len(ds) >= 400
    random, short = 0, 0
    for i in range(len(ds)):
        s = ds[i]
        n = int(s["padding_mask"].sum())
        assert s["text"].shape == (32,) and n <= 32
        assert s["padding_mask"][:n].all() and not s["padding_mask"][n:].any()
        text, types = s["labels"][:n], s["types"][:n]  # the unmasked ids
        assert text[0] == TOK.cls and text[-1] == TOK.sep
        seps = np.flatnonzero(text == TOK.sep)
        assert len(seps) == 2, "two segments"
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 :] == 1).all()
        assert (s["text"][n:] == TOK.pad).all() and not s["loss_mask"][n:].any()
        random += int(s["is_random"])
        short += n < 20
    assert 0.4 < random / len(ds) < 0.6, random / len(ds)
    assert short > 0, "--short-seq-prob gives shorter samples"


def test_masking_rates_over_many_samples(corpus, tmp_path):
    ds = _dataset(corpus, tmp_path, mask_prob=0.15, n=1500)
    counts = {"mask": 0, "random": 0, "same": 0}
    predicted = real = 0
    for i in range(len(ds)):
        s = ds[i]
        n = int(s["padding_mask"].sum())
        chosen = s["loss_mask"][:n] > 0
        assert chosen.sum() <= ds.opts.max_predictions
        assert not chosen[s["labels"][:n] == TOK.cls].any(), "[CLS]/[SEP] are never predicted"
        predicted += chosen.sum()
        real += n
        got, want = s["text"][:n][chosen], s["labels"][:n][chosen]
        counts["mask"] += (got == TOK.mask).sum()
        counts["same"] += (got == want).sum()
        counts["random"] += ((got != TOK.mask) & (got != want)).sum()
        assert (s["text"][:n][~chosen] == s["labels"][:n][~chosen]).all()
    assert abs(predicted / real - 0.15) < 0.01, predicted / real
    total = sum(counts.values())
    assert abs(counts["mask"] / total - 0.8) < 0.02
    assert abs(counts["same"] / total - 0.1) < 0.02  # a random id equal to the original counts here
    assert abs(counts["random"] / total - 0.1) < 0.02


def test_deterministic_by_seed_cached_and_short_documents_skipped(corpus, tmp_path):
    a, b = _dataset(corpus, tmp_path / "a"), _dataset(corpus, tmp_path / "b")
    c = _dataset(corpus, tmp_path / "a", seed=6)
    assert np.array_equal(a.samples, b.samples)
    for i in (0, 7, 99):
        for k in a[i]:
            assert np.array_equal(a[i][k], b[i][k]), k
    assert not np.array_equal(a.samples, c.samples)
    assert len(list((tmp_path / "a").glob("*-samples.npy"))) == 2  # built once per seed
    short_doc = (int(corpus.doc_idx[3]), int(corpus.doc_idx[4]))
    assert short_doc[1] - short_doc[0] == 1
    assert not ((a.samples[:, 0] >= short_doc[0]) & (a.samples[:, 0] < short_doc[1])).any()
    for first, end, _ in a.samples:  # every run has two sentences of one document
        doc = np.searchsorted(corpus.doc_idx, first, side="right") - 1
        assert end - first >= 2 and end <= corpus.doc_idx[doc + 1]


def test_no_binary_head_single_segment_and_whole_word_masking(tmp_path):
    continuation = np.zeros(200, dtype=bool)
    continuation[100:] = True  # ids >= 100 are '##' pieces
    tok = BertTokens(1, 2, 3, 0, 200, continuation)
    corpus = write_corpus(str(tmp_path / "w_text_sentence"), random_docs(20, seed=1))
    opts = BertOptions(seq_length=24, binary_head=False, whole_word_masking=True, mask_prob=0.3)
    ds = BertDataset(
        "train", corpus, range(corpus.num_documents), 100, 1, opts, tok, cache_dir=str(tmp_path)
    )
    assert (build_samples(corpus.sizes, corpus.doc_idx, range(4), 1, opts, 1)[:, 1] > 0).all()
    for i in range(len(ds)):
        s = ds[i]
        n = int(s["padding_mask"].sum())
        assert (s["labels"][:n] == TOK.sep).sum() == 1 and not s["types"].any()
        chosen, labels = s["loss_mask"][:n] > 0, s["labels"][:n]
        for j in range(1, n):  # a chosen piece's word is chosen whole
            if continuation[labels[j]] and labels[j - 1] not in (1, 2):
                assert chosen[j] == chosen[j - 1]


def test_document_level_corpus_is_refused_naming_split_sentences(tmp_path):
    docs = [[list(range(10, 20 + i))] for i in range(5)]  # one sequence per document
    corpus = write_corpus(str(tmp_path / "c_text_document"), docs)
    with pytest.raises(DataError, match="--split-sentences"):
        BertDataset("train", corpus, range(5), 10, 1, BertOptions(16), TOK, cache_dir=str(tmp_path))


def test_sentence_splitter_handles_english_and_chinese():
    from megatron.data.preprocess_inputs import split_sentences

    text = "Hello there. How are you? 今天天气很好。我们去公园！好吗？Fine.\n\nNew one"
    assert split_sentences(text) == [
        "Hello there.",
        "How are you?",
        "今天天气很好。",
        "我们去公园！",
        "好吗？",
        "Fine.",
        "New one",
    ]
    assert "".join(split_sentences(text, keep_newlines=True)) == text
