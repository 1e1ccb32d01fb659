"""tools/evaluate.py, tasks/main.py and scripts/run_gpt2_eval.py: WikiText perplexity, LAMBADA
accuracy, loose-JSON perplexity of a checkpoint, on any TP x PP layout.

All three run `evaluate()`; they differ only in their command lines: ours, Megatron-LM v1.x's
tasks/main.py (--task LAMBADA | WIKITEXT103), and the 2019 scripts/run_gpt2_eval.py
(--cloze-eval | --webtext-eval | WikiText by default). The training command line's flags are
accepted too (megatron.config.inference). The result is printed last as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron.config.inference import EPILOG, parse_with_training_flags
from megatron.inference.evaluation import (
    evaluate_lambada,
    evaluate_loose_json,
    evaluate_wikitext,
    progress_bar,
    read_jsonl_records,
    read_jsonl_texts,
)
from megatron.inference.session import add_checkpoint_args, run_tool, setup

V1_TASKS = {"LAMBADA": "lambada", "WIKITEXT103": "wikitext"}


def _add_eval_args(p: argparse.ArgumentParser, batch: int, stride: int | None) -> None:
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="tokens per window; LAMBADA: most inputs per example (default: the model's)",
    )
    p.add_argument(
        "--overlapping-eval",
        type=int,
        default=stride,
        help=f"window stride; each window scores only its last N new targets ({stride or 'none'})",
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
        default=batch,
        dest="micro_batch_size",
        help=f"windows (or LAMBADA examples) per forward ({batch})",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=EPILOG, allow_abbrev=False
    )
    p.add_argument("--task", required=True, choices=["wikitext", "lambada", "loose-json"])
    p.add_argument(
        "--valid-data",
        required=True,
        help="wikitext: the word-level test file (wiki.test.tokens); lambada and "
        "loose-json: JSONL with a 'text' field",
    )
    add_checkpoint_args(p)
    _add_eval_args(p, batch=8, stride=None)
    p.add_argument(
        "--eval-iters", type=int, default=None, help="loose-json: stop after N batches (all)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _progress(args, given: dict, rank: int):
    """The progress bar, or with --log-interval N Megatron's line every N batches."""
    every = given.get("logging.log_interval")
    if every is None:
        return progress_bar(args.task, not args.no_progress and rank == 0)
    batches = iter(range(1 << 62))

    def log(done: int, total: int) -> None:
        i = next(batches)
        if rank == 0 and i % every == 0:
            print(f"> working on iteration: {i}", flush=True)

    return log


def _rank0_warning(rank: int):
    """Warnings on stderr from rank 0 only (every rank computes the same ones)."""

    def warn(message: str) -> None:
        if rank == 0:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    return warn


def evaluate(args, given: dict) -> dict:
    """The result of args.task on this checkpoint (on rank 0; {} on the other ranks)."""
    if args.eval_iters is not None and (args.task != "loose-json" or args.eval_iters < 1):
        raise ValueError("--eval-iters N (N >= 1) caps the batches of --task loose-json only")
    rt, engine, tokenizer, iteration = setup(args.load, args.pipeline_model_parallel_size, given)
    seq = args.seq_length or engine.model.cfg.seq_length
    if seq > engine.model.cfg.max_positions:
        raise ValueError(
            f"--seq-length {seq} exceeds the model's {engine.model.cfg.max_positions} positions"
        )
    if args.micro_batch_size < 1:
        raise ValueError(f"--batch-size {args.micro_batch_size}: must be >= 1")
    stride = args.overlapping_eval or seq
    bar, batch = _progress(args, given, rt.state.rank), args.micro_batch_size
    if args.task == "wikitext":
        with open(args.valid_data, encoding="utf-8") as f:
            text = f.read()
        result = evaluate_wikitext(engine, tokenizer, text, seq, stride, batch, bar)
    elif args.task == "lambada":
        records = read_jsonl_records(args.valid_data)
        result = evaluate_lambada(
            engine,
            tokenizer,
            [text for _, text in records],
            args.strict_lambada,
            bar,
            batch,
            seq_length=seq,
            labels=[
                f"example {i} ({args.valid_data}:{line})" for i, (line, _) in enumerate(records)
            ],
            warn=_rank0_warning(rt.state.rank),
        )
    else:
        docs = read_jsonl_texts(args.valid_data)
        result = evaluate_loose_json(
            engine, tokenizer, docs, seq, stride, batch, bar, args.eval_iters
        )
    result["iteration"] = iteration
    return result if rt.state.rank == 0 else {}


def _run(parser: argparse.ArgumentParser, argv, adapt, report=None) -> int:
    """Parse, map the tool's flags onto ours (`adapt(args, given)`), evaluate, print."""

    def body() -> None:
        args, given = parse_with_training_flags(parser, argv)
        adapt(args, given)
        result = evaluate(args, given)
        if result:
            if report:
                report(result)
            print(json.dumps(result), flush=True)

    return run_tool(body)


def main(argv=None) -> int:
    return _run(build_parser(), argv, lambda args, given: None)


# --- Megatron-LM v1.x: tasks/main.py --------------------------------------------------------

