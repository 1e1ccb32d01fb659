"""Pretrain a GPT with tensor x pipeline x data parallelism (Megatron-LM's flags).

    torchrun --nproc_per_node 4 pretrain_gpt2.py --tensor-model-parallel-size 2 \
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
        --micro-batch-size 4 --global-batch-size 32 --train-iters 10000 --lr 6e-4 \
        --data-path data/my-corpus_text_document --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --save ckpt --load ckpt
"""

import os
import sys

from megatron.checkpoint.storage import CheckpointError
from megatron.config.cli import parse_args
from megatron.initialize import shutdown_distributed
from megatron.model.families import get_spec
from megatron.planning.auto import auto_parallel
from megatron.training.loop import pretrain, resolve_vocab
from megatron.training.train_loop import TrainingError


def plan_layout(cfg):
    """--auto-parallel: the planner's layout for the launched world size (logged by rank 0)."""
    if not cfg.parallel.auto_parallel:
        return cfg
    sized, _ = resolve_vocab(cfg)  # the planner needs the vocab size the tokenizer sets
    rank0 = os.environ.get("RANK", "0") == "0"
    return auto_parallel(cfg, vocab_size=sized.model.vocab_size, log=print if rank0 else _quiet)


def _quiet(line: str) -> None:
    pass


def main(argv=None) -> int:
    try:
        gpt = get_spec("gpt")
        pretrain(parse_args(argv, plan=plan_layout, purpose=gpt.purpose), family=gpt)
    except (ValueError, CheckpointError, TrainingError, FileNotFoundError) as e:
        # ConfigError and DataError are ValueErrors: bad flags, data or checkpoints, named.
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
