"""Pretrain BERT (masked LM + next-sentence prediction) with tensor x pipeline x data
parallelism, on the GPT's trainer (Megatron-LM v1.1.5's flags; see examples/pretrain_bert.sh).

    python tools/preprocess_data.py --input corpus.json --output-prefix my-bert \
        --vocab-file bert-vocab.txt --tokenizer-type BertWordPieceLowerCase --split-sentences
    python pretrain_bert.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --batch-size 4 --seq-length 512 --max-position-embeddings 512 --train-iters 2000000 \
        --data-path my-bert_text_sentence --vocab-file bert-vocab.txt --split 949,50,1 \
        --lr 0.0001 --lr-decay-style linear --warmup .01 --fp16
"""

import sys

from megatron.checkpoint.storage import CheckpointError
from megatron.config.cli import parse_args
from megatron.initialize import shutdown_distributed
from megatron.model.families import get_spec
from megatron.training.loop import pretrain
from megatron.training.train_loop import TrainingError


def main(argv=None) -> int:
    try:
        spec = get_spec("bert")
        pretrain(parse_args(argv, purpose=spec.purpose), family=spec)
    except (ValueError, CheckpointError, TrainingError, FileNotFoundError) as e:
        # ConfigError and DataError are ValueErrors: bad flags, data or checkpoints, named.
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
