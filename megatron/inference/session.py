"""What every inference CLI shares: the checkpoint flags, start-up, and prompt completion.

The generation CLI, the evaluation CLI and the HTTP server all import these from here, so no
CLI module imports another.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from megatron.checkpoint.storage import CheckpointError
from megatron.config.schema import MegatronConfig, ParallelConfig
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


def setup(load: str, pp: int):
    env = read_launch_env()
    if env.world_size % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide the {env.world_size} processes"
        )
    cfg = MegatronConfig(
        parallel=ParallelConfig(
            tensor_model_parallel_size=env.world_size // pp,
            pipeline_model_parallel_size=pp,
            world_size=env.world_size,
        )
    )
    rt = initialize_megatron(cfg, env)
    engine, tokenizer, iteration = load_inference_model(load, rt)
    if tokenizer is None:
        raise ValueError(f"--load {load}: the checkpoint records no tokenizer (trained on ids)")
    return rt, engine, tokenizer, iteration


def complete(engine, tokenizer, texts: list[str], params: SamplingParams) -> list[dict]:
    ids = generate(engine, [tokenizer.tokenize(t) for t in texts], params, eod=tokenizer.eod)
    out = []
    for text, seq in zip(texts, ids, strict=True):
        new = seq[len(tokenizer.tokenize(text)) :]
        out.append({"prompt": text, "text": tokenizer.detokenize(new), "tokens": new})
    return out


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
