#!/usr/bin/env bash
# The built-in CPU demo (`make demo`): no GPU, no network, a few minutes on 2 cores.
#   1. a corpus from the Python standard library's own sources (JSONL)
#   2. a byte-level BPE tokenizer trained on it, locally
#   3. tools/preprocess_data.py -> mmap .bin/.idx
#   4. a small GPT trained with TP=2 x DP=2 on 4 gloo ranks (torchrun), validated and saved
#   5. a greedy sample from the saved checkpoint (TP=2, 2 ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${DEMO_OUT:-demo_out}
ITERS=${DEMO_ITERS:-300}
mkdir -p "$OUT"

echo "== 1/5 corpus: Python standard library sources"
$PY -c "from megatron.data.stdlib_corpus import write_stdlib_corpus as w; \
d, b = w('$OUT/corpus.jsonl', 6_000_000); print(f'{d} documents, {b / 1e6:.1f} MB')"

echo "== 2/5 byte-level BPE tokenizer (4096 tokens), trained locally"
$PY tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --type bpe --vocab-size 4096 \
    --output-dir "$OUT/tokenizer"

echo "== 3/5 preprocess to .bin/.idx"
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/tokenizer/vocab.json"
           --merge-file "$OUT/tokenizer/merges.txt")
$PY tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/stdlib" \
    "${TOKENIZER[@]}" --append-eod --workers 2 --log-interval 500

echo "== 4/5 train: TP=2 x DP=2 on 4 CPU ranks (gloo)"
rm -rf "$OUT/checkpoints"
$PY -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_gpt2.py \
    --tensor-model-parallel-size 2 --distributed-backend gloo \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 16 \
    --train-iters "$ITERS" --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-iters 20 --weight-decay 0.01 --clip-grad 1.0 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$OUT/stdlib_text_document" --split 95,5,0 "${TOKENIZER[@]}" \
    --log-interval 10 --eval-interval 100 --eval-iters 5 --num-workers 0 \
    --save "$OUT/checkpoints" --save-interval 100 --tensorboard-dir "$OUT/tensorboard"

echo "== 5/5 greedy sample from the checkpoint (TP=2)"
$PY -m torch.distributed.run --standalone --nproc_per_node 2 tools/generate_text.py \
    --load "$OUT/checkpoints" --prompt "def __init__(self" --max-new-tokens 48 --greedy
