"""tools/generate_text.py and tools/generate_samples_gpt2.py: sample from a checkpoint on any
TP x PP layout it was saved with.

Modes, as in Megatron-LM's generate_samples_gpt2: --num-samples N writes N unconditional samples
(each started from end-of-document) to --genfile as JSON lines; --prompt (repeatable) or
--sample-input-file (one prompt per line) continue given text; with none of these, an
interactive prompt on rank 0 (empty line: an unconditional sample; 'stop' or Ctrl-D quits).
The training command line's flags are accepted too (megatron.config.inference).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron.config.inference import EPILOG, parse_with_training_flags
from megatron.inference.engine import broadcast_json
from megatron.inference.generation import SamplingParams
from megatron.inference.samples import (
    interactive,
    read_prompts,
    unconditional_samples,
    v1_block,
    write_jsonl,
)
from megatron.inference.session import (
    add_checkpoint_args,
    complete,
    context_note,
    run_tool,
    setup,
)

CONTEXT_FIX = (
    "fewer were generated than --max-new-tokens asked; shorten the prompt or raise --seq-length "
    "(at most the model's positions)"
)


def build_parser(v1: bool = False) -> argparse.ArgumentParser:
    """`v1`: Megatron-LM v1.x's defaults (--out-seq-length 1024, text blocks to
    --sample-output-file, by default the input file + '.out')."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=EPILOG, allow_abbrev=False
    )
    add_checkpoint_args(p)
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
    p.add_argument("--sample-input-file", default=None, help="one prompt per line")
    out_default = "the input file + '.out', Megatron's text blocks" if v1 else "stdout, JSONL"
    p.add_argument("--sample-output-file", default=None, help=f"results ({out_default})")
    p.add_argument("--num-samples", type=int, default=0, help="unconditional samples (0: none)")
    p.add_argument("--genfile", default=None, help="JSON lines file for --num-samples")
    p.add_argument(
        "--max-new-tokens",
        "--out-seq-length",
        type=int,
        default=1024 if v1 else 64,
        dest="max_new_tokens",
        help=f"tokens to generate per sample ({1024 if v1 else 64}; never past --seq-length)",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="most tokens per sequence, context included (default: the model's positions)",
    )
    p.add_argument(
        "--micro-batch-size",
        "--batch-size",
        type=int,
        default=None,
        dest="batch_size",
        help="sequences generated together (default: all prompts; unconditional: 1)",
    )
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument(
        "--top-k", "--top_k", type=int, default=0, help="sample from the k best (0: all)"
    )
    p.add_argument("--top-p", "--top_p", type=float, default=0.0, help="nucleus mass (0: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (1.0)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (1234)")
    p.add_argument(
        "--recompute",
        action="store_true",
        help="no KV cache: run the whole sequence again for every token (same tokens, slower)",
    )
    return p


def _max_length(args, engine) -> int:
    positions = engine.model.cfg.max_positions
    if args.seq_length is not None and not 1 < args.seq_length <= positions:
        raise ValueError(
            f"--seq-length {args.seq_length}: the model takes 2 to {positions} positions. "
            f"Fix: pass --seq-length {positions} or less"
        )
    return args.seq_length or positions


def _check_modes(args) -> None:
    if args.num_samples < 0:
        raise ValueError(f"--num-samples {args.num_samples}: must be >= 0")
    if args.num_samples and not args.genfile:
        raise ValueError("--num-samples needs --genfile, the JSON lines file to write")
    if args.genfile and not args.num_samples:
        raise ValueError("--genfile is written by unconditional sampling. Fix: add --num-samples")
    if args.num_samples and (args.prompt or args.sample_input_file):
        raise ValueError("--num-samples: unconditional; drop --prompt/--sample-input-file")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: must be >= 1")


def _conditional(args, rt, engine, tokenizer, params, v1: bool, **kw) -> None:
    texts = list(args.prompt)
    if args.sample_input_file:  # read on rank 0; a bad file stops every rank, not just it
        read = None
        if rt.state.rank == 0:
            try:
                read = {
                    "prompts": read_prompts(args.sample_input_file, kw["max_length"], tokenizer)
                }
            except (OSError, ValueError) as e:
                read = {"error": f"--sample-input-file: {e}"}
        read = broadcast_json(read, rt.device)
        if "error" in read:
            raise ValueError(read["error"])
        texts += read["prompts"]
    results = complete(engine, tokenizer, texts, params, batch_size=args.batch_size, **kw)
    if rt.state.rank != 0:
        return
    note = context_note(results, CONTEXT_FIX)
    if note:
        print(note, file=sys.stderr)
    out_file = args.sample_output_file
    if v1:
        out_file = out_file or (args.sample_input_file and args.sample_input_file + ".out")
        lines = "".join(v1_block(r["prompt"], r["text"]) for r in results)
    else:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if out_file:
        with open(out_file, "w", encoding="utf-8") as f:
            f.write(lines)
    else:
        sys.stdout.write(lines)


def main(argv=None, v1: bool = False) -> int:
    parser = build_parser(v1)

    def body() -> None:
        args, given = parse_with_training_flags(parser, argv)
        _check_modes(args)
        params = SamplingParams(
            args.max_new_tokens, args.greedy, args.top_k, args.top_p, args.temperature, args.seed
        )
        params.validate()
        rt, engine, tokenizer, _ = setup(args.load, args.pipeline_model_parallel_size, given)
        kw = {"max_length": _max_length(args, engine), "use_cache": not args.recompute}
        if args.num_samples:
            samples = unconditional_samples(
                engine,
                tokenizer,
                args.num_samples,
                args.batch_size or 1,
                params,
                given.get("logging.log_interval"),
                print if rt.state.rank == 0 else (lambda _: None),
                **kw,
            )
            if rt.state.rank == 0:
                write_jsonl(args.genfile, samples)
            else:
                for _ in samples:  # the same forwards as rank 0
                    pass
        elif args.prompt or args.sample_input_file:
            _conditional(args, rt, engine, tokenizer, params, v1, **kw)
        else:
            interactive(rt, engine, tokenizer, params, **kw)

    return run_tool(body)
