#!/bin/bash
# The GPU checks of the banded operator in one run: the CUDA tests, then the per-call host cost,
# the kernel (its records as JSON too), speech encoder (batch 8 and 32) and training-throughput
# (8,192 and 32,768 tokens a batch) benchmarks, each log and table written under OUT_DIR.
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS]
#
# SECONDS (default 600) bounds the whole run: each step gets at most its own share and what is
# left, a step that would get under 20 s is skipped, and OUT_DIR/summary.txt says what ran and
# how it ended. Run it where `python` has torch with CUDA, fairseq and this package (built with
# its CUDA kernels); docs/banded_attention_gpu.md holds the results of one such run.
# PYTHON names another interpreter; GPU_CHECKS_PYTEST_ARGS adds options to the test step (a
# --deselect, say, where fairseq's console scripts or the Ding data are missing).
set -u
if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/gpu_checks.sh OUT_DIR [SECONDS]" >&2
    exit 2
fi
OUT_DIR=$(realpath -m "$1")
LIMIT=${2:-600}
cd "$(dirname "$0")/.." || exit 1  # the repository's root: the tests and benchmarks by path
PYTHON=${PYTHON:-python}
mkdir -p "$OUT_DIR" || exit 1
SUMMARY=$OUT_DIR/summary.txt
START=$SECONDS

step() {  # step NAME LOG SHARE COMMAND...
    local name=$1 log=$OUT_DIR/$2 share=$3
    shift 3
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

if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "gpu_checks: $PYTHON's torch sees no CUDA device: there is nothing to check here" \
        | tee -a "$SUMMARY" >&2
    exit 1
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PYTHON" -c 'import torch; from local_attn_fairseq.ops import extension_info as e
print("torch", torch.__version__, torch.cuda.get_device_name(), e())'
} >>"$SUMMARY" 2>&1

KERNEL=("$PYTHON" benchmarks/banded_attention.py --device cuda --repeats 10 --batch 8 --heads 8)
step tests tests.log 100 "$PYTHON" -m pytest -q -n 16 -rfEs \
    tests/ops/test_banded_tensor_core.py tests/ops/test_banded_attention.py \
    tests/ops/test_blocked_sdpa.py tests/ops/test_dispatch.py \
    tests/modules/test_mixed_precision.py tests/locality/test_dynamic_window.py \
    tests/modules/test_localness_attention.py \
    -k "cuda or tensor_core or gpu" ${GPU_CHECKS_PYTEST_ARGS:-}
step host_overhead host_overhead.log 40 "$PYTHON" benchmarks/host_overhead.py --device cuda \
    --rounds 5 --calls 100 --output "$OUT_DIR/host_overhead_cuda.md"
step kernel_bf16 kernel.log 70 "${KERNEL[@]}" --dtype bfloat16 --dim 64 --backward \
    --lengths 4096 16384 1024 --widths 33 257 --output "$OUT_DIR/kernel_bf16.md" \
    --json "$OUT_DIR/kernel_bf16.json"
for batch in 8 32; do
    step "speech_b$batch" speech.log 30 "$PYTHON" benchmarks/speech_encoder.py --device cuda \
        --dtype bfloat16 --batch "$batch" --seconds 10 30 60 --rounds 3 \
        --output "$OUT_DIR/speech_b$batch.md"
done
for tokens in 8192 32768; do
    step "throughput_$tokens" throughput.log 80 "$PYTHON" benchmarks/training_throughput.py \
        --device cuda --fp16 --base-sizes --max-tokens "$tokens" --mechanisms all --rounds 3 \
        --batches 5
done
# The Gaussian layers' bias as scaled_dot_product_attention's mask (LOCAL_ATTN_MECHANISM_IMPL=
# sdpa), against the explicit route that `auto` takes in the runs above.
for tokens in 8192 32768; do
    step "throughput_localness_sdpa_$tokens" throughput.log 50 \
        env LOCAL_ATTN_MECHANISM_IMPL=sdpa "$PYTHON" benchmarks/training_throughput.py \
        --device cuda --fp16 --base-sizes --max-tokens "$tokens" --mechanisms localness \
        --rounds 3 --batches 5
done
cat "$SUMMARY"
