"""Chat templates: how a list of chat messages becomes the one prompt text the model continues.

Where the template comes from (the server's --chat-template, as vLLM's flag of that name):
    --chat-template NAME   a built-in: `plain` (for base models) or `chatml`
    --chat-template FILE   a Jinja template file, as Hugging Face tokenizers store them
    (no flag)              the tokenizer's own template: `chat_template.jinja`, else the
                           "chat_template" of `tokenizer_config.json`, in the directory of a
                           HuggingFaceTokenizer / SentencePieceTokenizer checkpoint tokenizer;
                           with none (GPT-2 BPE files have none), the built-in `plain`.

Templates render as Hugging Face renders them (`apply_chat_template`): Jinja in a sandbox that
cannot touch Python objects, trim_blocks / lstrip_blocks, the loop-controls extension, and the
variables messages, add_generation_prompt (always true here), bos_token, eos_token, tools and
documents (None), and the functions raise_exception and strftime_now. A render is bounded: at
most RENDER_SECONDS of the template's own code (a loop that runs away, e.g. nested
range(100000), is stopped), RENDER_CHARS of output, and `*` / `**` that would make a string,
list or number past that size are refused; a template that fails on the messages in any way is
the client's 400 naming the template (TemplateRefused), never the server's 500.

A reply ends at the template's end-of-turn marker, which is a stop string and never returned:
the built-ins' own, and for other templates whichever of END_OF_TURN_MARKERS the template's
text contains; the tokenizer's eos_token (from tokenizer_config.json) is one for every template.

The built-in `plain` template, for base models that were never taught a chat format:

    {system message}\\n\\n            (each system message)
    User: {content}\\n\\n             (each user message)
    Assistant: {content}\\n\\n        (each assistant message)
    Assistant:                      (the reply follows; it stops at "\\nUser:")
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime

PLAIN = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content + '\\n\\n' }}"
    "{% elif m.role == 'user' %}{{ 'User: ' + m.content + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ' + m.content + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN = {"plain": (PLAIN, ("\nUser:",)), "chatml": (CHATML, ("<|im_end|>",))}
# End-of-turn markers of common chat formats (ChatML, Llama 3, Phi-3, Gemma).
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
RENDER_SECONDS = 5.0  # of the template's own code per render; real templates take milliseconds
RENDER_CHARS = 8 << 20  # the rendered prompt, and any string or list made on the way


class TemplateRefused(ValueError):
    """The template raised (raise_exception, or a Jinja error) on these messages."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template, where it came from (for messages), and its end-of-turn stops."""

    source: str
    origin: str  # e.g. "the built-in 'plain' template", "--chat-template my.jinja"
    stops: tuple[str, ...] = ()
    special: dict = field(default_factory=dict)  # bos_token / eos_token the template may use

    def __post_init__(self):
        object.__setattr__(self, "_compiled", _compile(self.source, self.origin))

    def render(self, messages: list[dict]) -> str:
        """The prompt text for `messages` ({"role", "content": str}), ending where the
        assistant's reply begins."""
        variables = {"bos_token": "", "eos_token": "", **self.special}
        pieces = self._compiled.generate(
            messages=messages, add_generation_prompt=True, tools=None, documents=None, **variables
        )
        out, size = [], 0
        try:
            with _Deadline(RENDER_SECONDS, self.origin):
                for piece in pieces:
                    size += len(piece)
                    if size > RENDER_CHARS:
                        raise _TooLarge(f"its output passed {RENDER_CHARS} characters")
                    out.append(piece)
        except _TooLarge as e:
            raise TemplateRefused(f"{self.origin} was stopped on these messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - raise_exception, a Jinja or a Python error
            raise TemplateRefused(f"{self.origin} refused the messages: {e}") from None
        return "".join(out)


class _TooLarge(Exception):
    """A render passed RENDER_SECONDS or RENDER_CHARS."""


class _Deadline:
    """While in effect, the template's own code (its compiled frames, file "<template>") raises
    _TooLarge once `seconds` have passed, checked at each line it runs. A trace function,
    because a Jinja loop calls nothing the sandbox could watch; it is this thread's only, and
    the one before it (a debugger, coverage) is put back after."""

    def __init__(self, seconds: float, origin: str):
        self.seconds, self.origin = seconds, origin

    def __enter__(self):
        self.until = time.monotonic() + self.seconds
        self.before = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self.before)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame, event, arg):
        if time.monotonic() > self.until:
            raise _TooLarge(f"it ran for more than {self.seconds:g} s (a loop that runs away?)")
        return self._line


