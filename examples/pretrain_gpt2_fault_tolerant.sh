#!/usr/bin/env bash
# GPT-2 medium with data parallelism that survives a lost replica (--fault-tolerance, torchft):
# REPLICA_GROUPS replica groups of one GPU each on this node, each its own torchrun with a
# master port of its own. A group that dies is dropped by the others at the next step (no
# restart of the job); its torchrun (--max-restarts) starts it again, and it rejoins by fetching
# the weights and optimizer state from a live peer. See docs/operations.md (A lost data-parallel replica).
#   bash examples/pretrain_gpt2_fault_tolerant.sh                  # 8 groups, lighthouse here
#   LIGHTHOUSE=http://host:29510 REPLICA_GROUPS=4 FIRST_GROUP=4 FT_GROUP_SIZE=8 bash ...
#                                                  # groups 4-7 of 8 on another node
#   SMOKE=1 bash examples/pretrain_gpt2_fault_tolerant.sh         # CPU check: 3 groups of one
#                       gloo rank, a tiny model, its own corpus in smoke_out/ and its own
#                       lighthouse on 127.0.0.1; kill one group's rank and watch the others go on
# Starts torchft's lighthouse (torchft_lighthouse, from `pip install torchft`) unless LIGHTHOUSE
# names one, bound to LIGHTHOUSE_HOST (default: this node's name, the address the other nodes
# reach it at; not every interface); it needs a majority of the groups for a quorum. The
# tokenizer is GPT-2's own (shipped in the package) unless VOCAB and MERGES name files. Extra
# arguments go to pretrain_gpt2.py.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
SMOKE=${SMOKE:-0}
REPLICA_GROUPS=${REPLICA_GROUPS:-$([ "$SMOKE" = 1 ] && echo 3 || echo 8)}  # groups on this node
FT_GROUP_SIZE=${FT_GROUP_SIZE:-$REPLICA_GROUPS} # replica groups in the whole job
FIRST_GROUP=${FIRST_GROUP:-0}    # --ft-replica-id of this node's first group
RESTARTS=${RESTARTS:-100}        # torchrun restarts of one group (each rejoins from a peer)
BASE_PORT=${BASE_PORT:-29600}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
# torchft's Rust side logs every quorum at INFO (over 90% of a run's lines): warnings only,
# unless RUST_LOG says otherwise (RUST_LOG=info to see each quorum)
export RUST_LOG=${RUST_LOG:-warn}

# shellcheck source=gpt2_smoke_common.sh
source "$ROOT/examples/gpt2_smoke_common.sh"  # TOKENIZER, smoke_corpus

if [ "$SMOKE" = 1 ]; then
    SMOKE_DIR=${SMOKE_DIR:-smoke_out}
    DATA=${DATA:-$SMOKE_DIR/corpus_text_document}
    CKPT=${CKPT:-$SMOKE_DIR/checkpoints-ft}
    LIGHTHOUSE_HOST=${LIGHTHOUSE_HOST:-127.0.0.1}
    smoke_corpus "$SMOKE_DIR" "$DATA"  # the Python standard library's sources
    rm -rf "$CKPT"  # a fresh run each time
    RUN=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
         --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size $((2 * FT_GROUP_SIZE))
         --train-iters "${TRAIN_ITERS:-200}" --lr 1e-3 --lr-warmup-fraction 0.05
         --distributed-backend gloo --num-workers 0 --split 949,50,1
         --log-interval "${LOG_INTERVAL:-10}" --eval-interval 1000 --eval-iters 2
         --save-interval 100 --ft-timeout-seconds 5)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread a group on a few cores
else
    DATA=${DATA:?pass DATA=PREFIX of your .bin/.idx (tools/preprocess_data.py), or SMOKE=1}
    CKPT=${CKPT:-checkpoints/gpt2-345m-ft}
    LIGHTHOUSE_HOST=${LIGHTHOUSE_HOST:-$(hostname)}
    RUN=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16
         --seq-length 1024 --max-position-embeddings 1024
         --micro-batch-size 4 --global-batch-size 256
         --train-iters 500000 --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine
         --lr-decay-iters 320000 --lr-warmup-fraction 0.01 --weight-decay 0.01 --clip-grad 1.0
         --bf16 --split 949,50,1
         --log-interval 100 --eval-interval 1000 --eval-iters 10 --save-interval 5000)
fi

if [ -z "${LIGHTHOUSE:-}" ]; then
    # on the PATH, or beside the venv's python (found without activating the venv)
    LH_BIN=$(command -v torchft_lighthouse || echo "$(dirname "$PY")/torchft_lighthouse")
    [ -x "$LH_BIN" ] \
        || { echo "error: torchft_lighthouse not found. Fix: pip install torchft" >&2; exit 1; }
    "$LH_BIN" --min_replicas $((FT_GROUP_SIZE / 2 + 1)) --quorum_tick_ms 100 \
        --join_timeout_ms 10000 --bind "$LIGHTHOUSE_HOST:$LIGHTHOUSE_PORT" &
    LIGHTHOUSE_PID=$!
    trap 'kill "$LIGHTHOUSE_PID" 2> /dev/null || true' EXIT
    LIGHTHOUSE=http://$LIGHTHOUSE_HOST:$LIGHTHOUSE_PORT
fi

pids=()
for ((g = 0; g < REPLICA_GROUPS; g++)); do
    CUDA_VISIBLE_DEVICES=$g "$PY" -m torch.distributed.run --nproc_per_node 1 \
        --max-restarts "$RESTARTS" --master_port $((BASE_PORT + g)) \
        "$ROOT/pretrain_gpt2.py" \
        --fault-tolerance --ft-group-size "$FT_GROUP_SIZE" --ft-replica-id $((FIRST_GROUP + g)) \
        --ft-lighthouse "$LIGHTHOUSE" "${RUN[@]}" \
        --data-path "$DATA" "${TOKENIZER[@]}" --save "$CKPT" --load "$CKPT" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
