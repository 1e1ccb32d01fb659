#!/usr/bin/env bash
# BERT-large with TP x PP x DP over one or several nodes, launched by torchrun.
#   one node:   bash examples/pretrain_bert_distributed.sh
#   two nodes:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_bert_distributed.sh
#               NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/pretrain_bert_distributed.sh
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-1}
DATA=${DATA:-data/my-bert_text_sentence}
VOCAB=${VOCAB:-bert-vocab.txt}
CKPT=${CKPT:-checkpoints/bert-345m}

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    pretrain_bert.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --micro-batch-size 4 --global-batch-size 256 \
    --seq-length 512 --max-position-embeddings 512 \
    --apply-residual-connection-post-layernorm \
    --train-iters 1000000 --lr 0.0001 --min-lr 0.00001 --lr-decay-style linear \
    --lr-decay-iters 990000 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 \
    --fp16 \
    --data-path "$DATA" --vocab-file "$VOCAB" --split 949,50,1 \
    --log-interval 100 --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 10000 --exit-signal-handler "$@"
