"""Generate text from a checkpoint (greedy), on any TP layout the checkpoint was saved with.

    torchrun --nproc_per_node 2 tools/generate_text.py --load ckpt --prompt "def main(" \
        --max-new-tokens 48
Model shapes and the tokenizer come from the checkpoint. (Sampling, a KV cache and a server
arrive with the generation issue.)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint_loading import load_model_for_inference  # noqa: E402
from megatron.config import MegatronConfig, ParallelConfig  # noqa: E402
from megatron.initialize import (  # noqa: E402
    initialize_megatron,
    read_launch_env,
    shutdown_distributed,
)
from megatron.text_generation import generate_greedy  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=None,
        help="default: the launcher's world size",
    )
    args = p.parse_args(argv)
    try:
        return _generate(args)
    finally:
        shutdown_distributed()


def _generate(args) -> int:
    env = read_launch_env()
    tp = args.tensor_model_parallel_size or env.world_size
    cfg = MegatronConfig(
        parallel=ParallelConfig(tensor_model_parallel_size=tp, world_size=env.world_size)
    )
    rt = initialize_megatron(cfg, env)
    model, tokenizer, model_cfg, iteration = load_model_for_inference(args.load, rt)
    if tokenizer is None:
        print(
            "error: the checkpoint records no tokenizer; it was trained on token ids",
            file=sys.stderr,
        )
        return 1
    ids = generate_greedy(
        model,
        tokenizer.tokenize(args.prompt),
        args.max_new_tokens,
        tp_group=rt.state.tp_group,
        eod=tokenizer.eod,
        max_length=model_cfg.max_positions,
    )
    if rt.state.rank == 0:
        print(f"--- greedy sample (checkpoint iteration {iteration}) ---")
        print(tokenizer.detokenize(ids))
        print("---")
    return 0


if __name__ == "__main__":
    sys.exit(main())
