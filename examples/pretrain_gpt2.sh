#!/usr/bin/env bash
# GPT-2 small (124M) on one process (one GPU, or the CPU with --distributed-backend gloo).
# Edit the paths; data comes from tools/preprocess_data.py.
set -euo pipefail
DATA=${DATA:-data/my-corpus_text_document}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
CKPT=${CKPT:-checkpoints/gpt2-small}

python pretrain_gpt2.py \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 8 --global-batch-size 64 \
    --train-iters 500000 --lr 6.0e-4 --min-lr 6.0e-5 --lr-decay-style cosine \
    --lr-decay-iters 320000 --lr-warmup-fraction 0.01 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 100 --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 5000 --exit-signal-handler \
    --tensorboard-dir "$CKPT/tensorboard" "$@"
