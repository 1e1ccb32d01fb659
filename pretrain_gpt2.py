"""Pretrain a GPT with tensor x pipeline x data parallelism (Megatron-LM's flags).

    torchrun --nproc_per_node 4 pretrain_gpt2.py --tensor-model-parallel-size 2 \
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
        --micro-batch-size 4 --global-batch-size 32 --train-iters 10000 --lr 6e-4 \
        --data-path data/my-corpus_text_document --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --save ckpt --load ckpt
"""

import sys

from megatron.checkpoint.storage import CheckpointError
from megatron.config.cli import parse_args
from megatron.config.rules import refuse_bert_settings, validate_training
from megatron.initialize import shutdown_distributed
from megatron.training.loop import TrainingError, pretrain


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        validate_training(cfg)
        refuse_bert_settings(cfg)
        pretrain(cfg)
    except (ValueError, CheckpointError, TrainingError, FileNotFoundError) as e:
        # ConfigError and DataError are ValueErrors: bad flags, data or checkpoints, named.
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
