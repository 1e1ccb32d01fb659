"""OpenAI's POST /v1/completions on our model: request validation, the response body, and the
chunks of a streamed response.

Supported: prompt (a string, a list of strings, a list of ids or a list of lists of ids),
max_tokens (0 scores the prompt only), temperature (0 = greedy), top_p, top_k (an extension,
as in vLLM; 0 or -1 = off), stop (a string or a list), seed (the same request gives the same
texts), logprobs (top-n alternatives per token, 0..20), echo (the prompt is returned, with its
log-probabilities when logprobs is set), n (1..16 samples per prompt; choice index =
prompt_i * n + j), best_of (n..16 samples per prompt, the n of highest mean log-probability
per generated token returned, best first; not with stream), stream (server-sent events: one
text_completion chunk per token, a last one per choice with its finish_reason, then
`data: [DONE]`), stream_options.include_usage. This is what lm-eval's `local-completions`
model and the openai client send. Everything else is refused with a 400 naming the field
(never silently ignored). A missing or null model is the served one.

A generated end-of-document token is a token of its choice (in logprobs and usage, finish_reason
"stop"), not text, as OpenAI and vLLM return it: with echo the logprobs hold the prompt and
every generated token, which lm-eval's log-likelihoods count on. A prompt string longer than
the context is refused before it is tokenized in full (prompt_tokens).
"""

from __future__ import annotations

import json
import math
import time
import uuid

from megatron.inference.megatron_api import (
    MAX_PROMPTS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    BadJSON,
    BadRequest,
    read_json,
)
from megatron.inference.prompt_tokens import tokenize_within, too_long

MAX_LOGPROBS = 20
MAX_STOPS = 16
MAX_N = 16  # n and best_of: samples per prompt
_KNOWN = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "logprobs",
    "echo",
    "n",
    "stream",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "stream_options",
}
# Fields accepted only at the value that means "off", since we do not implement them.
_ONLY = {"presence_penalty": 0, "frequency_penalty": 0}


class FieldError(BadRequest):
    """A bad field: OpenAI's error body names it in "param"."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _prompts(value, tokenizer, vocab_size: int, max_positions: int) -> list[list[int]]:
    """The prompt field as lists of ids (strings are tokenized, and refused past the context
    before they are tokenized in full)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise FieldError("prompt", "'prompt' must be a string, a list of strings or of ids")
    if all(is_int(v) for v in value):
        value = [value]  # one prompt given as ids
    if len(value) > MAX_PROMPTS:
        raise FieldError("prompt", f"'prompt' may hold at most {MAX_PROMPTS} prompts")
    out = []
    for p in value:
        if isinstance(p, str) and p:
            ids = tokenize_within(tokenizer, p, max_positions)
            if ids is None:
                why = f"the model's context of {max_positions} positions"
                raise FieldError("prompt", too_long("a 'prompt' string", max_positions, why))
            out.append(ids)
        elif isinstance(p, list) and p and all(is_int(t) and 0 <= t < vocab_size for t in p):
            out.append(p)
        else:
            raise FieldError(
                "prompt",
                f"'prompt' entries must be non-empty strings or lists of ids in [0, {vocab_size})",
            )
        if not out[-1]:
            raise FieldError("prompt", "'prompt' has a string that tokenizes to nothing")
    return out


