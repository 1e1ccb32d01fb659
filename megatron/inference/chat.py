"""OpenAI's POST /v1/chat/completions on our model: the messages become one prompt through the
chat template (chat_template.py), and the rest is /v1/completions.

A chat request is validated here for what only chat has (messages, logprobs + top_logprobs,
max_completion_tokens, stream), then handed to openai_api.completion_args as the completions
request on the rendered prompt's ids, so the two endpoints check the sampling fields alike and
run the same operation ("complete"). The template's end-of-turn marker joins the request's
stop strings. The chat.completion body is the text_completion body reshaped
(`from_completion`); a streamed chat is the streamed completion with each text_completion
chunk reshaped into chat.completion.chunks (`chunk_from_completion`, `chat_chunks`).

Supported: messages (roles system, developer (as system), user, assistant; content a string or
a list of {"type": "text", "text": ...} parts, joined with newlines), max_completion_tokens or
max_tokens (default: the rest of the context), temperature, top_p, top_k, stop, seed, logprobs
(true/false) with top_logprobs (0..20), user, n (1..16), stream with stream_options
(include_usage), the penalties at 0; tool messages, tools and other fields are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from megatron.inference import openai_api
from megatron.inference.chat_template import ChatTemplate, TemplateRefused
from megatron.inference.openai_api import MAX_LOGPROBS, MAX_STOPS, FieldError
from megatron.inference.prompt_tokens import past_char_bound, tokenize_within, too_long

# Passed on to completion_args unchanged: the same name means the same thing there.
_SHARED = ("model", "temperature", "top_p", "top_k", "seed", "user", "n", "stream")
_SHARED += ("stream_options", "presence_penalty", "frequency_penalty")
# The fields only chat has, or that chat reads before handing them on.
_OWN = ("messages", "max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs")
_KNOWN = {*_SHARED, *_OWN}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content(value, where: str) -> str:
    """A message's content as text: a string, or text parts joined with newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise FieldError(where, f"'{where}' must be a string or a non-empty list of text parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError(
                f"{where}[{j}]", f"'{where}[{j}]' is a {kind!r} part; only text parts are served"
            )
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise FieldError(f"{where}[{j}]", f"'{where}[{j}]' must be {{type: text, text: str}}")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(value) -> list[dict]:
    """The messages as [{"role", "content": str}] (and "name" where given), or FieldError."""
    if not isinstance(value, list) or not value:
        raise FieldError("messages", "'messages' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise FieldError(where, f"'{where}' must be an object with 'role' and 'content'")
        role = m.get("role")
        if role in ("tool", "function") or "tool_calls" in m or "function_call" in m:
            raise FieldError(where, f"'{where}': tool and function calls are not supported")
        if role not in _ROLES:
            raise FieldError(
                f"{where}.role", f"'{where}.role' must be one of {sorted(_ROLES)}, got {role!r}"
            )
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise FieldError(f"{where}.{unknown[0]}", f"'{where}' has unknown fields {unknown}")
        message = {"role": _ROLES[role], "content": _content(m.get("content"), f"{where}.content")}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise FieldError(f"{where}.name", f"'{where}.name' must be a string")
            message["name"] = m["name"]
        out.append(message)
    return out


def _top_logprobs(req: dict) -> int | None:
    """completion_args' `logprobs` (alternatives per token) for chat's pair of fields."""
    wanted = req.get("logprobs", False)
    if not isinstance(wanted, bool | None):
        raise FieldError("logprobs", "'logprobs' must be true or false")
    top = req.get("top_logprobs")
    if top is not None and (not openai_api.is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise FieldError(
            "top_logprobs", f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {top!r}"
        )
    if top is not None and not wanted:
        raise FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None


def _max_tokens(req: dict, prompt_len: int, max_positions: int) -> int:
    """max_completion_tokens (OpenAI's current name) or max_tokens; by default the rest of the
    context (as vLLM). The sum with the prompt is checked by completion_args."""
    given = {k: req[k] for k in ("max_completion_tokens", "max_tokens") if req.get(k) is not None}
    if len(given) == 2 and given["max_completion_tokens"] != given["max_tokens"]:
        raise FieldError("max_completion_tokens", "'max_completion_tokens' and 'max_tokens' differ")
    name, value = next(iter(given.items()), (None, None))
    if value is None:
        return max_positions - prompt_len
    if not openai_api.is_int(value) or not 1 <= value <= max_positions:
        raise FieldError(
            name, f"'{name}' must be an integer in [1, {max_positions}], got {value!r}"
        )
    return value


def _context_why(max_positions: int) -> str:
    return f"the model's context of {max_positions} positions, less one for the reply"


def _refuse_text_past_the_context(messages: list[dict], tokenizer, max_positions: int) -> None:
    """The messages' own text already past what the context's ids can stand for is refused
    before the template renders it."""
    chars = sum(len(m["content"]) for m in messages)
    if past_char_bound(tokenizer, chars, max_positions - 1):
        why = _context_why(max_positions)
        raise FieldError("messages", too_long("the messages' text", max_positions - 1, why))


def chat_args(
    body: bytes,
    tokenizer,
    max_positions: int,
    vocab_size: int,
    template: ChatTemplate,
    served: str = "megatron",
) -> dict:
    """The validated chat request as the arguments of ops.complete (completion_args' dict;
    `served` as there)."""
    req = openai_api.json_object(body)
    unknown = sorted(set(req) - _KNOWN)
    if unknown:
        raise FieldError(unknown[0], f"unknown fields {unknown}")
    messages = parse_messages(req.get("messages"))
    _refuse_text_past_the_context(messages, tokenizer, max_positions)
    try:
        rendered = template.render(messages)
    except TemplateRefused as e:
        raise FieldError("messages", str(e)) from None
    prompt = tokenize_within(tokenizer, rendered, max_positions - 1)  # room for the reply
    if not prompt:
        what = f"the conversation rendered by {template.origin}"
        if prompt is None:
            message = too_long(what, max_positions - 1, _context_why(max_positions))
        else:
            message = f"{what} has no tokens; the reply needs a prompt"
        raise FieldError("messages", message)
    stops = openai_api.parse_stops(req.get("stop"))
    if len(stops) + len(template.stops) > MAX_STOPS:
        most = MAX_STOPS - len(template.stops)
        raise FieldError(
            "stop",
            f"'stop' may hold at most {most} strings on chat (the template "
            f"adds its end-of-turn marker {list(template.stops)})",
        )
    completion = {k: req[k] for k in _SHARED if k in req}
    completion.update(
        prompt=prompt,
        max_tokens=_max_tokens(req, len(prompt), max_positions),
        stop=stops + [s for s in template.stops if s not in stops],
        logprobs=_top_logprobs(req),
    )
    try:
        return openai_api.completion_args(
            json.dumps(completion).encode(), tokenizer, max_positions, vocab_size, served
        )
    except FieldError as e:
        if e.field == "max_tokens" and req.get("max_completion_tokens") is not None:
            message = str(e).replace("'max_tokens'", "'max_completion_tokens'")
            raise FieldError("max_completion_tokens", message) from None
        raise


def _chat_logprobs(logprobs: dict | None) -> dict | None:
    """A text_completion logprobs object -> chat's {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}."""
    if logprobs is None:
        return None
    content = []
    for token, lp, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        alternatives = [
            {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
            for t, v in (top or {}).items()
        ]
        content.append(
            {
                "token": token,
                "logprob": lp,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content}


def _chat_id(completion_id: str) -> str:
    return "chatcmpl-" + completion_id.removeprefix("cmpl-")


def from_completion(completion: dict) -> dict:
    """A text_completion body (openai_api.completion_response) as a chat.completion."""
    choices = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "logprobs": _chat_logprobs(c["logprobs"]),
            "finish_reason": c["finish_reason"],
        }
        for c in completion["choices"]
    ]
    return {
        **completion,
        "id": _chat_id(completion["id"]),
        "object": "chat.completion",
        "choices": choices,
    }


def chat_response(args: dict, results: list[dict], tokenizer) -> dict:
    """The chat.completion body for the results of ops.complete on chat_args."""
    return from_completion(openai_api.completion_response(args, results, tokenizer))


def chunk_from_completion(chunk: dict, started: frozenset = frozenset()):
    """One text_completion streaming chunk -> (the chat.completion.chunk bodies to send, the
    choice indexes started so far). `started` holds the indexes that already had a chunk:
    a choice's first chunk is preceded by one whose delta is {"role": "assistant",
    "content": ""}; text (or logprobs) goes out as {"content": text}; a finish_reason goes out
    last, in a chunk with an empty delta. Pure: the caller keeps `started` between chunks."""
    out = []
    base = {"id": _chat_id(chunk["id"]), "object": "chat.completion.chunk"}  # OpenAI's order
    base.update((k, v) for k, v in chunk.items() if k not in ("id", "object", "choices"))

    def emit(index: int, delta: dict, logprobs=None, finish_reason=None) -> None:
        choice = {"index": index, "delta": delta, "logprobs": logprobs}
        out.append({**base, "choices": [{**choice, "finish_reason": finish_reason}]})

    if not chunk["choices"]:  # e.g. the usage chunk at the end of a stream
        out.append({**base, "choices": []})
    for c in chunk["choices"]:
        i = c["index"]
        if i not in started:
            emit(i, {"role": "assistant", "content": ""})
            started = started | {i}
        if c.get("text") or c.get("logprobs"):
            emit(i, {"content": c.get("text") or ""}, _chat_logprobs(c.get("logprobs")))
        if c.get("finish_reason") is not None:
            emit(i, {}, finish_reason=c["finish_reason"])
    return out, started


async def chat_chunks(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """A streamed chat: the text_completion chunks of openai_stream.completion_chunks as
    chat.completion.chunk bodies (an error object passes through as it is)."""
    started: frozenset = frozenset()
    async for chunk in chunks:
        if "error" in chunk:
            yield chunk
            continue
        out, started = chunk_from_completion(chunk, started)
        for body in out:
            yield body
