"""What every inference CLI shares: the checkpoint flags, start-up, and prompt completion.

The generation CLI, the evaluation CLI and the HTTP server all import these from here, so no
CLI module imports another.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator

from megatron.checkpoint.storage import CheckpointError
from megatron.config.inference import (
    check_against_checkpoint,
    inference_config,
    precision_dtype,
    tokenizer_overrides,
)
from megatron.config.rules import validate
from megatron.inference.engine import load_inference_model
from megatron.inference.generation import SamplingParams, generate
from megatron.initialize import initialize_megatron, read_launch_env, shutdown_distributed


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The flags every inference tool shares: which checkpoint, and how it is pipelined."""
    p.add_argument("--load", required=True, help="checkpoint directory (shapes come from it)")
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="PP of the checkpoint (TP = processes / PP)",
    )


def setup(load: str, pp: int = 1, given: dict | None = None):
    """(runtime, engine, tokenizer, iteration). `given`: the training flags of the command line
    (megatron.config.inference): layout, backend, precision and tokenizer are used, shapes must
    match the checkpoint."""
    given = given or {}
    env = read_launch_env()
    cfg = validate(inference_config(given, env.world_size, pp), "inference")
    rt = initialize_megatron(cfg, env)
    engine, tokenizer, iteration = load_inference_model(
        load, rt, dtype=precision_dtype(given), tokenizer=tokenizer_overrides(given)
    )
    check_against_checkpoint(given, engine.model.cfg, load)
    if tokenizer is None:
        raise ValueError(f"--load {load}: the checkpoint records no tokenizer (trained on ids)")
    return rt, engine, tokenizer, iteration


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids a prompt starts from. An empty prompt starts a new document: [end-of-document],
    the context of an unconditional sample (Megatron's generate_samples_unconditional)."""
    return tokenizer.tokenize(text) if text else [tokenizer.eod]


def complete_iter(
    engine,
    tokenizer,
    texts: list[str],
    params: SamplingParams,
    batch_size: int | None = None,
    **generate_kwargs,
) -> Iterator[list[dict]]:
    """The completions of `texts`, one list per batch of `batch_size` (None: one batch).
    Batch i samples with seed + i, so batches of the same prompts differ. Each is
    {"prompt", "text", "tokens", "finish_reason"}: "stop" when it reached end-of-document (its
    id is the last of "tokens", its text is never in "text"), else "length", with a "note" when
    the context (max_length, default the model's positions) ended it before max_new_tokens."""
    step = max(batch_size or len(texts), 1)
    limit = generate_kwargs.get("max_length") or engine.model.cfg.max_positions
    for i in range(0, len(texts), step):
        chunk = texts[i : i + step]
        prompts = [prompt_ids(tokenizer, t) for t in chunk]
        seeded = dataclasses.replace(params, seed=params.seed + i // step)
        ids = generate(engine, prompts, seeded, eod=tokenizer.eod, **generate_kwargs)
        out = []
        for text, prompt, seq in zip(chunk, prompts, ids, strict=True):
            result = _result(tokenizer, seq[len(prompt) :], params.max_new_tokens, len(seq), limit)
            out.append({"prompt": text, **result})
        yield out


def _result(tokenizer, new: list[int], wanted: int, length: int, limit: int) -> dict:
    """One continuation's text (end-of-document left out), ids and why it ended."""
    if new and new[-1] == tokenizer.eod:
        return {"text": tokenizer.detokenize(new[:-1]), "tokens": new, "finish_reason": "stop"}
    result = {"text": tokenizer.detokenize(new), "tokens": new, "finish_reason": "length"}
    if len(new) < wanted and length >= limit:
        result["note"] = (
            f"stopped at the context length ({limit} positions) after {len(new)} of "
            f"{wanted} new tokens"
        )
    return result


def context_note(results: list[dict], fix: str) -> str | None:
    """One line for the results the context ended early (None if none): how many, and `fix`."""
    cut = [r["note"] for r in results if "note" in r]
    if not cut:
        return None
    first = " (the first)" if len(cut) > 1 else ""
    return f"note: {len(cut)} of {len(results)} generations {cut[0]}{first}; {fix}"


def complete(engine, tokenizer, texts: list[str], params: SamplingParams, **kwargs) -> list[dict]:
    """{"prompt", "text" (the continuation), "tokens" (its ids)} per text; kwargs as in
    complete_iter and generate (max_length, use_cache)."""
    return [r for batch in complete_iter(engine, tokenizer, texts, params, **kwargs) for r in batch]


def run_tool(body: Callable[[], None]) -> int:
    """Run an inference tool: a named error (bad flag, file or checkpoint) is one line on stderr
    and exit status 1; torch.distributed is shut down whatever happens."""
    try:
        body()
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()
    return 0