def _int(req: dict, name: str, default, low: int, high: int):
    value = req.get(name, default)
    if value is None and default is None:
        return None
    if not is_int(value) or not low <= value <= high:
        raise FieldError(name, f"'{name}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def parse_stops(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise FieldError("stop", f"'stop' must be a string or a list of 1 to {MAX_STOPS} strings")
    return value


def _sampling(req: dict) -> dict:
    temperature = req.get("temperature", 1.0)
    if not _is_number(temperature) or not (
        temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
    ):
        raise FieldError(
            "temperature",
            f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {temperature!r}",
        )
    top_p = req.get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise FieldError("top_p", f"'top_p' must be a number in (0, 1], got {top_p!r}")
    top_k = _int(req, "top_k", 0, -1, 1 << 30)
    return {
        "greedy": temperature == 0,
        "temperature": float(temperature) or 1.0,
        "top_p": float(top_p) if top_p < 1 else 0.0,  # 0: no nucleus filter
        "top_k": max(top_k, 0),
    }


def _samples(req: dict, prompts: int) -> dict:
    """n, best_of, stream and stream_options."""
    n = _int(req, "n", 1, 1, MAX_N) if req.get("n") is not None else 1
    best_of = _int(req, "best_of", n, 1, MAX_N) if req.get("best_of") is not None else n
    if best_of < n:
        raise FieldError("best_of", f"'best_of' ({best_of}) must be at least 'n' ({n})")
    stream = req.get("stream") or False
    if not isinstance(stream, bool):
        raise FieldError("stream", "'stream' must be true or false")
    if stream and best_of != n:
        raise FieldError("best_of", "'best_of' can not be used with 'stream': leave it out")
    if prompts * best_of > MAX_PROMPTS:
        field = "n" if best_of == n else "best_of"
        raise FieldError(
            field,
            f"{prompts} prompts times '{field}' {best_of} is more than {MAX_PROMPTS} "
            "sequences: send fewer prompts or ask for fewer samples",
        )
    options = req.get("stream_options")
    if options is not None and (
        not stream
        or not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise FieldError(
            "stream_options",
            "'stream_options' must be {\"include_usage\": true or false}, with 'stream': true",
        )
    usage = bool(options and options.get("include_usage"))
    return {"n": n, "best_of": best_of, "stream": stream, "include_usage": usage}


def json_object(body: bytes) -> dict:
    """The request body as a JSON object, or FieldError (no field named)."""
    try:
        req = read_json(body)
    except BadJSON as e:
        raise FieldError(e.where, str(e)) from None
    if not isinstance(req, dict):
        raise FieldError(None, "the body must be a JSON object")
    return req


def completion_args(
    body: bytes, tokenizer, max_positions: int, vocab_size: int, served: str = "megatron"
) -> dict:
    """The validated request as the arguments of ops.complete, or FieldError. A request that
    names no model (lm-eval sends "model": null unless model= is given) gets `served`, the
    server's one model (as single-model servers do)."""
    req = json_object(body)
    unknown = sorted(set(req) - _KNOWN)
    if unknown:
        raise FieldError(unknown[0], f"unknown fields {unknown}")
    for name, only in _ONLY.items():
        if name in req and req[name] is not None and req[name] != only:
            raise FieldError(name, f"'{name}' is not supported (only {json.dumps(only)})")
    if not isinstance(req.get("model") or "", str):  # missing or null: the served model
        raise FieldError("model", "'model' must be a string (or left out: the served model)")
    if not isinstance(req.get("echo", False), bool):
        raise FieldError("echo", "'echo' must be true or false")
    prompts = _prompts(req.get("prompt"), tokenizer, vocab_size, max_positions)
    max_tokens = _int(req, "max_tokens", 16, 0, max_positions)
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > max_positions:
        raise FieldError(
            "max_tokens",
            f"the longest prompt has {longest} tokens and 'max_tokens' is {max_tokens}: together "
            f"more than the model's context of {max_positions} positions",
        )
    seed = _int(req, "seed", None, 0, 2**63 - 1)
    return {
        **_samples(req, len(prompts)),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "stop": parse_stops(req.get("stop")),
        "seed": seed if seed is not None else int(uuid.uuid4().int % (2**63)),
        "logprobs": _int(req, "logprobs", None, 0, MAX_LOGPROBS),
        "echo": req.get("echo", False),
        "model": req.get("model") or served,
        **_sampling(req),
    }


def top_dict(tokenizer, top: list) -> dict:
    """OpenAI's top_logprobs entry: {token text: log-probability} of [[id, logprob], ...]."""
    return {tokenizer.detokenize([i]): lp for i, lp in top}


def logprobs_body(tokenizer, ids: list[int], result: dict, first: int, offset0: int) -> dict:
    """OpenAI's logprobs object for ids[first:] (the first token of a prompt has no context)."""
    tokens, token_lps, tops, offsets, at = [], [], [], [], offset0
    for t in range(first, len(ids)):
        piece = tokenizer.detokenize([ids[t]])
        tokens.append(piece)
        offsets.append(at)
        at += len(piece)
        if t == 0:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(result["logprobs"][t - 1])
            tops.append(top_dict(tokenizer, result["top"][t - 1]))
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_of(args: dict, row: int) -> list[int]:
    return args["prompts"][row // args.get("n", 1)]


def usage(args: dict, results: list[dict]) -> dict:
    """OpenAI's usage: each prompt counted once, the tokens of every returned choice."""
    prompt_tokens = sum(len(p) for p in args["prompts"])
    completion_tokens = sum(len(r["ids"]) for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def head(args: dict) -> dict:
    """What the body (or every chunk) of one response starts with."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": args["model"],
    }


def completion_response(args: dict, results: list[dict], tokenizer) -> dict:
    """The OpenAI text_completion body for the results of ops.complete (prompt-major)."""
    choices = []
    for i, r in enumerate(results):
        prompt = prompt_of(args, i)
        prompt_text = tokenizer.detokenize(prompt) if args["echo"] else ""
        logprobs = None
        if args["logprobs"] is not None:
            first = 0 if args["echo"] else len(prompt)
            offset0 = 0 if args["echo"] else len(tokenizer.detokenize(prompt))
            logprobs = logprobs_body(tokenizer, prompt + r["ids"], r, first, offset0)
        choices.append(
            {
                "index": i,
                "text": prompt_text + r["text"],
                "logprobs": logprobs,
                "finish_reason": r["finish_reason"],
            }
        )
    return {**head(args), "choices": choices, "usage": usage(args, results)}


def error_body(message: str, field: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": field, "code": None}}
