#!/usr/bin/env bash
# The whole GPU check in one command (docs/gpu.md): on one CUDA GPU with no network,
#   1 install   the wheels it needs from a local folder ($WHEELS, default shared/wheels)
#   2 tests     the CUDA test suite (MEGATRON_TEST_DEVICE=cuda pytest tests/gpu/test_cuda.py)
#   3 kernels   bench/kernels.py: Triton kernels vs torch eager and torch.compile
#   4 train     GPT-2 small (12 x 768, seq 1024) in bf16 on the demo corpus, pretrain_gpt2.py
#   5 moe       bench/moe.py: an MoE GPT's step time and tokens/s, looped vs grouped experts
#   6 mfu       bench/mfu.py: ours vs Megatron-core vs Hugging Face GPT-2, bf16
# Each step has its own time limit (`timeout`); a failed step does not stop the others. One
# table at the end (step, status, seconds, headline figure); full logs under $OUT.
#
#   bash bench/gpu_check.sh                    every step within $BUDGET s (570: one 10-minute
#                                              call); mfu runs last and gets the time left
#   bash bench/gpu_check.sh --steps install,mfu   some steps only (the whole MFU table: a 2nd call)
#   bash bench/gpu_check.sh --smoke            the same on the CPU at tiny sizes (make test runs
#                                              it): CUDA-only parts skip and say why
#   make gpu-check                             the first form
#
# Environment: OUT (gpu_check_out), WHEELS (shared/wheels), PYTHON (python3), GPU_DEPS (the pip
# --target folder for missing packages, .venv/gpu-deps), GPU_CHECK_DATA (the training data,
# .venv/gpu-check-data; --smoke: under $OUT), MCORE_VERSION (0.19.2 on Python 3.12+,
# else 0.16.1), MCORE_DIR (.venv/mcore-$MCORE_VERSION-pyX.Y), TRAIN_ITERS (200), BUDGET (570 s
# for all steps together), T_<STEP> (each step's own limit, seconds: T_INSTALL T_TESTS T_KERNELS
# T_TRAIN T_MOE T_MFU). A step that would start with under 30 s of the budget left is not started.
#
# The wheels, fetched beforehand on any Linux x86-64 machine with network (a CPU-only one is
# fine), for the GPU machine's Python 3.12 (it already has torch, triton, transformers, numpy,
# tokenizers, tiktoken, pyyaml, tensorboard):
#
#   bash bench/gpu_check.sh --fetch-wheels     (runs exactly these, with $PYTHON -m pip)
#
#   W=shared/wheels; mkdir -p $W
#   pip download -d $W --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --abi cp312 --platform manylinux_2_28_x86_64 megatron-core==0.19.2
#   pip download -d $W --only-binary=:all: --python-version 3.12 --implementation cp \
#       --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#       pytest pytest-timeout hjson ninja psutil py-cpuinfo "pydantic>=2" msgpack einops \
#       setuptools wheel torchao==0.18.0
#   # DeepSpeed is a source distribution only. Either build its pure-Python wheel here (no CUDA
#   # op is compiled; DeepSpeed picks its accelerator when it runs; needs torch installed):
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w $W
#   # or bring the sdist (pip download --no-deps --no-binary=:all: deepspeed==0.19.8 -d $W):
#   # the install step then builds it on the GPU machine with
#   #   DS_BUILD_OPS=0 pip install --no-build-isolation --no-deps --target $GPU_DEPS <sdist>
#   # (setuptools and wheel from $W are installed first, so the build needs no network).
#
# Packages already importable on the machine are left alone: only the missing ones go into
# $GPU_DEPS (pip --target, --no-deps: torch is never reinstalled). megatron-core goes into a
# folder of its own ($MCORE_DIR): its `megatron` namespace must not meet this repository's.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
FETCH=0
STEPS="install,tests,kernels,mfu,train,moe"
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1 ;;
        --fetch-wheels) FETCH=1 ;;
        --steps) STEPS="$2"; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (--smoke, --steps a,b,c, --fetch-wheels," \
               "--help)" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
WHEELS=${WHEELS:-shared/wheels}

if [ $FETCH = 1 ]; then  # the commands of the header, on a machine with network
    set -e
    W=$WHEELS; mkdir -p "$W"
    TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312)
    $PY -m pip download -d "$W" --no-deps "${TAGS[@]}" --platform manylinux_2_28_x86_64 \
        megatron-core==0.19.2
    $PY -m pip download -d "$W" "${TAGS[@]}" --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 pytest pytest-timeout hjson ninja psutil py-cpuinfo \
        "pydantic>=2" msgpack einops setuptools wheel torchao==0.18.0
    DS_BUILD_OPS=0 $PY -m pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w "$W"
    ls -l "$W"
    exit 0
