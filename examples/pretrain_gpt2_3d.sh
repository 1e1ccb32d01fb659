#!/usr/bin/env bash
# 3D parallelism (TP x PP x DP) with torchrun on one node or several.
#   one node, 8 GPUs:  TP=2 PP=2 -> DP=2
#     bash examples/pretrain_gpt2_3d.sh
#   four nodes:  run on each node with its NODE_RANK (DP = 32 / (TP x PP))
#     NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 TP=4 PP=4 bash examples/pretrain_gpt2_3d.sh
#   CPU smoke test of the layout (8 gloo ranks, tiny model):
#     GPUS_PER_NODE=8 SMOKE=1 bash examples/pretrain_gpt2_3d.sh
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-2}
VP_LAYERS=${VP_LAYERS:-}   # e.g. 3: interleaved schedule, 3 layers per virtual stage
DATA=${DATA:-data/my-corpus_text_document}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
CKPT=${CKPT:-checkpoints/gpt2-1.3b-3d}

MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
       --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 512 --bf16
       --recompute-granularity selective)
if [ "${SMOKE:-0}" = 1 ]; then
    MODEL=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
           --micro-batch-size 2 --global-batch-size 16 --distributed-backend gloo --num-workers 0)
fi
INTERLEAVE=()
[ -n "$VP_LAYERS" ] && INTERLEAVE=(--num-layers-per-virtual-pipeline-stage "$VP_LAYERS")

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    pretrain_gpt2.py \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "${INTERLEAVE[@]}" \
    "${MODEL[@]}" \
    --train-iters "${TRAIN_ITERS:-300000}" --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine \
    --lr-warmup-fraction 0.01 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval "${LOG_INTERVAL:-100}" --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 2000 --exit-signal-handler \
    --timing-log-level 1 "$@"
