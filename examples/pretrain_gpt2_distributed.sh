#!/usr/bin/env bash
# GPT-2 medium (345M) with TP x DP over one or several nodes, launched by torchrun.
#   one node:   bash examples/pretrain_gpt2_distributed.sh
#   two nodes:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_gpt2_distributed.sh
#               NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/pretrain_gpt2_distributed.sh
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
DATA=${DATA:-data/my-corpus_text_document}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
CKPT=${CKPT:-checkpoints/gpt2-345m}

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    pretrain_gpt2.py \
    --tensor-model-parallel-size "$TP" \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 256 \
    --train-iters 500000 --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
    --lr-decay-iters 320000 --lr-warmup-fraction 0.01 --weight-decay 0.01 --clip-grad 1.0 \
    --bf16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 100 --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 5000 --exit-signal-handler \
    --tensorboard-dir "$CKPT/tensorboard" "$@"