fi
GPU_DEPS=${GPU_DEPS:-.venv/gpu-deps}
PYVER=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ -z "${MCORE_VERSION:-}" ]; then
    # megatron-core 0.17+ is published for Python 3.12+ only.
    if $PY -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
        MCORE_VERSION=0.19.2
    else
        MCORE_VERSION=0.16.1
    fi
fi
MCORE_DIR=${MCORE_DIR:-.venv/mcore-$MCORE_VERSION-py$PYVER}
mkdir -p "$OUT" "$GPU_DEPS" "$(dirname "$MCORE_DIR")"
OUT=$(cd "$OUT" && pwd)
GPU_DEPS=$(cd "$GPU_DEPS" && pwd)
MCORE_DIR="$(cd "$(dirname "$MCORE_DIR")" && pwd)/$(basename "$MCORE_DIR")"
export PYTHONPATH="$PWD:$GPU_DEPS${PYTHONPATH:+:$PYTHONPATH}"
export MCORE_DIR
unset TRITON_INTERPRET  # the kernels must compile for the GPU (kernels --smoke sets it itself)
if [ $SMOKE = 1 ]; then
    export OMP_NUM_THREADS=1  # a loaded small CPU: no thread oversubscription
    : "${T_INSTALL:=120}" "${T_TESTS:=120}" "${T_KERNELS:=120}" "${T_MFU:=150}" "${T_TRAIN:=150}"
    : "${T_MOE:=60}"
    : "${BUDGET:=3600}"
else
    : "${T_INSTALL:=120}" "${T_TESTS:=240}" "${T_KERNELS:=180}" "${T_MFU:=540}" "${T_TRAIN:=150}"
    : "${T_MOE:=90}"
    : "${BUDGET:=570}"
fi
SUMMARY="$OUT/summary.tsv"
START=$SECONDS
: > "$SUMMARY"

