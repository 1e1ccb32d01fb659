#!/usr/bin/env bash
# The built-in CPU demo (`make demo`): no GPU, no network; about 4 minutes on 2 cores once the
# project is installed (the first `make demo` on a fresh clone installs it too: 7.5 minutes in all).
#   1. a corpus from the Python standard library's own sources (JSONL)
#   2. a byte-level BPE tokenizer trained on it, locally
#   3. tools/preprocess_data.py -> mmap .bin/.idx
#   4. a small GPT trained data-parallel on 2 gloo ranks (torchrun), validated and saved
#   5. a greedy sample from the saved checkpoint
#   6. a picture of the loss curves (loss.png) and a summary: how much it learned, how fast,
#      where everything is, and what to try next
# DEMO_ITERS, DEMO_OUT and PYTHON override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${DEMO_OUT:-demo_out}
ITERS=${DEMO_ITERS:-600}
mkdir -p "$OUT"
START=$SECONDS

echo "== 1/6 corpus: Python standard library sources"
$PY -c "from megatron.data.stdlib_corpus import write_stdlib_corpus as w; \
d, b = w('$OUT/corpus.jsonl', 6_000_000); print(f'{d} documents, {b / 1e6:.1f} MB')"

echo "== 2/6 byte-level BPE tokenizer (4096 tokens), trained locally"
$PY tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --type bpe --vocab-size 4096 \
    --output-dir "$OUT/tokenizer"

echo "== 3/6 preprocess to .bin/.idx"
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/tokenizer/vocab.json"
           --merge-file "$OUT/tokenizer/merges.txt")
$PY tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/stdlib" \
    "${TOKENIZER[@]}" --append-eod --workers 2 --log-interval 500

# 2 ranks on 2 cores: data parallel is the layout that trains fastest here (one gradient
# all-reduce per step); the TP / PP / DeepSpeed layouts are in the README's Quick start.
echo "== 4/6 train: 4-layer GPT, data parallel on 2 CPU ranks (gloo), $ITERS iterations"
rm -rf "$OUT/checkpoints" "$OUT/tensorboard"
TRAIN_START=$SECONDS
$PY -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_gpt2.py \
    --distributed-backend gloo \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --train-iters "$ITERS" --lr 3e-3 --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-iters 30 --weight-decay 0.01 --clip-grad 1.0 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$OUT/stdlib_text_document" --split 95,5,0 "${TOKENIZER[@]}" \
    --log-interval 10 --eval-interval 100 --eval-iters 10 --num-workers 0 \
    --save "$OUT/checkpoints" --save-interval 200 --tensorboard-dir "$OUT/tensorboard"
TRAIN_SECONDS=$((SECONDS - TRAIN_START))

echo "== 5/6 greedy sample from the checkpoint"
$PY tools/generate_text.py --load "$OUT/checkpoints" --prompt "def __init__(self" \
    --max-new-tokens 48 --greedy

echo "== 6/6 loss curves -> $OUT/loss.png"
head -n 3 "$OUT/corpus.jsonl" > "$OUT/sample.jsonl"  # a few documents for `evaluate` below
SUMMARY=$($PY tools/plot_losses.py --tensorboard-dir "$OUT/tensorboard" \
    --output "$OUT/loss.png" --title "4-layer GPT on Python sources, 2 CPU ranks")
$PY - "$SUMMARY" "$OUT" "$TRAIN_SECONDS" "$((SECONDS - START))" "$PY" <<'PYEOF'
import json, sys
s, out, train_s, total_s = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
# the venv's python by path: the commands below work in a fresh shell, no activation needed
py = sys.argv[5]
first, final, ratio = s["first_train_loss"], s["final_validation_loss"], s.get("ratio")
verdict = "learned" if ratio is not None and ratio <= 0.6 else "learned less than the 0.6x goal"
ckpt = f"{out}/checkpoints"
print(f"""
================================ demo summary ================================
 {verdict}: first logged training loss {first:.2f} -> final validation loss {final:.2f}
     ({ratio:.2f}x; a uniform guess over 4096 tokens is 8.32)
 throughput   {s['tokens_per_second']:.0f} tokens/s on 2 CPU ranks; training {train_s} s for \
{s['iterations']} iterations, whole demo {total_s} s
 checkpoint   {ckpt}
 TensorBoard  tensorboard --logdir {out}/tensorboard
 loss plot    {s["plot"] or "not drawn (pip install matplotlib)"}
 next (or `source .venv/bin/activate` and plain `python`):
   {py} tools/generate_text.py --load {ckpt} --prompt "import os" --top-p 0.9 --temperature 0.8
   {py} tools/evaluate.py --task loose-json --valid-data {out}/sample.jsonl --load {ckpt}
   {py} tools/convert_checkpoint.py --load {ckpt} --to-hf {out}/hf \\
       --tokenizer-files {out}/tokenizer/vocab.json {out}/tokenizer/merges.txt
==============================================================================""")
PYEOF
