#!/usr/bin/env bash
# The whole GPU check in one command (docs/gpu.md): on one CUDA GPU with no network, every step
# in one 10-minute call, in the order that loses least when the booking runs short:
#   install    the wheels it needs, from a local folder ($WHEELS, default shared/wheels)
#   tests      the CUDA tests (tests/gpu/test_cuda.py) under $TEST_WORKERS pytest workers
#   kernels    bench/kernels.py: the Triton kernels vs torch eager and torch.compile
#   mfu_small  bench/mfu.py at GPT-2 small (micro-batch 16, 32, 64), every variant of ours
#   train      GPT-2 small (12 x 768, seq 1024), bf16, pretrain_gpt2.py on the prepared data
#   mfu        bench/mfu.py at the larger shapes (GPT 1.3B, GPT-2 medium, GPT 2.7B)
#   moe        bench/moe.py: an MoE GPT's step time, looped vs grouped experts
# Each step has its own time limit; a failing step does not stop the others. One table at the
# end (step, status, seconds, headline); every log in $LOGS, and after each step all of them in
# one archive, $OUT/gpu_check_logs.tgz (a remote runner may bring back only a few files).
#
#   bash bench/gpu_check.sh --prepare          beforehand, on any Linux x86-64 machine with
#                                              network (a CPU one is fine): the wheels into
#                                              $WHEELS and the training data into
#                                              $GPU_CHECK_DATA, both in shared/ (it travels)
#   bash bench/gpu_check.sh                    on the GPU: every step within $BUDGET s
#   bash bench/gpu_check.sh --steps install,mfu,moe   some steps only (a second call)
#   bash bench/gpu_check.sh --smoke            the same on the CPU at tiny sizes (make test
#                                              runs it): CUDA-only parts skip and say why
#   bash bench/gpu_check.sh --smoke --prepare  the tiny training data only (no download)
#   bash bench/gpu_check.sh --fetch-wheels     the wheels only
#
# Environment (default): OUT (gpu_check_out), LOGS (the step logs, JSON, XML: $OUT), WHEELS
# (shared/wheels), GPU_CHECK_DATA (shared/gpu-check-data beside the wheels; --smoke: $OUT/data),
# PYTHON (python3), GPU_DEPS (.venv/gpu-deps: pip --target for what the machine lacks),
# MCORE_VERSION (0.19.2 on Python 3.12+, else 0.16.1), MCORE_DIR, TORCHAO_VERSION (0.18.0),
# LIGER_VERSION (0.8.5), DS_VERSION (0.19.8), TEST_WORKERS (4; --smoke 2), TRAIN_ITERS (200),
# TRAIN_FLAGS (extra pretrain_gpt2.py flags), MFU_SMALL_SHAPES, MFU_SMALL_VARIANTS, MFU_SHAPES,
# MFU_VARIANTS (bench/mfu.py's --shapes / --ours-variants of the two mfu steps, below),
# MFU_SMALL_SYSTEMS, MFU_SYSTEMS (its --systems; empty: its default), MFU_ARGS (more of its
# flags for both steps, e.g. "--warmup 2 --steps 5"),
# MEGATRON_KERNELS_STRICT (1: a Triton kernel failing its self-check raises, never falls back
# to torch unseen), BUDGET (570 s for all steps), T_<STEP> (each step's limit, seconds:
# T_INSTALL T_TESTS T_PROFILE T_KERNELS T_MFU_SMALL T_TRAIN T_MFU T_MOE), PROFILE_SHAPE
# (gpt2-small-b16) and PROFILE_FLAGS (';'-separated trainer flag lists: ";--torch-compile"),
# KERNELS_ARGS (more bench/kernels.py flags, e.g. "--ops norms --widths 768").
# A step that would start with under 30 s of the budget left is not started.
#
# Packages already importable on the machine are left alone: only the missing ones go into
# $GPU_DEPS (pip --target, --no-deps: torch is never reinstalled). megatron-core goes into a
# folder of its own ($MCORE_DIR): its `megatron` namespace must not meet this repository's.
# DeepSpeed is a source distribution only: --prepare builds its pure-Python wheel
# (DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation; needs torch where it runs).
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
PREPARE=0
FETCH=0
ORDER="install,tests,profile,kernels,mfu_small,train,mfu,moe"
STEPS=$ORDER
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1 ;;
        --prepare) PREPARE=1 ;;
        --fetch-wheels) FETCH=1 ;;
        --steps) STEPS="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
                   exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (--smoke, --prepare, --steps a,b,c," \
               "--fetch-wheels, --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ $SMOKE = 1 ] && [ $FETCH = 1 ]; then
    echo "gpu_check.sh: --smoke --fetch-wheels: the smoke needs no wheels (its install step" \
         "fetches megatron-core itself). Fix: --fetch-wheels alone, or --smoke --prepare" >&2
    exit 2
