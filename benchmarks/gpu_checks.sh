#!/bin/bash
# The GPU checks of the banded operator in one time-bounded run, on a GPU machine without network
# access (torch with CUDA there, this repository copied over, the wheels its image lacks carried):
#
#   1. install the carried wheels (pip --no-index --no-deps --target, put on PYTHONPATH);
#   2. build the extension for this GPU, in place (skipped when it imports with its CUDA and
#      tensor-core kernels already);
#   3. the tests of every route of the operator on the GPU: tensor-core, flash-window, cudnn-band,
#      CUDA-core, blocked SDPA, torch (whole files: the CPU cases run too), the dispatch and
#      route-table tests, opcheck of the tensor-core operators;
#   4. every route timed over the grid T in {1024, 2048, 4096, 8192, 16384} x w in {33, 129, 257,
#      513, 1025} beside FlexAttention and dense attention in the same run (bfloat16, B = 8,
#      H = 8, D = 64, forward + backward, median of 10), as JSON records, and the cells those
#      records would decide for `auto` (benchmarks/measured_routes.py --show);
#   5. while time is left: the CUDA tests of the attention modules, the per-call host cost, the
#      speech encoder (batch 8 and 32) and the training throughput (8,192 and 32,768 tokens).
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS]
#   bash benchmarks/gpu_checks.sh --dry-run OUT_DIR [SECONDS]   # what it would run, on any machine
#   bash benchmarks/gpu_checks.sh --prepare-wheels DIR          # here, with network: the wheels
#
# SECONDS (default 540) bounds the whole run: each step gets at most its own share and what is
# left, a step that would get under 20 s is skipped, and OUT_DIR/summary.txt says what ran and how
# it ended. OUT_DIR ends with four files (a device machine returns few): summary.txt,
# kernel_grid_bf16_d64.json (the records, for benchmarks/results/), kernel_grid_bf16_d64.md and
# logs.tar.gz (every log and table). PYTHON names another interpreter (default python3);
# GPU_CHECKS_WHEELS the folder of wheels (default: wheels/ in the repository);
# GPU_CHECKS_PYTEST_ARGS adds options to the test steps.
#
# The wheels are what a GPU image with torch lacks: nvidia-cudnn-frontend (the cudnn-band route),
# fairseq-fixed and the four packages it imports (hydra-core, omegaconf, antlr4-python3-runtime,
# bitarray), all for CPython 3.12. `--prepare-wheels DIR` downloads them and makes fairseq's from
# the wheel scripts/setup_env.sh built (FAIRSEQ_WHEEL names another): its Python files, retagged
# py3-none-any, without its compiled modules, which neither the plugin nor the test and kernel
# steps import (fairseq's batching in the training-throughput step needs its Cython helpers).
set -u
usage() {
    echo "usage: bash benchmarks/gpu_checks.sh [--dry-run] OUT_DIR [SECONDS]" >&2
    echo "       bash benchmarks/gpu_checks.sh --prepare-wheels DIR" >&2
    exit 2
}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}

prepare_wheels() {  # prepare_wheels DIR: the wheels of the GPU machine's CPython 3.12
    local dir=$1 tmp wheel
    mkdir -p "$dir" || return 1
    local py312=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
                 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    # the frontend the cudnn-band route pins (setup.py's extra "cudnn")
    local frontend
    frontend=$(grep -o 'nvidia-cudnn-frontend==[0-9.]*' "$ROOT/setup.py" | head -n 1)
    "$PYTHON" -m pip download -q "${py312[@]}" -d "$dir" hydra-core==1.3.2 omegaconf==2.3.0 \
        bitarray==3.12.3 "${frontend:-nvidia-cudnn-frontend}" || return 1
    "$PYTHON" -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3 || return 1
    local cache=${LOCAL_ATTN_WHEEL_CACHE:-$HOME/.cache/local_attn_fairseq/wheels}
    wheel=${FAIRSEQ_WHEEL:-$(ls "$cache"/fairseq_fixed-0.12.3.1-*.whl 2>/dev/null | head -n 1)}
    if [ ! -f "$wheel" ]; then
        echo "gpu_checks: no fairseq-fixed wheel to repack (make setup; or FAIRSEQ_WHEEL)" >&2
        return 1
    fi
    tmp=$(mktemp -d) || return 1
    "$PYTHON" -m wheel unpack -d "$tmp" "$wheel" >/dev/null || return 1
    find "$tmp" -name '*.so' -delete  # built for the interpreter and torch of this machine
    "$PYTHON" -m wheel pack -d "$tmp" "$tmp"/fairseq_fixed-0.12.3.1 >/dev/null || return 1
    rm -f "$dir"/fairseq_fixed-*.whl
    "$PYTHON" -m wheel tags --remove --python-tag py3 --abi-tag none --platform-tag any \
        "$tmp"/fairseq_fixed-*.whl >/dev/null || return 1
    mv "$tmp"/fairseq_fixed-*-py3-none-any.whl "$dir"/ && rm -rf "$tmp"
    ls -l "$dir"
}

