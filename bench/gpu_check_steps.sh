# The steps of bench/gpu_check.sh (sourced by it; docs/gpu.md). Each do_<step> runs in a bash
# of its own with a time limit, its output in $LOGS/<step>.log; a line "HEADLINE ..." is its
# figure in the summary, "GPU_CHECK_SKIP why" (exit 0) marks it skipped. These functions and
# the helpers named in STEP_HELPERS are all the step's bash sees (with the exported variables).
STEP_HELPERS="skip cuda_available build_train_data run_mfu"

skip() { echo "GPU_CHECK_SKIP $*"; }
cuda_available() { $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; }

# --- --prepare: the wheels (a machine with network) and the training data -------------------
fetch_wheels() {
    set -e
    local w=$WHEELS
    mkdir -p "$w"
    # The GPU machine's interpreter (device README): CPython 3.12, manylinux x86-64.
    local tags=(--only-binary=:all: --python-version 3.12 --implementation cp
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                --platform manylinux1_x86_64)
    $PY -m pip download -d "$w" --no-deps "${tags[@]}" "megatron-core==$MCORE_VERSION" \
        "torchao==$TORCHAO_VERSION" "liger-kernel==$LIGER_VERSION" pytest-xdist execnet
    $PY -m pip download -d "$w" "${tags[@]}" pytest pytest-timeout hjson ninja psutil \
        py-cpuinfo "pydantic>=2" msgpack einops setuptools wheel
    # DeepSpeed is a source distribution only: its pure-Python wheel, no CUDA op compiled.
    DS_BUILD_OPS=0 $PY -m pip wheel --no-deps --no-build-isolation "deepspeed==$DS_VERSION" -w "$w"
    # Two versions of one distribution would stop the install step: refuse them here.
    $PY - "$w" <<'PYEOF'
import collections, os, re, sys
names = collections.defaultdict(list)
for f in os.listdir(sys.argv[1]):
    if f.endswith((".whl", ".tar.gz")):
        names[re.split(r"-\d", f, maxsplit=1)[0].replace("_", "-").lower()].append(f)
twice = {k: v for k, v in names.items() if len(v) > 1}
if twice:
    sys.exit(f"{sys.argv[1]} holds two versions of {twice}: delete the older ones")
PYEOF
    ls -l "$w"
}

# build_train_data DIR BYTES VOCAB: the demo's corpus (examples/cpu_demo.sh: Python standard
# library sources), a BPE tokenizer trained on it and its .bin/.idx; the text is deleted after.
build_train_data() {
    local data=$1 bytes=$2 vocab=$3
    if [ -f "$data/corpus_text_document.idx" ]; then
        echo "training data ready in $data ($(cat "$data/prepared.txt" 2>/dev/null))"
        return 0
    fi
    mkdir -p "$data"
    $PY -c "from megatron.data.stdlib_corpus import write_stdlib_corpus as w; \
print(w('$data/corpus.jsonl', $bytes))"
    $PY tools/train_tokenizer.py --input "$data/corpus.jsonl" --type bpe \
        --vocab-size "$vocab" --output-dir "$data/tokenizer"
    $PY tools/preprocess_data.py --input "$data/corpus.jsonl" --output-prefix "$data/corpus" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$data/tokenizer/vocab.json" \
        --merge-file "$data/tokenizer/merges.txt" --append-eod --workers 2 --log-interval 1000
    rm -f "$data/corpus.jsonl"
    echo "$bytes bytes of text, vocabulary $vocab, built $(date -u +%FT%TZ)" > "$data/prepared.txt"
    echo "training data built in $data ($(du -sh "$data" | cut -f1))"
}

