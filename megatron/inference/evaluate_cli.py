"""tools/evaluate.py: WikiText perplexity, LAMBADA accuracy, loose-JSON perplexity of a
checkpoint, on any TP x PP layout; prints a progress bar and the result as a final JSON line."""

from __future__ import annotations

import argparse
import json

from megatron.inference.evaluation import (
    evaluate_lambada,
    evaluate_loose_json,
    evaluate_wikitext,
    progress_bar,
    read_jsonl_texts,
)
from megatron.inference.session import add_checkpoint_args, run_tool, setup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, choices=["wikitext", "lambada", "loose-json"])
    p.add_argument(
        "--valid-data",
        required=True,
        help="wikitext: the word-level test file (wiki.test.tokens); lambada and "
        "loose-json: JSONL with a 'text' field",
    )
    add_checkpoint_args(p)
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per window (default: the model's --seq-length)",
    )
    p.add_argument(
        "--overlapping-eval",
        type=int,
        default=None,
        help="window stride; each window scores only its last N new targets (default: no overlap)",
    )
    p.add_argument(
        "--strict-lambada",
        action="store_true",
        help="LAMBADA: the whole last word must be predicted, not its last token",
    )
    p.add_argument(
        "--micro-batch-size",
        "--batch-size",
        type=int,
        default=8,
        dest="micro_batch_size",
        help="windows per forward (8)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args) -> dict:
    rt, engine, tokenizer, iteration = setup(args.load, args.pipeline_model_parallel_size)
    seq = args.seq_length or engine.model.cfg.seq_length
    if seq > engine.model.cfg.max_positions:
        raise ValueError(
            f"--seq-length {seq} exceeds the model's {engine.model.cfg.max_positions} positions"
        )
    stride = args.overlapping_eval or seq
    bar = progress_bar(args.task, not args.no_progress and rt.state.rank == 0)
    if args.task == "wikitext":
        with open(args.valid_data, encoding="utf-8") as f:
            text = f.read()
        result = evaluate_wikitext(engine, tokenizer, text, seq, stride, args.micro_batch_size, bar)
    elif args.task == "lambada":
        result = evaluate_lambada(
            engine, tokenizer, read_jsonl_texts(args.valid_data), args.strict_lambada, bar
        )
    else:
        result = evaluate_loose_json(
            engine,
            tokenizer,
            read_jsonl_texts(args.valid_data),
            seq,
            stride,
            args.micro_batch_size,
            bar,
        )
    result["iteration"] = iteration
    return result if rt.state.rank == 0 else {}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        result = run(args)
        if result:
            print(json.dumps(result), flush=True)

    return run_tool(body)
