"""WordPiece tokens back to text, for scripts written with and without spaces between words
(BERT's WordPiece tokenizers; the vocabulary builder asks which characters are CJK)."""

from __future__ import annotations

from collections.abc import Iterable

# Scripts written without spaces between words: BERT's CJK ideograph blocks (the characters its
# normalizer isolates), kana, and CJK / full-width punctuation.
_NO_SPACE_RANGES = (
    (0x3000, 0x30FF),  # CJK symbols and punctuation, hiragana, katakana
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0xFF00, 0xFFEF),  # full-width forms (，！？ etc.)
    (0x20000, 0x2FA1F),
)
_NO_SPACE_BEFORE = set(".,!?;:%)]}")
_NO_SPACE_AFTER = set("([{")


def is_cjk_char(c: str) -> bool:
    """True for a character of a script written without spaces between words (CJK)."""
    cp = ord(c)
    return any(lo <= cp <= hi for lo, hi in _NO_SPACE_RANGES)


def join_wordpieces(tokens: Iterable[str]) -> str:
    """WordPiece tokens -> text: `##x` continues the word; no space is put next to a CJK
    character (分布式训练, not 分 布 式 训 练) or before closing punctuation; Latin words keep
    their spaces."""
    out: list[str] = []
    for tok in tokens:
        if not tok:
            continue
        if tok.startswith("##") and len(tok) > 2 and out:
            out.append(tok[2:])
            continue
        if out:
            prev, nxt = out[-1][-1], tok[0]
            joined = is_cjk_char(prev) or is_cjk_char(nxt)
            if not (joined or nxt in _NO_SPACE_BEFORE or prev in _NO_SPACE_AFTER):
                out.append(" ")
        out.append(tok)
    return "".join(out)