fi
for s in ${STEPS//,/ }; do
    case ",$ORDER," in *",$s,"*) ;; *)
        echo "gpu_check.sh: --steps $s: no such step (the steps: $ORDER)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
WHEELS=${WHEELS:-shared/wheels}
GPU_DEPS=${GPU_DEPS:-.venv/gpu-deps}
PYVER=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ -z "${MCORE_VERSION:-}" ]; then
    # megatron-core 0.17+ is published for Python 3.12+ only (the GPU machine has 3.12).
    if [ "$FETCH$PREPARE" != 00 ] || $PY -c 'import sys; sys.exit(sys.version_info < (3, 12))'
    then MCORE_VERSION=0.19.2
    else MCORE_VERSION=0.16.1
    fi
fi
MCORE_DIR=${MCORE_DIR:-.venv/mcore-$MCORE_VERSION-py$PYVER}
: "${TORCHAO_VERSION:=0.18.0}" "${LIGER_VERSION:=0.8.5}" "${DS_VERSION:=0.19.8}"
mkdir -p "$OUT" "$GPU_DEPS" "$(dirname "$MCORE_DIR")"
OUT=$(cd "$OUT" && pwd)
LOGS=${LOGS:-$OUT}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
GPU_DEPS=$(cd "$GPU_DEPS" && pwd)
MCORE_DIR="$(cd "$(dirname "$MCORE_DIR")" && pwd)/$(basename "$MCORE_DIR")"
if [ $SMOKE = 1 ]; then
    GPU_CHECK_DATA=${GPU_CHECK_DATA:-$OUT/data} DATA_BYTES=200000 DATA_VOCAB=512
else
    GPU_CHECK_DATA=${GPU_CHECK_DATA:-$(dirname "$WHEELS")/gpu-check-data}
    DATA_BYTES=12000000 DATA_VOCAB=16384
fi
mkdir -p "$GPU_CHECK_DATA"
GPU_CHECK_DATA=$(cd "$GPU_CHECK_DATA" && pwd)
export PYTHONPATH="$PWD:$GPU_DEPS${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the kernels must compile for the GPU (kernels --smoke sets it itself)
: "${MEGATRON_KERNELS_STRICT:=1}"
# The two mfu steps: GPT-2 small with every variant of ours first (the shape of the goals),
# then the larger shapes with the default flags and the best combination. bench/mfu.py runs
# them in the order given, saving each row: the defaults and the best combination come first.
: "${MFU_SMALL_SHAPES:=gpt2-small-b16,gpt2-small-b32,gpt2-small-b64}"
: "${MFU_SMALL_VARIANTS:=default,best,compile,cudagraphs,fused-linear-ce,liger,fp8,fp8-rowwise,fp8-eager}"
: "${MFU_SHAPES:=gpt-1.3b,gpt2-medium,gpt-2.7b}" "${MFU_VARIANTS:=default,best}"
: "${MFU_SMALL_SYSTEMS:=}" "${MFU_SYSTEMS:=}" "${MFU_ARGS:=}"
: "${PROFILE_SHAPE:=gpt2-small-b16}" "${PROFILE_FLAGS:=;--torch-compile}" "${KERNELS_ARGS:=}"
if [ $SMOKE = 1 ]; then
    export OMP_NUM_THREADS=1  # a loaded small CPU: no thread oversubscription
    # mfu_small already runs every system on the tiny shape: the mfu step's own run is ours.
    [ -n "$MFU_SYSTEMS" ] || MFU_SYSTEMS=ours
    # The step limits are there for the GPU booking; on a shared, loaded CPU a tiny step can
    # take many times its usual seconds, so the smoke's limits only stop a hung step (its
    # caller, e.g. the test, bounds the whole run).
    : "${T_INSTALL:=600}" "${T_TESTS:=600}" "${T_KERNELS:=600}" "${T_MFU_SMALL:=600}"
    : "${T_PROFILE:=600}"
    : "${T_TRAIN:=600}" "${T_MFU:=600}" "${T_MOE:=600}" "${BUDGET:=3600}" "${TEST_WORKERS:=2}"
else
    # On one H100 (2026-11-26) the 41 CUDA tests took 69 s with 4 workers; the 56 of wave 4 ran
    # past 125 s (the compiled CUDA-graph and fp8 checks compile for tens of seconds each).
    : "${T_INSTALL:=90}" "${T_TESTS:=200}" "${T_KERNELS:=120}" "${T_MFU_SMALL:=180}"
    : "${T_PROFILE:=90}"
    : "${T_TRAIN:=90}" "${T_MFU:=240}" "${T_MOE:=60}" "${BUDGET:=570}" "${TEST_WORKERS:=4}"