# --- install ----------------------------------------------------------------------------------
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
                 "mfu steps build its model only when $MCORE_DIR exists)"
            return 0
        else
            mv "$MCORE_DIR.tmp" "$MCORE_DIR"
        fi
        echo "HEADLINE megatron-core $MCORE_VERSION in $MCORE_DIR (CPU venv: deepspeed, pytest)"
        return 0
    fi
    [ -d "$WHEELS" ] || { echo "no wheel folder $WHEELS (run --prepare beforehand)"; return 1; }
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
    $PY -c 'import deepspeed, pytest, xdist; print("deepspeed", deepspeed.__version__)'
    (cd /tmp && PYTHONPATH="$MCORE_DIR" $PY -c \
        'import megatron.core as m; print("megatron-core", m.__version__, m.__file__)')
    local optional  # imported only by the variants that use them (fp8, liger)
    optional=$($PY - <<'PYEOF'
import importlib.metadata as md
for name in ("torchao", "liger-kernel"):
    try:
        print(f"{name} {md.version(name)}", end="; ")
    except md.PackageNotFoundError:
        print(f"{name} missing", end="; ")
PYEOF
)
    echo "HEADLINE installed: ${missing:-nothing missing}; ${optional}megatron-core $MCORE_VERSION"
}

# --- tests ------------------------------------------------------------------------------------
do_tests() {
    local device=cuda select=()
    if [ "$SMOKE" = 1 ]; then
        # A few of the module's quick CPU tests and its CUDA-only skips (the whole module runs
        # on the CPU in `make test` anyway, the MoE ones included): here the step itself (its
        # workers, its report) runs.
        device=cpu select=(-m "not slow" -k "tp_layers or rng_state or triton or whole_gpt")
    fi
    # -vv (the project's addopts has -q): the test list with each result, for the record.
    # Strict kernels (exported): a Triton kernel failing its check fails its test.
    # test_cuda.py: the model, kernels and trainer; the fp8 and fused linear + cross-entropy
    # modules skip on the CPU (they need float8 GEMMs / a CUDA device).
    MEGATRON_TEST_DEVICE=$device $PY -m pytest tests/gpu/test_cuda.py tests/gpu/test_fp8_cuda.py \
        tests/gpu/test_cuda_step.py \
        tests/gpu/test_cuda_linear_cross_entropy.py -n "$TEST_WORKERS" -vv -rs \
        -p no:cacheprovider --junitxml "$LOGS/tests.xml" "${select[@]}"
    local rc=$?
    echo "HEADLINE $(grep -aE '[0-9]+ (passed|failed|error)' "$LOGS/tests.log" | tail -n 1 \
        | tr -d '=' | sed 's/^ *//')"
    return $rc
}

# --- profile ----------------------------------------------------------------------------------
# Where GPT-2 small's step time goes (bench/profile_step.py: kernels by category, GPU busy
# fraction), once per entry of PROFILE_FLAGS (';'-separated lists of pretrain_gpt2.py flags;
# an empty entry is the defaults).
do_profile() {
    local rc=0 flags
    if [ "$SMOKE" = 1 ]; then
        $PY bench/profile_step.py --smoke
        return $?
    fi
    cuda_available || { skip "no CUDA device (--smoke profiles a toy GPT on the CPU)"; return 0; }
    IFS=';' read -r -a flags <<< "$PROFILE_FLAGS"
    for f in "${flags[@]}"; do
        echo "---- profile: ${f:-(defaults)}"
        $PY bench/profile_step.py --shape "$PROFILE_SHAPE" --flags="$f" || rc=$?
    done
    return $rc
}

# --- kernels ----------------------------------------------------------------------------------
do_kernels() {
    if [ "$SMOKE" = 1 ]; then
        $PY bench/kernels.py --smoke
    elif cuda_available; then
        local more
        read -r -a more <<< "$KERNELS_ARGS"
        $PY bench/kernels.py "${more[@]}"
    else
        skip "no CUDA device: the kernel benchmark needs one (--smoke runs it on the CPU)"
    fi
}

