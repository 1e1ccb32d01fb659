#!/usr/bin/env bash
# BERT-large (336M) on one process: Megatron-LM v1.1.5's examples/pretrain_bert.sh, unchanged
# but for the paths (and --distributed-backend gloo to run it on a CPU, without --fp16).
# Data: tools/preprocess_data.py --split-sentences --tokenizer-type BertWordPieceLowerCase.
set -euo pipefail
DATA=${DATA:-data/my-bert_text_sentence}
VOCAB=${VOCAB:-bert-vocab.txt}
CKPT=${CKPT:-checkpoints/bert-345m}

python pretrain_bert.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --batch-size 4 --seq-length 512 --max-position-embeddings 512 \
    --train-iters 2000000 \
    --save "$CKPT" --load "$CKPT" \
    --data-path "$DATA" --vocab-file "$VOCAB" --data-impl mmap --split 949,50,1 \
    --distributed-backend nccl \
    --lr 0.0001 --min-lr 0.00001 --lr-decay-style linear --lr-decay-iters 990000 \
    --weight-decay 1e-2 --clip-grad 1.0 --warmup .01 \
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --fp16 "$@"