_FINETUNE_FLAGS = ("--epochs", "--pretrained-checkpoint", "--keep-last", "--train-data")


def build_tasks_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Megatron-LM v1.x tasks/main.py: zero-shot LAMBADA / WIKITEXT103",
        epilog=EPILOG,
        allow_abbrev=False,
    )
    p.add_argument("--task", required=True, help="LAMBADA or WIKITEXT103")
    p.add_argument("--valid-data", nargs="*", default=None, help="the one evaluation file")
    p.add_argument("--load", required=True, help="checkpoint directory")
    _add_eval_args(p, batch=8, stride=32)
    for flag in _FINETUNE_FLAGS:
        p.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)
    return p


def _adapt_tasks(args, given: dict) -> None:
    finetune = [f for f in _FINETUNE_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if args.task not in V1_TASKS or finetune:
        raise ValueError(
            f"{' '.join([f'--task {args.task}', *finetune])}: only zero-shot evaluation is "
            f"supported here. Fix: --task one of {', '.join(V1_TASKS)}, without finetuning flags"
        )
    if not args.valid_data or len(args.valid_data) != 1:
        raise ValueError(f"--valid-data: give exactly one file, got {args.valid_data or []}")
    args.task, args.valid_data = V1_TASKS[args.task], args.valid_data[0]
    args.pipeline_model_parallel_size, args.eval_iters, args.no_progress = 1, None, True


def _v1_report(task: str):
    def report(r: dict) -> None:
        if "accuracy" in r:
            n = r["num_examples"]
            text = (
                f" validation results on {task} | number correct: {r['accuracy'] * n:.4E} | "
                f"total examples: {n:.4E} | avg accuracy: {r['accuracy']:.4E}"
            )
        else:
            text = (
                f" validation results on {task} | avg loss: {r['loss']:.4E} | "
                f"ppl: {r['ppl']:.4E} | adjusted ppl: {r['adjusted_ppl']:.4E} | "
                f"token ratio: {r['token_ratio']} |"
            )
        print(f"{'-' * (len(text) + 1)}\n{text}\n{'-' * (len(text) + 1)}", flush=True)

    return report


def tasks_main(argv=None) -> int:
    parser = build_tasks_parser()
    ns, _ = parser.parse_known_args(argv)
    return _run(parser, argv, _adapt_tasks, _v1_report(ns.task))


# --- the 2019 Megatron-LM: scripts/run_gpt2_eval.py -------------------------------------------


def build_gpt2_eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="2019 Megatron-LM scripts/run_gpt2_eval.py: WikiText perplexity (default), "
        "LAMBADA (--cloze-eval) or loose-JSON perplexity (--webtext-eval)",
        epilog=EPILOG,
        allow_abbrev=False,
    )
    p.add_argument("--model-path", required=True, dest="load", help="checkpoint directory")
    p.add_argument("--data-path", required=True, dest="valid_data", help="the evaluation file")
    p.add_argument("--cloze-eval", action="store_true", help="LAMBADA cloze accuracy")
    p.add_argument("--webtext-eval", action="store_true", help="loose-JSON perplexity")
    p.add_argument(
        "--eval-iters", type=int, default=None, help="--webtext-eval: batches (default 5000)"
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="directory with GPT-2's vocab.json and merges.txt (when --vocab-file is absent)",
    )
    p.add_argument("--load-openai", action="store_true", help=argparse.SUPPRESS)
    _add_eval_args(p, batch=16, stride=32)
    return p


def _cache_dir_tokenizer(cache_dir: str) -> dict:
    for vocab, merges in (("vocab.json", "merges.txt"), ("gpt2-vocab.json", "gpt2-merges.txt")):
        v, m = os.path.join(cache_dir, vocab), os.path.join(cache_dir, merges)
        if os.path.isfile(v) and os.path.isfile(m):
            return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": v, "merge_file": m}
    raise ValueError(
        f"--cache-dir {cache_dir}: no vocab.json + merges.txt (or gpt2-vocab.json + "
        "gpt2-merges.txt) there. Fix: put GPT-2's tokenizer files there or pass "
        "--vocab-file and --merge-file"
    )


def _adapt_gpt2_eval(args, given: dict) -> None:
    if args.load_openai:
        raise ValueError(
            "--load-openai: convert OpenAI's GPT-2 first (tools/convert_checkpoint.py "
            "--from-hf DIR --save CKPT) and pass --model-path CKPT"
        )
    if args.cloze_eval and args.webtext_eval:
        raise ValueError("--cloze-eval and --webtext-eval: choose one")
    if args.cache_dir and "data.tokenizer.vocab_file" not in given:
        given.update(
            {f"data.tokenizer.{k}": v for k, v in _cache_dir_tokenizer(args.cache_dir).items()}
        )
    args.task = "lambada" if args.cloze_eval else "loose-json" if args.webtext_eval else "wikitext"
    if args.task == "loose-json" and args.eval_iters is None:
        args.eval_iters = 5000
    args.pipeline_model_parallel_size, args.no_progress = 1, False


def gpt2_eval_main(argv=None) -> int:
    return _run(build_gpt2_eval_parser(), argv, _adapt_gpt2_eval)