# step NAME TIMEOUT FUNCTION: run it with its own limit, log to $OUT/NAME.log, record a row.
# The headline is the last "HEADLINE ..." line the step printed; a step that printed
# "GPU_CHECK_SKIP why" (and exited 0) is reported as skipped, with the reason.
step() {
    local name=$1 limit=$2 fn=$3 start rc status head
    case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    local left=$((BUDGET - (SECONDS - START)))
    if [ $left -lt 30 ]; then
        printf '%s\t%s\t0\t%s\n' "$name" "not run" \
            "${left}s of BUDGET=$BUDGET left: run it in a call of its own (--steps)" >> "$SUMMARY"
        return 0
    fi
    [ "$limit" -le $((left - 5)) ] || limit=$((left - 5))
    echo "== $name (limit ${limit}s) -> $OUT/$name.log"
    start=$SECONDS
    timeout --kill-after=15 "$limit" bash -c "$(declare -f "$fn" skip cuda_available); $fn" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    head=$(grep -a '^HEADLINE ' "$OUT/$name.log" | tail -n 1 | cut -c10- | tr '\t' ' ')
    if grep -aq '^GPU_CHECK_SKIP ' "$OUT/$name.log" && [ $rc = 0 ]; then
        status=skipped
        head=$(grep -a '^GPU_CHECK_SKIP ' "$OUT/$name.log" | tail -n 1 | cut -c16-)
    elif [ $rc = 0 ]; then status=ok
    elif [ $rc = 124 ] || [ $rc = 137 ]; then status="TIMEOUT"
    else status="FAIL($rc)"
    fi
    [ -n "$head" ] || head=$(grep -av '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-160)
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$head" >> "$SUMMARY"
    echo "   $status in $((SECONDS - start)) s: $head"
}
skip() { echo "GPU_CHECK_SKIP $*"; }
cuda_available() { $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; }
GPU_CHECK_DATA=${GPU_CHECK_DATA:-$PWD/.venv/gpu-check-data}
export PY OUT WHEELS GPU_DEPS MCORE_VERSION SMOKE TRAIN_ITERS GPU_CHECK_DATA

# --- 1 install ------------------------------------------------------------------------------
do_install() {
    set -e
    mkdir -p "$GPU_DEPS"
    if [ "$SMOKE" = 1 ]; then
        # The CPU venv has DeepSpeed and pytest (make setup); only megatron-core is fetched.
        if [ -d "$MCORE_DIR/megatron/core" ]; then
            echo "megatron-core $MCORE_VERSION already in $MCORE_DIR"
        elif ! $PY -m pip install -q --retries 1 --timeout 15 --no-deps \
                --target "$MCORE_DIR.tmp" "megatron-core==$MCORE_VERSION"; then
            rm -rf "$MCORE_DIR.tmp"
            skip "megatron-core $MCORE_VERSION: the package registry could not be reached (the" \
                 "mfu step builds its model only when $MCORE_DIR exists)"
            return 0
        else
            mv "$MCORE_DIR.tmp" "$MCORE_DIR"
        fi
        echo "HEADLINE megatron-core $MCORE_VERSION in $MCORE_DIR (CPU venv: deepspeed, pytest)"
        return 0
    fi
    [ -d "$WHEELS" ] || { echo "no wheel folder $WHEELS (see the header of $0)"; return 1; }
    $PY -m pip --version || $PY -m ensurepip --user  # some Python builds ship without pip
    # Missing distributions only, wheels before sdists (setuptools/wheel first, for the build).
    local missing
    missing=$($PY - "$WHEELS" <<'PYEOF'
import importlib.metadata as md, os, re, sys
folder = sys.argv[1]
files = sorted(os.listdir(folder), key=lambda f: (not f.endswith(".whl"), f))
for f in files:
    if not f.endswith((".whl", ".tar.gz")):
        continue
    name = re.split(r"-\d", f, maxsplit=1)[0].replace("_", "-").lower()
    if name == "megatron-core":
        continue
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(os.path.join(folder, f))
PYEOF
)
    for f in $missing; do  # one at a time: an sdist's build sees the wheels installed before it
        echo "installing $f into $GPU_DEPS"
        DS_BUILD_OPS=0 $PY -m pip install -q --no-deps --no-index --find-links "$WHEELS" \
            --no-build-isolation --upgrade --target "$GPU_DEPS" "$f"
    done
    if [ ! -d "$MCORE_DIR/megatron/core" ]; then
        $PY -m pip install -q --no-deps --no-index --find-links "$WHEELS" \
            --target "$MCORE_DIR" "megatron-core==$MCORE_VERSION"
    fi
    $PY -c 'import deepspeed, pytest; print("deepspeed", deepspeed.__version__)'
    (cd /tmp && PYTHONPATH="$MCORE_DIR" $PY -c \
        'import megatron.core as m; print("megatron-core", m.__version__, m.__file__)')
    echo "HEADLINE installed: ${missing:-nothing missing}; megatron-core $MCORE_VERSION"
}

# --- 2 tests --------------------------------------------------------------------------------
do_tests() {
    if [ "$SMOKE" = 1 ]; then
        # A few of the module's CPU tests and its CUDA-only skips: the whole module runs on the
        # CPU in `make test` anyway; here the step itself (pytest, its report) is exercised.
        $PY -m pytest tests/gpu/test_cuda.py -rs -m "not slow" -p no:cacheprovider \
            -k "tp_layers or rng_state or triton or whole_gpt or moe"
    else
        # -v: the test list with each result, for the record (the report of issue 25)
        MEGATRON_TEST_DEVICE=cuda $PY -m pytest tests/gpu/test_cuda.py tests/gpu/test_fp8_cuda.py \
            -v -rs -p no:cacheprovider \
            --junitxml "$OUT/tests.xml"
    fi
    local rc=$?
    echo "HEADLINE $(grep -aE '[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -n 1 \
        | tr -d '=' | sed 's/^ *//')"
    return $rc
}

# --- 3 kernels ------------------------------------------------------------------------------
do_kernels() {
    if [ "$SMOKE" = 1 ]; then
        $PY bench/kernels.py --smoke
    elif cuda_available; then
        $PY bench/kernels.py
    else
        skip "no CUDA device: the kernel benchmark needs one (--smoke runs it on the CPU)"
    fi
}

# --- 4 mfu ----------------------------------------------------------------------------------
do_mfu() {
    local extra=()
    [ "$SMOKE" = 1 ] && extra=(--smoke)
    $PY bench/mfu.py "${extra[@]}" --mcore-dir "$MCORE_DIR" --json "$OUT/mfu.json" \
        --log "$OUT/mfu_mcore.log"
}

# --- 5 train --------------------------------------------------------------------------------
do_train() {
    set -eo pipefail  # (bash -c does not inherit the caller's options)
    # On the GPU the data (~40 MB) and the checkpoint (~1.7 GB) stay out of $OUT, which comes
    # back from the device machine; the data is kept for the next call.
    local data="$GPU_CHECK_DATA" ckpt="${TMPDIR:-/tmp}/gpu_check_train_checkpoints" model iters tok
    if [ "$SMOKE" = 1 ]; then
        data="$OUT/data" ckpt="$OUT/train_checkpoints"
        local corpus_bytes=200000 vocab=512 backend=gloo
        model=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
               --micro-batch-size 2 --global-batch-size 4)
        iters=${TRAIN_ITERS:-4}
    else
        cuda_available || { skip "no CUDA device (--smoke trains a toy GPT on the CPU)"; return 0; }
        local corpus_bytes=12000000 vocab=16384 backend=nccl
        model=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
               --micro-batch-size 16 --global-batch-size 16)
        iters=${TRAIN_ITERS:-200}
    fi
    tok=(--tokenizer-type GPT2BPETokenizer --vocab-file "$data/tokenizer/vocab.json"
         --merge-file "$data/tokenizer/merges.txt")
    if [ ! -f "$data/corpus_text_document.idx" ]; then  # the demo's data (examples/cpu_demo.sh)
        mkdir -p "$data"
        $PY -c "from megatron.data.stdlib_corpus import write_stdlib_corpus as w; \
print(w('$data/corpus.jsonl', $corpus_bytes))"
        $PY tools/train_tokenizer.py --input "$data/corpus.jsonl" --type bpe \
            --vocab-size "$vocab" --output-dir "$data/tokenizer"
        $PY tools/preprocess_data.py --input "$data/corpus.jsonl" --output-prefix "$data/corpus" \
            "${tok[@]}" --append-eod --workers 2 --log-interval 1000
    fi
    rm -rf "$ckpt"
    $PY pretrain_gpt2.py --distributed-backend "$backend" --bf16 "${model[@]}" \
        --train-iters "$iters" --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine \
        --lr-warmup-iters $((iters / 10)) --weight-decay 0.1 --clip-grad 1.0 \
        --hidden-dropout 0.0 --attention-dropout 0.0 \
        --data-path "$data/corpus_text_document" --split 98,2,0 "${tok[@]}" \
        --log-interval $((iters >= 20 ? iters / 10 : 1)) --eval-interval "$iters" --eval-iters 2 \
        --num-workers "$([ "$SMOKE" = 1 ] && echo 0 || echo 2)" \
        --save "$ckpt" --save-interval "$iters" | tee "$OUT/train_iterations.log"
    $PY - "$OUT/train_iterations.log" <<'PYEOF'
