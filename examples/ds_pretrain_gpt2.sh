#!/usr/bin/env bash
# GPT-2 medium through DeepSpeed (ZeRO, its pipeline engine, its activation checkpointing),
# launched by the `deepspeed` launcher.
#   one node, 8 GPUs:        bash examples/ds_pretrain_gpt2.sh
#   several nodes:           HOSTFILE=examples/hostfile NUM_NODES=2 bash examples/ds_pretrain_gpt2.sh
#   chosen GPUs per node:    INCLUDE="worker-1:0,1,2,3@worker-2:0,1,2,3" bash examples/ds_pretrain_gpt2.sh
#   TP x PP x DP (ZeRO-1):   TP=2 PP=2 ZERO=1 bash examples/ds_pretrain_gpt2.sh
# ZeRO-2/3 shard gradients (and weights) over DP and do not combine with PP > 1.
set -euo pipefail
NUM_NODES=${NUM_NODES:-1}
NUM_GPUS=${NUM_GPUS:-8}
HOSTFILE=${HOSTFILE:-}
INCLUDE=${INCLUDE:-}
TP=${TP:-1}
PP=${PP:-1}
ZERO=${ZERO:-2}
DS_CONFIG=${DS_CONFIG:-ds_configs/ds_bf16_zero_stage_2_config.json}
DATA=${DATA:-data/my-corpus_text_document}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
CKPT=${CKPT:-checkpoints/gpt2-345m-ds}

LAUNCH=(deepspeed)
if [ -n "$INCLUDE" ]; then
    LAUNCH+=(--include "$INCLUDE")
else
    LAUNCH+=(--num_nodes "$NUM_NODES" --num_gpus "$NUM_GPUS")
fi
[ -n "$HOSTFILE" ] && LAUNCH+=(--hostfile "$HOSTFILE")

"${LAUNCH[@]}" pretrain_gpt2.py \
    --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size 256 --bf16 \
    --checkpoint-activations --checkpoint-num-layers 1 --partition-activations \
    --train-iters 500000 --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
    --lr-warmup-fraction 0.01 --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 100 --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 5000 --exit-signal-handler "$@"
