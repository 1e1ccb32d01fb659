"""The kind of each transformer layer, computed once from the config (`layer_kinds`), and
--moe-layer-freq's value that decides it today: an integer k, or a Python-style list expression
of 0/1 per layer as Megatron-core writes it ('([0]*3+[1]*58)', '[1,0,1,0]'), read by a small
parser of its own (integers, lists, `*`, `+` and parentheses), never by eval(). Standard library
only.

A kind is a name the model's registry (megatron.model.layer_kinds) builds a layer from; a later
pattern (a hybrid stack's string of Mamba / attention / MLP layers) is one more source of the
same per-layer list. A windowed layer (--window-size, on the layers --window-attn-skip-freq
leaves windowed, its list read by the same parser) is attention with a window: kinds of their
own, WINDOW_ATTENTION_MLP and WINDOW_ATTENTION_MOE."""

from __future__ import annotations

import functools
import re

from megatron.config.declare import ConfigError

FLAG = "--moe-layer-freq"
WINDOW_FLAG = "--window-attn-skip-freq"
_FIXES = {
    FLAG: "pass an integer k (every k-th layer is MoE) or a list of 0 (dense) / 1 (MoE) per "
    "layer written with lists, integers, * and +, e.g. '([0]*3+[1]*58)'",
    WINDOW_FLAG: "pass an integer N (every N-th layer global, the others windowed) or a list "
    "of 1 (windowed) / 0 (global) per layer written with lists, integers, * and +, e.g. "
    "'([1]*5+[0]*1)*4'",
}
_LIMIT = 1_000_000  # no layer count, list or repeat is larger: a typo, not a model
_TOKEN = re.compile(r"\d+|[\[\]\(\),*+]")
_DEPTH = 100  # nested parentheses / lists: deeper is a typo, and would exhaust the stack

# The layer kinds of a transformer stack today (megatron.model.layer_kinds builds them).
ATTENTION_MLP = "attention+mlp"  # self-attention, then the dense MLP
ATTENTION_MOE = "attention+moe"  # self-attention, then a router and experts
WINDOW_ATTENTION_MLP = "window-attention+mlp"  # sliding-window self-attention, dense MLP
WINDOW_ATTENTION_MOE = "window-attention+moe"  # sliding-window self-attention, experts
_WINDOWED = {ATTENTION_MLP: WINDOW_ATTENTION_MLP, ATTENTION_MOE: WINDOW_ATTENTION_MOE}


def layer_kinds(model) -> tuple[str, ...]:
    """The kind of each of the model config's --num-layers layers: attention + MoE where
    --moe-layer-freq says (with --num-experts), attention + dense MLP elsewhere; its attention
    windowed where --window-size and --window-attn-skip-freq say."""
    pattern, windows = model.moe_layer_pattern, model.window_layers
    kinds = []
    for i in range(model.num_layers):
        kind = ATTENTION_MOE if i < len(pattern) and pattern[i] == 1 else ATTENTION_MLP
        kinds.append(_WINDOWED[kind] if i < len(windows) and windows[i] else kind)
    return tuple(kinds)


def window_layer_pattern(windowed: bool, skip_freq, num_layers: int) -> tuple[int, ...]:
    """1 for each windowed layer, as Megatron-core's is_layer_window_attention: none without a
    window; every layer without --window-attn-skip-freq; an int N: layer number (1-based) n is
    global where n % N == 0; a list: its entries (its own length)."""
    if not windowed:
        return (0,) * num_layers
    if skip_freq is None:
        return (1,) * num_layers
    freq = parse_layer_freq(str(skip_freq), WINDOW_FLAG)
    if isinstance(freq, int):
        return tuple(int((i + 1) % freq != 0) for i in range(num_layers))
    return freq