DRY_RUN=0
case "${1:-}" in
    --prepare-wheels)
        [ $# -eq 2 ] || usage
        prepare_wheels "$2"
        exit $?
        ;;
    --dry-run)
        DRY_RUN=1
        shift
        ;;
esac
[ $# -ge 1 ] || usage
OUT_DIR=$(realpath -m "$1")
LIMIT=${2:-540}
cd "$ROOT" || exit 1  # the tests and benchmarks by path
WHEELS=$(realpath -m "${GPU_CHECKS_WHEELS:-$ROOT/wheels}")
[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT_DIR" || exit 1
SUMMARY=$OUT_DIR/summary.txt
LOGS=$OUT_DIR/logs
START=$SECONDS

step() {  # step NAME LOG SHARE COMMAND...
    local name=$1 log=$LOGS/$2 share=$3
    shift 3
    if [ "$DRY_RUN" = 1 ]; then
        printf '%s (at most %s s): %s\n' "$name" "$share" "$*"
        return
    fi
    local left=$((LIMIT - (SECONDS - START)))
    local cap=$((share < left - 5 ? share : left - 5))
    if [ "$cap" -lt 20 ]; then
        echo "$name: skipped, $left s left" >>"$SUMMARY"
        return
    fi
    echo "=== $name: $*" >>"$log"
    local begin=$SECONDS
    timeout -k 5 "$cap" "$@" >>"$log" 2>&1
    echo "$name: exit $? after $((SECONDS - begin)) s (limit $cap s)" >>"$SUMMARY"
}

ROUTE_TESTS=(tests/ops/test_banded_tensor_core.py tests/ops/test_flash_window.py
             tests/ops/test_cudnn_band.py tests/ops/test_banded_attention.py
             tests/ops/test_blocked_sdpa.py tests/ops/test_dispatch.py
             tests/ops/test_route_table.py)
MODULE_TESTS=(tests/modules/test_mixed_precision.py tests/locality/test_dynamic_window.py
              tests/modules/test_localness_attention.py)
present() {  # the files of "$@" that exist; the others are named in the summary
    local f
    for f in "$@"; do
        if [ -f "$f" ]; then echo "$f"; else echo "tests: $f is missing" >>"$SUMMARY"; fi
    done
}

if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_checks, dry run: $OUT_DIR, $LIMIT s; $PYTHON; wheels from $WHEELS:"
    ls "$WHEELS"/*.whl 2>/dev/null | sed 's|.*/|  |' || echo "  (none)"
    for package in nvidia_cudnn_frontend fairseq_fixed hydra_core omegaconf \
        antlr4_python3_runtime bitarray; do
        ls "$WHEELS"/"$package"-*.whl >/dev/null 2>&1 || echo "  missing: $package"
    done
    SUMMARY=/dev/stderr
else
    CUDA_SEEN='import sys, torch; sys.exit(not torch.cuda.is_available())'
    if ! "$PYTHON" -c "$CUDA_SEEN" 2>/dev/null; then
        echo "gpu_checks: $PYTHON's torch sees no CUDA device: there is nothing to check here" \
            | tee -a "$SUMMARY" >&2
        exit 1
    fi
    mkdir -p "$LOGS" || exit 1
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks_site.XXXXXX") || exit 1
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$WHEELS"/*.whl >>"$LOGS/install.log" 2>&1
        echo "install: exit $? ($(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS)" >>"$SUMMARY"
    else
        echo "install: no wheels in $WHEELS" >>"$SUMMARY"
    fi
    export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

BUILT='import sys; import local_attn_fairseq._banded_C as m
sys.exit(not (m.built_with_cuda() and m.built_with_tensor_core()))'
if [ "$DRY_RUN" = 1 ] || ! "$PYTHON" -c "$BUILT" 2>/dev/null; then
    step build build.log 200 env CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
        MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PYTHON" setup.py build_ext --inplace
fi
if [ "$DRY_RUN" = 0 ]; then
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        "$PYTHON" -c 'import torch; from local_attn_fairseq.ops import extension_info as e
from local_attn_fairseq.ops.route_table import LIBRARY_ROUTES, library_reasons as r
print("torch", torch.__version__, torch.cuda.get_device_name(), e())
print({route: r(route) or "available" for route in LIBRARY_ROUTES})
import cudnn; print("cudnn frontend", cudnn.__version__, "backend", cudnn.backend_version())'
    } >>"$SUMMARY" 2>&1
    if ! "$PYTHON" -c 'import local_attn_fairseq.ops' 2>/dev/null; then
        echo "gpu_checks: the plugin cannot be imported (see above): nothing more can run" \
            | tee -a "$SUMMARY" >&2
        tar czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs && rm -rf "$LOGS"
        exit 1
    fi
fi

PYTEST=("$PYTHON" -m pytest -q -n "${GPU_CHECKS_WORKERS:-16}" -p no:cacheprovider -rfEs)
mapfile -t route_tests < <(present "${ROUTE_TESTS[@]}")
step route_tests route_tests.log 150 "${PYTEST[@]}" "${route_tests[@]}" \
    ${GPU_CHECKS_PYTEST_ARGS:-}

GRID=$OUT_DIR/kernel_grid_bf16_d64
step kernel_grid kernel_grid.log 420 "$PYTHON" benchmarks/banded_attention.py --device cuda \
    --repeats 10 --batch 8 --heads 8 --dim 64 --dtype bfloat16 --backward \
    --lengths 1024 2048 4096 8192 16384 --widths 33 129 257 513 1025 \
    --json "$GRID.json" --output "$GRID.md"
step verdicts verdicts.log 25 "$PYTHON" benchmarks/measured_routes.py --show "$GRID.json"
if [ "$DRY_RUN" = 0 ] && [ -f "$LOGS/verdicts.log" ]; then
    grep -v '^===' "$LOGS/verdicts.log" | grep -v '^INFO' >>"$SUMMARY"
fi

mapfile -t module_tests < <(present "${MODULE_TESTS[@]}")
step module_tests module_tests.log 100 "${PYTEST[@]}" "${module_tests[@]}" \
    -k "cuda or tensor_core or gpu" ${GPU_CHECKS_PYTEST_ARGS:-}
step host_overhead host_overhead.log 40 "$PYTHON" benchmarks/host_overhead.py --device cuda \
    --rounds 5 --calls 100 --output "$LOGS/host_overhead_cuda.md"
for batch in 8 32; do
    step "speech_b$batch" speech.log 30 "$PYTHON" benchmarks/speech_encoder.py --device cuda \
        --dtype bfloat16 --batch "$batch" --seconds 10 30 60 --rounds 3 \
        --output "$LOGS/speech_b$batch.md"
done
for tokens in 8192 32768; do
    step "throughput_$tokens" throughput.log 80 "$PYTHON" benchmarks/training_throughput.py \
        --device cuda --fp16 --base-sizes --max-tokens "$tokens" --mechanisms all --rounds 3 \
        --batches 5
done
if [ "$DRY_RUN" = 0 ]; then
    grep -h -E '(passed|failed)|^(FAILED|ERROR) ' "$LOGS"/*tests.log >>"$SUMMARY" 2>/dev/null
    tar czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs && rm -rf "$LOGS"
    echo "done after $((SECONDS - START)) s" >>"$SUMMARY"
    cat "$SUMMARY"
fi