# --- mfu_small, mfu ---------------------------------------------------------------------------
# run_mfu STEP SHAPES VARIANTS SYSTEMS: bench/mfu.py with the flags it declares; a shape it
# lacks fails the step here (--smoke replaces the shapes by a tiny one, so it would not see it).
run_mfu() {
    local name=$1 shapes=$2 variants=$3 systems=$4 extra=()
    $PY - "$shapes" "$name" <<'PYEOF' || return 2
import sys
from bench.mfu import SHAPES
unknown = [s for s in sys.argv[1].split(",") if s not in SHAPES]
if unknown:
    var = "MFU_SMALL_SHAPES" if sys.argv[2] == "mfu_small" else "MFU_SHAPES"
    sys.exit(f"bench/mfu.py has no shape {unknown} (it has {list(SHAPES)}). Fix: set {var}")
PYEOF
    [ "$SMOKE" = 1 ] && extra+=(--smoke)
    [ -n "$systems" ] && extra+=(--systems "$systems")
    local more
    read -r -a more <<< "$MFU_ARGS"
    extra+=("${more[@]}")
    $PY bench/mfu.py "${extra[@]}" --shapes "$shapes" --ours-variants "$variants" \
        --mcore-dir "$MCORE_DIR" --json "$LOGS/$name.json" --log "$LOGS/${name}_processes.log"
}
do_mfu_small() { run_mfu mfu_small "$MFU_SMALL_SHAPES" "$MFU_SMALL_VARIANTS" "$MFU_SMALL_SYSTEMS"; }
do_mfu() { run_mfu mfu "$MFU_SHAPES" "$MFU_VARIANTS" "$MFU_SYSTEMS"; }

# --- train ------------------------------------------------------------------------------------
do_train() {
    set -eo pipefail  # (bash -c does not inherit the caller's options)
    # On the GPU the checkpoint (~1.7 GB) stays out of $OUT, which comes back from the device.
    local ckpt="${TMPDIR:-/tmp}/gpu_check_train_checkpoints" model iters backend tok extra
    if [ "$SMOKE" = 1 ]; then
        ckpt="$OUT/train_checkpoints" backend=gloo
        model=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
               --micro-batch-size 2 --global-batch-size 4)
        iters=${TRAIN_ITERS:-4}
    else
        cuda_available || { skip "no CUDA device (--smoke trains a toy GPT on the CPU)"; return 0; }
        backend=nccl
        model=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
               --micro-batch-size 16 --global-batch-size 16)
        iters=${TRAIN_ITERS:-200}
        [ -f "$GPU_CHECK_DATA/corpus_text_document.idx" ] \
            || echo "NOTE: no prepared data in $GPU_CHECK_DATA: building it here (--prepare)"
    fi
    build_train_data "$GPU_CHECK_DATA" "$DATA_BYTES" "$DATA_VOCAB"
    local data=$GPU_CHECK_DATA
    tok=(--tokenizer-type GPT2BPETokenizer --vocab-file "$data/tokenizer/vocab.json"
         --merge-file "$data/tokenizer/merges.txt")
    read -r -a extra <<< "${TRAIN_FLAGS:-}"
    rm -rf "$ckpt"
    $PY pretrain_gpt2.py --distributed-backend "$backend" --bf16 "${model[@]}" \
        --train-iters "$iters" --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine \
        --lr-warmup-iters $((iters / 10)) --weight-decay 0.1 --clip-grad 1.0 \
        --hidden-dropout 0.0 --attention-dropout 0.0 \
        --data-path "$data/corpus_text_document" --split 98,2,0 "${tok[@]}" \
        --log-interval $((iters >= 20 ? iters / 10 : 1)) --eval-interval "$iters" --eval-iters 2 \
        --num-workers "$([ "$SMOKE" = 1 ] && echo 0 || echo 2)" \
        --save "$ckpt" --save-interval "$iters" "${extra[@]}" | tee "$LOGS/train_iterations.log"
    $PY - "$LOGS/train_iterations.log" <<'PYEOF'
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

# --- moe --------------------------------------------------------------------------------------
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
