"""tools/generate_text.py: sample from a checkpoint on any TP x PP layout it was saved with.

Prompts come from --prompt (repeatable), from --sample-input-file (one per line; results to
--sample-output-file as JSONL), or, with neither, from an interactive prompt on rank 0 (the
classic generate_samples_gpt2 experience; an empty line or EOF quits).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron.inference.engine import broadcast_json
from megatron.inference.generation import SamplingParams
from megatron.inference.session import add_checkpoint_args, complete, run_tool, setup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(p)
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable)")
    p.add_argument("--sample-input-file", default=None, help="one prompt per line")
    p.add_argument("--sample-output-file", default=None, help="JSONL results (default stdout)")
    p.add_argument(
        "--max-new-tokens",
        "--out-seq-length",
        type=int,
        default=64,
        dest="max_new_tokens",
        help="tokens to generate per prompt (64)",
    )
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely (0: all)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (1.0)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (1234)")
    return p


def _interactive(rt, engine, tokenizer, params) -> None:
    while True:
        text = None
        if rt.state.rank == 0:
            try:
                text = input("\nContext prompt (empty line to quit) >>> ")
            except EOFError:
                text = ""
        text = broadcast_json(text, rt.device)
        if not text:
            return
        result = complete(engine, tokenizer, [text], params)[0]
        if rt.state.rank == 0:
            print(f"\n{text}{result['text']}", flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    params = SamplingParams(
        args.max_new_tokens, args.greedy, args.top_k, args.top_p, args.temperature, args.seed
    )

    def body() -> None:
        params.validate()
        rt, engine, tokenizer, iteration = setup(args.load, args.pipeline_model_parallel_size)
        if args.prompt or args.sample_input_file:
            texts = list(args.prompt)
            if args.sample_input_file:
                with open(args.sample_input_file, encoding="utf-8") as f:
                    texts += [line.rstrip("\n") for line in f if line.strip()]
            results = complete(engine, tokenizer, texts, params)
            if rt.state.rank == 0:
                lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
                if args.sample_output_file:
                    with open(args.sample_output_file, "w", encoding="utf-8") as f:
                        f.write(lines)
                else:
                    sys.stdout.write(lines)
        else:
            _interactive(rt, engine, tokenizer, params)

    return run_tool(body)
