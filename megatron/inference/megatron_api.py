"""Megatron's PUT /api request: validation on rank 0 (a 400 naming the field) and the sampling
parameters it means. As in Megatron, top_k = top_p = 0 means greedy, and so does temperature 0.

    {"prompts": ["..."], "tokens_to_generate": 32, "top_k": 0, "top_p": 0.0,
     "temperature": 1.0, "random_seed": 1234}
"""

from __future__ import annotations

import json
import math
import re
import sys

from megatron.inference.generation import SamplingParams
from megatron.inference.prompt_tokens import tokenize_within, too_long

MAX_PROMPTS = 128
MAX_TOKENS = 4096
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # below 0.01, logits / T overflow float32


class BadRequest(ValueError):
    pass


class BadJSON(BadRequest):
    """The body is no JSON a request can be: `where` names the bad string (e.g. "prompt[1]"),
    None when it is the body as a whole."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone half of a UTF-16 pair: no UTF-8 for it


def _lone_surrogate(value) -> tuple[str | None, int] | None:
    """(the JSON path of the first string, or field name, holding a lone surrogate (None: the
    body itself), its index), or None. Iterative: no recursion of its own."""
    todo: list[tuple[str, object]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                todo.append((f"{path}.{k}".lstrip("."), item))
                todo.append((f"{path}.{k}".lstrip("."), k))  # the name, looked at first
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))
        elif isinstance(v, str) and (hit := _SURROGATE.search(v)):
            escaped = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", path)  # printable
            return escaped or None, hit.start()
    return None


def read_json(body: bytes):
    """The body as JSON, or BadJSON saying what is wrong with it (all client errors, 400): not
    UTF-8, not JSON, nested deeper than Python's recursion limit, an integer of more digits
    than Python converts (4300), a string with a lone UTF-16 surrogate ("\\ud800", which
    no tokenizer can encode)."""
    try:
        value = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadJSON(f"the body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise BadJSON(f"the body is not JSON: {e}") from None
    except RecursionError:
        raise BadJSON(
            "the body's JSON is nested more deeply than the server reads (about "
            f"{sys.getrecursionlimit()} levels; a request needs 3 or so)"
        ) from None
    except ValueError:  # not a JSONDecodeError: int() of more digits than Python converts
        raise BadJSON(
            f"the body's JSON has an integer of more than {sys.get_int_max_str_digits()} "
            "digits; no field takes one that large"
        ) from None
    found = _lone_surrogate(value)
    if found is not None:
        where, at = found
        what = f"'{where}'" if where else "the body"
        raise BadJSON(
            f"{what} holds a lone UTF-16 surrogate at character "
            f'{at} (e.g. "\\ud800" without its pair): send valid Unicode, the character '
            "itself or both halves of its pair",
            where,
        )
    return value


def _int_field(req: dict, name: str, default: int, low: int, high: int | None = None) -> int:
    value = req.get(name, default)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"'{name}' must be an integer {bound}, got {value!r}")
    return value


def _number_field(req: dict, name: str, default: float) -> float:
    value = req.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number, got {value!r}")
    return float(value)


def parse_request(body: bytes) -> dict:
    """A validated generation request, or BadRequest naming the field and its allowed range.

    Every value is checked here, on rank 0, before anything is broadcast: a value that passed
    can not make generation fail on a follower rank (NaN or 1e-300 temperatures used to crash
    rank 1 and with it the whole server).
    """
    req = read_json(body)
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(req) - {
        "prompts",
        "tokens_to_generate",
        "top_k",
        "top_p",
        "temperature",
        "random_seed",
    }
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)}")
    prompts = req.get("prompts")
    if (
        not isinstance(prompts, list)
        or not prompts
        or len(prompts) > MAX_PROMPTS
        or not all(isinstance(p, str) and p for p in prompts)
    ):
        raise BadRequest(f"'prompts' must be a list of 1 to {MAX_PROMPTS} non-empty strings")
    n = _int_field(req, "tokens_to_generate", 64, 1, MAX_TOKENS)
    top_k = _int_field(req, "top_k", 0, 0)
    seed = _int_field(req, "random_seed", 1234, 0, 2**63 - 1)
    top_p = _number_field(req, "top_p", 0.0)
    if not 0.0 <= top_p <= 1.0:
        raise BadRequest(f"'top_p' must be a number in [0, 1], got {top_p!r}")
    temperature = _number_field(req, "temperature", 1.0)
    if temperature != 0.0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise BadRequest(
            f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {temperature!r}"
        )
    return {
        "prompts": prompts,
        "tokens_to_generate": n,
        "top_k": top_k,
        "top_p": top_p,
        "temperature": temperature,
        "random_seed": seed,
    }


def params_of(req: dict) -> SamplingParams:
    """As in Megatron, top_k = top_p = 0 is greedy; so is temperature 0."""
    greedy = (req["top_k"] == 0 and req["top_p"] == 0.0) or req["temperature"] == 0.0
    return SamplingParams(
        req["tokens_to_generate"],
        greedy,
        req["top_k"],
        req["top_p"],
        req["temperature"] or 1.0,  # unused when greedy; SamplingParams wants > 0
        req["random_seed"],
    )


def check_length(req: dict, tokenizer, limit: int) -> None:
    """Refuse (never truncate) a request whose prompt + tokens_to_generate exceeds the model's
    positions; checked on rank 0 so followers never see it, and without tokenizing more of a
    prompt than can fit (prompt_tokens)."""
    lengths = []
    for p in req["prompts"]:
        ids = tokenize_within(tokenizer, p, limit)
        if ids is None:
            why = f"the model's context of {limit} positions"
            raise BadRequest(too_long("a prompt", limit, why))
        lengths.append(len(ids))
    longest = max(lengths)
    if longest + req["tokens_to_generate"] > limit:
        raise BadRequest(
            f"the longest prompt has {longest} tokens and 'tokens_to_generate' is "
            f"{req['tokens_to_generate']}: together more than the model's context of "
            f"{limit} positions. Shorten the prompt or ask for at most "
            f"{max(limit - longest, 0)} tokens"
        )