import re, sys
lines = [x for x in open(sys.argv[1]) if " iteration " in x and "lm loss:" in x]
if not lines:
    sys.exit("no iteration line in the training log")
def field(line, name):
    m = re.search(re.escape(name) + r": ([-+0-9.eE%]+)", line)
    return m.group(1) if m else "-"
first, last = lines[0], lines[-1]
print(f"HEADLINE loss {float(field(first, 'lm loss')):.3f} -> {float(field(last, 'lm loss')):.3f}, "
      f"{float(field(last, 'tokens per second')):.0f} tokens/s, "
      f"{field(last, 'TFLOP/s per device')} TFLOP/s, MFU {field(last, 'MFU')}")
PYEOF
}

# --- 6 moe ----------------------------------------------------------------------------------
do_moe() {
    # Dense twin, looped experts, --moe-grouped-gemm (torch._grouped_mm in bf16 on sm90): one
    # table of ms per step and tokens/s; the load-balance part of bench/moe.py is CPU work.
    if [ "$SMOKE" = 1 ]; then
        $PY bench/moe.py --layers 2 --hidden 64 --seq 64 --vocab 256 --expert-ffn 64 --batch 4 \
            --steps 2 --rounds 1 --no-balance
    elif cuda_available; then
        $PY bench/moe.py --device cuda --bf16 --layers 4 --hidden 1024 --heads 16 --seq 1024 \
            --vocab 32768 --experts 8 --topk 2 --expert-ffn 2048 --batch 8 --steps 10 \
            --rounds 3 --no-balance
    else
        skip "no CUDA device (--smoke steps a toy MoE GPT on the CPU)"
    fi
}

echo "gpu_check: steps $STEPS$([ $SMOKE = 1 ] && echo ' (smoke, CPU)'), logs in $OUT"
step install "$T_INSTALL" do_install
step tests "$T_TESTS" do_tests
step kernels "$T_KERNELS" do_kernels
step train "$T_TRAIN" do_train
step moe "$T_MOE" do_moe
step mfu "$T_MFU" do_mfu  # last: the longest; its rows are printed (and saved) as they come

echo
echo "================================ gpu_check summary ================================"
printf '%-8s %-10s %6s  %s\n' step status seconds headline
FAILED=0
while IFS=$'\t' read -r name status secs head; do
    printf '%-8s %-10s %6s  %s\n' "$name" "$status" "$secs" "$head"
    case "$status" in ok|skipped|"not run") ;; *) FAILED=1 ;; esac
done < "$SUMMARY"
echo "total $((SECONDS - START)) s; logs: $OUT/<step>.log; table: $SUMMARY"
exit $FAILED
