#!/usr/bin/env bash
# 3D parallelism (TP x PP x DP) with torchrun on one node or several.
#   one node, 8 GPUs:  TP=2 PP=2 -> DP=2
#     DATA=data/my-corpus_text_document bash examples/pretrain_gpt2_3d.sh
#   four nodes:  run on each node with its NODE_RANK (DP = 32 / (TP x PP))
#     NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 TP=4 PP=4 bash examples/pretrain_gpt2_3d.sh
#   CPU smoke test of the same layout (8 gloo ranks, tiny model, 20 iterations, a minute or
#   two on 2 cores): it writes its own small corpus into smoke_out/ and needs nothing else
#     SMOKE=1 bash examples/pretrain_gpt2_3d.sh
# The tokenizer is GPT-2's own (shipped in the package) unless VOCAB and MERGES name files.
# Other settings: GPUS_PER_NODE, MASTER_PORT, VP_LAYERS, CKPT, TRAIN_ITERS, LOG_INTERVAL,
# PYTHON; extra arguments are passed on to pretrain_gpt2.py.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-2}
PP=${PP:-2}
VP_LAYERS=${VP_LAYERS:-}   # e.g. 3: interleaved schedule, 3 layers per virtual stage
SMOKE=${SMOKE:-0}

# shellcheck source=gpt2_smoke_common.sh
source "$ROOT/examples/gpt2_smoke_common.sh"  # TOKENIZER, smoke_corpus

if [ "$SMOKE" = 1 ]; then
    SMOKE_DIR=${SMOKE_DIR:-smoke_out}
    DATA=${DATA:-$SMOKE_DIR/corpus_text_document}
    CKPT=${CKPT:-$SMOKE_DIR/checkpoints}
    TRAIN_ITERS=${TRAIN_ITERS:-20}
    LOG_INTERVAL=${LOG_INTERVAL:-5}
    smoke_corpus "$SMOKE_DIR" "$DATA"  # the Python standard library's sources
    rm -rf "$CKPT"  # a fresh run each time (--load would find the last one finished)
    MODEL=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
           --micro-batch-size 2 --global-batch-size 16 --distributed-backend gloo --num-workers 0)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 8 ranks on a few cores: one thread each
else
    DATA=${DATA:?pass DATA=PREFIX of your .bin/.idx (tools/preprocess_data.py), or SMOKE=1}
    CKPT=${CKPT:-checkpoints/gpt2-1.3b-3d}
    MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
           --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 512 --bf16
           --recompute-granularity selective)
fi
INTERLEAVE=()
[ -n "$VP_LAYERS" ] && INTERLEAVE=(--num-layers-per-virtual-pipeline-stage "$VP_LAYERS")

# `python -m torch.distributed.run` is torchrun, found without activating the venv.
"$PY" -m torch.distributed.run --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" \
    --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "$ROOT/pretrain_gpt2.py" \
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "${INTERLEAVE[@]}" \
    "${MODEL[@]}" \
    --train-iters "${TRAIN_ITERS:-300000}" --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine \
    --lr-warmup-fraction 0.01 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --data-path "$DATA" --split 949,50,1 "${TOKENIZER[@]}" \
    --log-interval "${LOG_INTERVAL:-100}" --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 2000 --exit-signal-handler \
    --timing-log-level 1 "$@"
