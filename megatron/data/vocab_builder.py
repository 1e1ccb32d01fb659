"""Character and WordPiece vocabularies (`vocab.txt`) for the BERT WordPiece tokenizers, built
from the user's own corpus (tools/train_tokenizer.py --type char / wordpiece).

`char` is GPT2-Chinese's make_vocab: every character seen at least `min_frequency` times, most
frequent first, after the special tokens. CJK characters are tokens on their own (the BERT
normalizer isolates them); a letter or digit may also continue a word, so it is listed a second
time as `##c`, and Latin words then tokenize one character at a time instead of to [UNK].
`wordpiece` trains BERT's WordPiece with HF `tokenizers`. Both normalize the text exactly as
the tokenizer will (`BertNormalizer`, lowercased with `lowercase`), so no vocab entry is
unreachable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from megatron.data.wordpiece_text import is_cjk_char

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
REQUIRED = ("[UNK]", "[SEP]")  # the tokenizer's unknown and end-of-document tokens


def special_tokens(given: Iterable[str] | None) -> list[str]:
    """The special tokens to write first: BERT's by default; [UNK] and [SEP] always."""
    tokens = list(given) if given else list(BERT_SPECIAL_TOKENS)
    return tokens + [t for t in REQUIRED if t not in tokens]


def _normalizer(lowercase: bool):
    return normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )


def count_characters(docs: Iterable[str], lowercase: bool) -> Counter:
    """How often each non-space character occurs after the tokenizer's normalization."""
    norm, counts = _normalizer(lowercase), Counter()
    for doc in docs:
        counts.update(norm.normalize_str(doc))
    for space in [c for c in counts if c.isspace()]:
        del counts[space]
    return counts


def char_vocab(
    counts: Counter, min_frequency: int, specials: list[str], max_size: int | None = None
) -> list[str]:
    """[special tokens, characters by falling count (then code point), `##c` continuations]."""
    chars = sorted(
        (c for c, n in counts.items() if n >= min_frequency), key=lambda c: (-counts[c], c)
    )
    vocab = list(specials)
    seen = set(vocab)
    for c in chars:
        if c not in seen:
            vocab.append(c)
            seen.add(c)
    for c in chars:
        if c.isalnum() and not is_cjk_char(c) and f"##{c}" not in seen:
            vocab.append(f"##{c}")
            seen.add(f"##{c}")
    if max_size is not None:
        vocab = vocab[:max_size]
    return vocab


def write_vocab(vocab: list[str], out: Path) -> Path:
    path = out / "vocab.txt"
    path.write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
    return path


def train_char(
    docs: Iterable[str], out: Path, *, min_frequency: int, specials, lowercase, max_size=None
) -> list[Path]:
    counts = count_characters(docs, lowercase)
    vocab = char_vocab(counts, min_frequency, special_tokens(specials), max_size)
    return [write_vocab(vocab, out)]


def train_wordpiece(
    docs: Iterable[str], out: Path, *, vocab_size: int, min_frequency: int, specials, lowercase
) -> list[Path]:
    """BERT WordPiece over the corpus, pre-tokenized as BertWordPieceTokenizer will."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = _normalizer(lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens(specials),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return [write_vocab([t for t, _ in vocab], out)]
