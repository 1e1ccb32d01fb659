"""The sampling modes of Megatron-LM's tools/generate_samples_gpt2.py, on any TP x PP layout:
unconditional samples to JSON lines, prompts from a file, and an interactive prompt.

Every rank runs the same generation (prompts are broadcast from rank 0); only rank 0 reads
input and writes output.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator

from megatron.inference.engine import broadcast_json
from megatron.inference.generation import SamplingParams
from megatron.inference.session import complete, complete_iter

QUIT_WORDS = ("stop", "quit", "exit")


def unconditional_samples(
    engine,
    tokenizer,
    num_samples: int,
    batch_size: int,
    params: SamplingParams,
    log_interval: int | None = None,
    log: Callable[[str], None] = print,
    **generate_kwargs,
) -> Iterator[dict]:
    """`num_samples` documents, each generated from end-of-document alone, `batch_size` at a
    time; per sample Megatron's record {"text", "length", "finished"}: the text without the
    closing end-of-document, the generated tokens counting it, and whether it was reached."""
    texts = [""] * num_samples
    start = time.time()
    batches = complete_iter(engine, tokenizer, texts, params, batch_size, **generate_kwargs)
    for i, batch in enumerate(batches):
        if log_interval and i % log_interval == 0:
            log(f"Avg s/batch: {(time.time() - start) / (i + 1):.3f}")
        for result in batch:
            tokens = result["tokens"]
            finished = bool(tokens) and tokens[-1] == tokenizer.eod
            body = tokens[:-1] if finished else tokens
            yield {"text": tokenizer.detokenize(body), "length": len(tokens), "finished": finished}


def write_jsonl(path: str, records) -> int:
    """Write each record as one JSON line (ASCII, non-ASCII escaped, as Megatron writes its
    --genfile); the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
            n += 1
    return n


def v1_block(prompt: str, continuation: str) -> str:
    """One result as Megatron-LM's generate_samples_input_from_file writes it."""
    return f"\nContext:{prompt}\n\nMegatron-LM:{continuation}\n"


def read_prompts(path: str, max_tokens: int, tokenizer) -> list[str]:
    """The non-empty lines of `path`; a line of `max_tokens` tokens or more leaves no room to
    generate and is skipped with a message naming its line (Megatron skips it too)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            text = line.rstrip("\n")
            if not text.strip():
                continue
            size = len(tokenizer.tokenize(text))
            if size >= max_tokens:
                print(
                    f"{path}:{n}: skipped, {size} tokens leave no room in --seq-length "
                    f"{max_tokens}. Fix: shorten the prompt or raise --seq-length",
                    file=sys.stderr,
                )
                continue
            prompts.append(text)
    if not prompts:
        raise ValueError(f"--sample-input-file {path}: no prompts (one per non-empty line)")
    return prompts


def interactive(
    rt,
    engine,
    tokenizer,
    params: SamplingParams,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = print,
    **generate_kwargs,
) -> int:
    """Prompt on rank 0 until 'stop' (or quit/exit, or end of input): an empty line gives an
    unconditional sample. The number of samples shown."""
    shown = 0
    while True:
        text = None
        if rt.state.rank == 0:
            try:
                text = read("\nContext prompt (empty: unconditional sample; stop to quit) >>> ")
            except EOFError:
                text = None
            if text is not None and text.strip().lower() in QUIT_WORDS:
                text = None
        text = broadcast_json(text, rt.device)
        if text is None:
            return shown
        result = complete(engine, tokenizer, [text], params, **generate_kwargs)[0]
        if rt.state.rank == 0:
            write(v1_block(text, result["text"]))
            if "note" in result:
                write(f"({result['note']})")
        shown += 1