def expand_layer_freq(value, num_layers: int) -> tuple[int, ...]:
    """--moe-layer-freq as one 0/1 entry per layer (an int k: 1 where i % k == 0); a pattern
    keeps its own length (megatron.config.rules_moe refuses one that is not --num-layers)."""
    freq = parse_layer_freq(str(value))
    if isinstance(freq, int):
        return tuple(int(i % freq == 0) for i in range(num_layers))
    return freq


def _refuse(value: str, problem: str, flag: str = FLAG) -> ConfigError:
    shown = repr(value) if len(value) <= 80 else f"{value[:60]!r}... ({len(value)} characters)"
    return ConfigError(f"{flag}: {shown} {problem}. Fix: {_FIXES[flag]}")


@functools.lru_cache(maxsize=64)
def parse_layer_freq(value: str, flag: str = FLAG) -> int | tuple[int, ...]:
    """`value` as an int k >= 1 or a tuple of 0/1 per layer; ConfigError naming `flag`
    (--moe-layer-freq, or --window-attn-skip-freq, which is read alike)."""
    text = "".join(str(value).split())
    tokens = _TOKEN.findall(text)
    if not text or "".join(tokens) != text:
        raise _refuse(value, "is not an integer or a list expression", flag)
    parser = _Parser(tokens, value, flag)
    out = parser.expr()
    if parser.pos != len(tokens):
        raise _refuse(value, f"has an unexpected {tokens[parser.pos]!r}", flag)
    if isinstance(out, int):
        if out < 1:
            raise _refuse(value, "must be at least 1", flag)
        return out
    if any(v not in (0, 1) for v in out):
        raise _refuse(value, "holds entries other than 0 and 1", flag)
    return tuple(out)


class _Parser:
    """expr := term ('+' term)*; term := atom ('*' atom)*; atom := INT | '[' exprs ']' |
    '(' expr ')'. Values are ints or lists of ints, with Python's + and * on them."""

    def __init__(self, tokens: list[str], value: str, flag: str = FLAG):
        self.tokens, self.value, self.pos, self.depth = tokens, value, 0, 0
        self.flag = flag

    def _fail(self, problem: str) -> ConfigError:
        return _refuse(self.value, problem, self.flag)

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            want = f"{expected!r}" if expected else "more"
            raise self._fail(f"ends where {want} was expected")
        self.pos += 1
        return token

    def expr(self):
        out = self.term()
        while self._peek() == "+":
            self._take()
            right = self.term()
            if isinstance(out, int) != isinstance(right, int):
                raise self._fail("adds a list and an integer")
            self._check(len(out) + len(right) if isinstance(out, list) else out + right)
            out = out + right
        return out

    def term(self):
        out = self.atom()
        while self._peek() == "*":
            self._take()
            right = self.atom()
            if isinstance(out, list) and isinstance(right, list):
                raise self._fail("multiplies two lists")
            size = (len(out) if isinstance(out, list) else out) * (
                len(right) if isinstance(right, list) else right
            )
            self._check(size)  # before the product is built
            out = out * right
        return out

    def atom(self):
        token = self._take()
        if token.isdigit():
            return self._check(int(token) if len(token) <= 8 else _LIMIT + 1)
        if token in ("(", "["):
            self.depth += 1
            if self.depth > _DEPTH:
                raise self._fail(f"nests parentheses or lists deeper than {_DEPTH}")
            out = self._group(token)
            self.depth -= 1
            return out
        raise self._fail(f"has an unexpected {token!r}")

    def _group(self, token: str):
        """'(' expr ')' or '[' exprs ']', its opening token taken."""
        if token == "(":
            out = self.expr()
            self._take(")")
            return out
        items = []
        while self._peek() != "]":
            item = self.expr()
            if not isinstance(item, int):
                raise self._fail("nests lists")
            items.append(item)
            if self._peek() != "]":
                self._take(",")
        self._take("]")
        return items

    def _check(self, v: int):
        if v > _LIMIT:
            raise self._fail(f"is larger than {_LIMIT}")
        return v