def _bounded(value):
    if isinstance(value, str | list | tuple) and len(value) > RENDER_CHARS:
        raise _TooLarge(f"it made a value of more than {RENDER_CHARS} items")
    return value


class _BoundedSandbox:
    """ImmutableSandboxedEnvironment's `*` and `**`, refused when the result would pass
    RENDER_CHARS items (a string or list) or digits (a number), before it is made; and a value
    read (a variable's attribute or item, e.g. a namespace's string doubled in a loop) that
    has passed RENDER_CHARS items."""

    intercepted_binops = frozenset({"*", "**"})

    def getattr(self, obj, attribute):
        return _bounded(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return _bounded(super().getitem(obj, argument))

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            sized = [v for v in (left, right) if isinstance(v, str | list | tuple)]
            times = [v for v in (left, right) if isinstance(v, int)]
            if sized and times and len(sized[0]) * times[0] > RENDER_CHARS:
                raise _TooLarge(f"'*' would make more than {RENDER_CHARS} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * max(abs(left), 2).bit_length() > 4 * RENDER_CHARS:
                raise _TooLarge(f"'**' would make a number of more than {RENDER_CHARS} digits")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates want JSON as written.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile(source: str, origin: str):
    """The Jinja template, or a ValueError naming where it came from and the bad line."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(_BoundedSandbox, ImmutableSandboxedEnvironment):
        pass

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        line = source.splitlines()[e.lineno - 1].strip() if e.lineno else ""
        raise ValueError(
            f"{origin}: not a valid Jinja template: line {e.lineno}: {e.message} ({line[:80]!r})"
        ) from None


def _stops_in(source: str) -> tuple[str, ...]:
    return tuple(m for m in END_OF_TURN_MARKERS if m in source)


def _with_eos(stops: tuple[str, ...], special: dict) -> tuple[str, ...]:
    eos = special.get("eos_token")
    return stops + (eos,) if eos and eos not in stops else stops


def from_flag(value: str) -> ChatTemplate:
    """--chat-template: a built-in name, a template file, or (as vLLM takes it) the template
    itself inline when it is no file and holds Jinja markup; checked before the model loads."""
    if value in BUILTIN:
        source, stops = BUILTIN[value]
        return ChatTemplate(source, f"the built-in {value!r} chat template", stops)
    if not os.path.isfile(value):
        if "{{" in value or "{%" in value:
            return ChatTemplate(value, "--chat-template (inline)", _stops_in(value))
        raise ValueError(
            f"--chat-template {value}: no such file and not a built-in template; pass a Jinja "
            f"template file, the template inline, or one of {', '.join(BUILTIN)}"
        )
    try:
        with open(value, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {value}: cannot read it as UTF-8 text ({e})") from None
    return ChatTemplate(source, f"--chat-template {value}", _stops_in(source))


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_files(tokenizer) -> tuple[str | None, dict, str]:
    """(the template in the tokenizer's directory or None, its special tokens, its origin)."""
    path = tokenizer.build_args[1].get("tokenizer_model")
    if path is None:
        return None, {}, ""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_path}: cannot read it as JSON ({e})") from None
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    special = {k: v for k, v in special.items() if v is not None}
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):  # what transformers >= 4.50 saves, ahead of the config
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read(), special, f"the tokenizer's {jinja_path}"
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{jinja_path}: cannot read it as UTF-8 text ({e})") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    origin = f"the chat_template of the tokenizer's {config_path}"
    return (source if isinstance(source, str) else None), special, origin


def resolve(flag: ChatTemplate | None, tokenizer, log=None) -> ChatTemplate:
    """The template the server uses: --chat-template, else the tokenizer's, else `plain` (said
    once on `log`, stderr by default). Special tokens come from the tokenizer's config."""
    source, special, origin = _tokenizer_files(tokenizer)
    if flag is not None:
        return ChatTemplate(flag.source, flag.origin, _with_eos(flag.stops, special), special)
    if source is not None:
        return ChatTemplate(source, origin, _with_eos(_stops_in(source), special), special)
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    log(
        f"[server] the tokenizer ({tokenizer.name}) has no chat template and no --chat-template "
        "was given: /v1/chat/completions uses the built-in 'plain' template (User: / Assistant:)"
    )
    plain, stops = BUILTIN["plain"]
    return ChatTemplate(
        plain, "the built-in 'plain' chat template", _with_eos(stops, special), special
    )