fi
export PY OUT LOGS WHEELS GPU_DEPS MCORE_VERSION MCORE_DIR SMOKE TRAIN_ITERS GPU_CHECK_DATA \
    DATA_BYTES DATA_VOCAB TEST_WORKERS MEGATRON_KERNELS_STRICT MFU_SMALL_SHAPES \
    MFU_SMALL_VARIANTS MFU_SHAPES MFU_VARIANTS MFU_SMALL_SYSTEMS MFU_SYSTEMS MFU_ARGS \
    PROFILE_SHAPE PROFILE_FLAGS KERNELS_ARGS
# shellcheck source=bench/gpu_check_steps.sh
source bench/gpu_check_steps.sh

if [ $PREPARE = 1 ] || [ $FETCH = 1 ]; then  # on a machine with network, before the GPU call
    set -e
    if [ $SMOKE = 0 ]; then fetch_wheels; fi
    if [ $PREPARE = 1 ]; then build_train_data "$GPU_CHECK_DATA" "$DATA_BYTES" "$DATA_VOCAB"; fi
    exit 0
fi

SUMMARY="$LOGS/summary.tsv"
ARCHIVE="$OUT/gpu_check_logs.tgz"
START=$SECONDS
: > "$SUMMARY"

# archive: every log, JSON and XML of $LOGS (not the data or checkpoints) in one file.
archive() {
    (cd "$LOGS" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.json' \
        -o -name '*.xml' -o -name '*.tsv' \) -print0 | tar czf "$ARCHIVE.tmp" --null -T -) \
        && mv "$ARCHIVE.tmp" "$ARCHIVE"
    [ "$LOGS" = "$OUT" ] || cp "$SUMMARY" "$OUT/summary.tsv"
}

# step NAME TIMEOUT FUNCTION: run it with its own limit, log to $LOGS/NAME.log, record a row.
# The headline is the last "HEADLINE ..." line the step printed; a step that printed
# "GPU_CHECK_SKIP why" (and exited 0) is reported as skipped, with the reason.
step() {
    local name=$1 limit=$2 fn=$3 start rc status head
    case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    local left=$((BUDGET - (SECONDS - START)))
    if [ $left -lt 30 ]; then
        printf '%s\t%s\t0\t%s\n' "$name" "not run" \
            "${left}s of BUDGET=$BUDGET left: run it in a call of its own (--steps)" >> "$SUMMARY"
        archive
        return 0
    fi
    # The limit and the 10 s grace after it end within the budget.
    [ "$limit" -le $((left - 10)) ] || limit=$((left - 10))
    echo "== $name (limit ${limit}s) -> $LOGS/$name.log"
    start=$SECONDS
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "$fn" $STEP_HELPERS); $fn" \
        > "$LOGS/$name.log" 2>&1
    rc=$?
    head=$(grep -a '^HEADLINE ' "$LOGS/$name.log" | tail -n 1 | cut -c10- | tr '\t' ' ')
    if grep -aq '^GPU_CHECK_SKIP ' "$LOGS/$name.log" && [ $rc = 0 ]; then
        status=skipped
        head=$(grep -a '^GPU_CHECK_SKIP ' "$LOGS/$name.log" | tail -n 1 | cut -c16-)
    elif [ $rc = 0 ]; then status=ok
    elif [ $rc = 124 ] || [ $rc = 137 ]; then status="TIMEOUT"
    else status="FAIL($rc)"
    fi
    [ -n "$head" ] || head=$(grep -av '^\s*$' "$LOGS/$name.log" | tail -n 1 | cut -c1-160)
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$head" >> "$SUMMARY"
    echo "   $status in $((SECONDS - start)) s: $head"
    archive
}

echo "gpu_check: steps $STEPS$([ $SMOKE = 1 ] && echo ' (smoke, CPU)'), logs in $LOGS"
step install "$T_INSTALL" do_install
step tests "$T_TESTS" do_tests
step profile "$T_PROFILE" do_profile
step kernels "$T_KERNELS" do_kernels
step mfu_small "$T_MFU_SMALL" do_mfu_small  # rows are printed (and saved) as they come
step train "$T_TRAIN" do_train
step mfu "$T_MFU" do_mfu
step moe "$T_MOE" do_moe

echo
echo "================================ gpu_check summary ================================"
printf '%-10s %-10s %6s  %s\n' step status seconds headline
FAILED=0
while IFS=$'\t' read -r name status secs head; do
    printf '%-10s %-10s %6s  %s\n' "$name" "$status" "$secs" "$head"
    case "$status" in ok|skipped|"not run") ;; *) FAILED=1 ;; esac
done < "$SUMMARY"
echo "total $((SECONDS - START)) s; logs: $LOGS/<step>.log; table: $SUMMARY; all: $ARCHIVE"
exit $FAILED
