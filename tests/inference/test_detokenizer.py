"""The incremental detokenizer (megatron/inference/detokenizer.py) gives, piece by piece, exactly
the full decode of a long generation of random ids, split multi-byte characters included, for
every tokenizer kind we serve: the fixture GPT-2 BPE and tokenizer.json (byte-level), a
Llama-style SentencePiece model (leading '▁' dropped at a text's start, byte fallback) and a
Llama-2-style tokenizer.json (Metaspace pieces, ByteFallback decoder, a Strip of the first
space); and stop strings end a row where decoding everything at every step ends it."""

import io
import json
import random

import pytest

from megatron.data.tokenizers import build_tokenizer
from megatron.inference.detokenizer import IncrementalText
from megatron.inference.streaming import RowText
from tests.helpers.paths import MMAP, ROOT
from tests.helpers.serving import fixture_tokenizer

# Text whose characters span several byte-level tokens (CJK, emoji, accents).
MULTILINGUAL = "分布式训练很好 🙂 東京 😀👍 café ünïcode ∮ Ωμέγα, x = 1\n"


def _lines() -> list[str]:
    source = (ROOT / "megatron" / "data" / "tokenizers.py").read_text(encoding="utf-8")
    return [line for line in (source + "\n" + MULTILINGUAL * 3).splitlines() if line.strip()]


def _sentencepiece(tmp_path):
    """A Llama-style SentencePiece BPE (dummy prefix '▁', byte fallback), trained here."""
    spm = pytest.importorskip("sentencepiece", reason="pip install sentencepiece to test it")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    path = tmp_path / "llama.model"
    path.write_bytes(model.getvalue())
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=path)


def _llama2_json(tmp_path):
    """A tokenizer.json shaped like Llama 2's: Metaspace pieces, <0xXX> byte tokens, and the
    decoder Replace('▁', ' ') -> ByteFallback -> Fuse -> Strip(one leading space)."""
    from tokenizers.implementations import SentencePieceBPETokenizer

    hf = SentencePieceBPETokenizer()
    hf.train_from_iterator(_lines(), vocab_size=300, special_tokens=["<unk>", "</s>"])
    spec = json.loads(hf.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    replace = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    chain = [replace, {"type": "ByteFallback"}, {"type": "Fuse"}, strip]
    spec["decoder"] = {"type": "Sequence", "decoders": chain}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)


@pytest.fixture(scope="module", params=["gpt2-bpe", "tokenizer.json", "sentencepiece", "llama2"])
def tokenizer(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2-bpe":
        return fixture_tokenizer()
    if request.param == "tokenizer.json":
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=MMAP / "tokenizer.json")
    if request.param == "sentencepiece":
        return _sentencepiece(tmp)
    return _llama2_json(tmp)


def _random_ids(tokenizer, n: int, seed: int) -> list[int]:
    """n ids: random ones from the whole vocab (the end of document left out), and runs of
    multi-byte text's ids, started anywhere, so characters are split across tokens."""
    rng = random.Random(seed)
    pieces = tokenizer.tokenize(MULTILINGUAL)
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.5:
            ids.extend(i for i in rng.sample(range(tokenizer.vocab_size), 4) if i != tokenizer.eod)
        else:
            at = rng.randrange(len(pieces))
            ids.extend(pieces[at : at + rng.randrange(1, 8)])
    return ids[:n]


def test_every_step_is_the_full_decode(tokenizer):
    ids = _random_ids(tokenizer, 400, seed=1)
    inc, text = IncrementalText(tokenizer), ""
    for k, token in enumerate(ids):
        piece = inc.add(token)
        assert not piece.endswith("\ufffd"), k  # settled text never ends in a split character
        text += piece
        assert text + inc.pending == tokenizer.detokenize(ids[: k + 1]), k
    assert inc.prefix > 0 and len(inc.ids) - inc.prefix < 40  # the window moved along


def test_a_long_generation_is_the_full_decode(tokenizer):
    ids = _random_ids(tokenizer, 3000, seed=2)
    inc = IncrementalText(tokenizer)
    pieces = [inc.add(t) for t in ids]
    assert "".join(pieces) + inc.pending == tokenizer.detokenize(ids)
    assert sum(map(bool, pieces)) > 300  # text came out along the way, not only at the end


def _reference(tokenizer, ids: list[int], stops: list[str], max_tokens: int):
    """What a row gives when every step decodes all its ids: (text, finish)."""
    for k in range(1, len(ids) + 1):
        if ids[k - 1] == tokenizer.eod:
            return tokenizer.detokenize(ids[: k - 1]), "stop"
        text = tokenizer.detokenize(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], "stop"
        if k >= max_tokens:
            return text, "length"
    raise AssertionError("the ids end before the row does")


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_end_a_row_where_full_decodes_end_it(tokenizer, seed):
    ids = _random_ids(tokenizer, 600, seed=seed) + [tokenizer.eod]
    full = tokenizer.detokenize(ids[:-1])
    rng = random.Random(seed)
    # Stops taken from the text itself (one late, one split-character), and one never there.
    late = rng.randrange(len(full) // 2, len(full) - 8)
    stops = [full[late : late + rng.randrange(1, 6)], "\U0001f642 東", "never-in-it"]
    max_tokens = [len(ids), len(ids), 200, 1][seed % 4]
    row, deltas = RowText(tokenizer, stops, max_tokens), []
    for token in ids:
        deltas.append(row.add(token))
        if row.finish:
            break
        assert full.startswith("".join(deltas))  # nothing is taken back
    assert ("".join(deltas), row.finish) == _reference(tokenizer, ids, stops, max_tokens)
