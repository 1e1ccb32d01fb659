#!/usr/bin/env bash
# GPT-2 medium with data parallelism that survives a lost replica (--fault-tolerance, torchft):
# REPLICA_GROUPS replica groups of one GPU each on this node, each its own torchrun with a
# master port of its own. A group that dies is dropped by the others at the next step (no
# restart of the job); its torchrun (--max-restarts) starts it again, and it rejoins by fetching
# the weights and optimizer state from a live peer. See docs/operations.md (A lost data-parallel replica).
#   bash examples/pretrain_gpt2_fault_tolerant.sh                  # 8 groups, lighthouse here
#   LIGHTHOUSE=http://host:29510 REPLICA_GROUPS=4 FIRST_GROUP=4 FT_GROUP_SIZE=8 bash ...
#                                                  # groups 4-7 of 8 on another node
# Starts torchft's lighthouse (torchft_lighthouse, from `pip install torchft`) unless LIGHTHOUSE
# names one; it needs a majority of the groups for a quorum. Extra arguments go to
# pretrain_gpt2.py.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
REPLICA_GROUPS=${REPLICA_GROUPS:-8}             # replica groups on this node
FT_GROUP_SIZE=${FT_GROUP_SIZE:-$REPLICA_GROUPS} # replica groups in the whole job
FIRST_GROUP=${FIRST_GROUP:-0}    # --ft-replica-id of this node's first group
RESTARTS=${RESTARTS:-100}        # torchrun restarts of one group (each rejoins from a peer)
BASE_PORT=${BASE_PORT:-29600}
DATA=${DATA:?pass DATA=PREFIX of your .bin/.idx (tools/preprocess_data.py)}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
CKPT=${CKPT:-checkpoints/gpt2-345m-ft}

if [ -z "${LIGHTHOUSE:-}" ]; then
    command -v torchft_lighthouse > /dev/null \
        || { echo "error: torchft_lighthouse not found. Fix: pip install torchft" >&2; exit 1; }
    torchft_lighthouse --min_replicas $((FT_GROUP_SIZE / 2 + 1)) --quorum_tick_ms 100 \
        --join_timeout_ms 10000 &
    LIGHTHOUSE_PID=$!
    trap 'kill "$LIGHTHOUSE_PID" 2> /dev/null || true' EXIT
    LIGHTHOUSE=http://$(hostname):29510
fi

pids=()
for ((g = 0; g < REPLICA_GROUPS; g++)); do
    CUDA_VISIBLE_DEVICES=$g "$PY" -m torch.distributed.run --nproc_per_node 1 \
        --max-restarts "$RESTARTS" --master_port $((BASE_PORT + g)) \
        "$ROOT/pretrain_gpt2.py" \
        --fault-tolerance --ft-group-size "$FT_GROUP_SIZE" --ft-replica-id $((FIRST_GROUP + g)) \
        --ft-lighthouse "$LIGHTHOUSE" \
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 1024 --max-position-embeddings 1024 \
        --micro-batch-size 4 --global-batch-size 256 \
        --train-iters 500000 --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
        --lr-decay-iters 320000 --lr-warmup-fraction 0.01 --weight-decay 0.01 --clip-grad 1.0 \
        --bf16 \
        --data-path "$DATA" --split 949,50,1 \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
        --log-interval 100 --eval-interval 1000 --eval-iters 10 \
        --save "$CKPT" --load "$CKPT" --save-interval 5000 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
