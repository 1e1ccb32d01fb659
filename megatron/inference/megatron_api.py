"""Megatron's PUT /api request: validation on rank 0 (a 400 naming the field) and the sampling
parameters it means. As in Megatron, top_k = top_p = 0 means greedy, and so does temperature 0.

    {"prompts": ["..."], "tokens_to_generate": 32, "top_k": 0, "top_p": 0.0,
     "temperature": 1.0, "random_seed": 1234}
"""

from __future__ import annotations

import json
import math

from megatron.inference.generation import SamplingParams
from megatron.inference.prompt_tokens import tokenize_within, too_long

MAX_PROMPTS = 128
MAX_TOKENS = 4096
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # below 0.01, logits / T overflow float32


class BadRequest(ValueError):
    pass


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
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
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
