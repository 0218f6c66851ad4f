#!/usr/bin/env bash
# Set up everything local_attn_fairseq needs, on a fresh Debian machine or an existing one:
# Debian packages, a virtual environment with the pinned stack, and the plugin itself.
# Quick when already done: it only redoes what is missing or out of date.
#
#   LOCAL_ATTN_VENV           virtual environment to use (default: .venv in the repo root)
#   LOCAL_ATTN_WHEEL_CACHE    where the fairseq wheel built here is kept for later set-ups
#                             (default: ~/.cache/local_attn_fairseq/wheels)
#   LOCAL_ATTN_NO_EXTENSION=1 do not build the banded attention kernels (csrc/): the operator
#                             then runs its pure-PyTorch implementation
#   LOCAL_ATTN_NO_CUDA=1      build only the CPU kernels even where nvcc is found
#   LOCAL_ATTN_CUDA_ARCH_LIST CUDA archs to build for (default: the GPU's, or 8.0;9.0 without one)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${LOCAL_ATTN_VENV:-$ROOT/.venv}
WHEEL_CACHE=${LOCAL_ATTN_WHEEL_CACHE:-$HOME/.cache/local_attn_fairseq/wheels}
PYTHON=${PYTHON:-python3}
APT_PACKAGES=(trans-de-en espeak-ng diatheke sword-text-web sword-text-sparv libtcmalloc-minimal4)
FAIRSEQ=fairseq-fixed==0.12.3.1

log() { echo "[setup] $*"; }

# 1. Debian packages (the demos' corpora: the Ding dictionary, the SWORD Bibles and their reader;
#    tcmalloc, under which the long-context benchmark runs).
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The virtual environment, redone when constraints.txt, setup.py, the kernels or the
#    build switches change.
stamp="$VENV/.local_attn_fairseq.stamp"
build_switches="${LOCAL_ATTN_NO_EXTENSION:-}/${LOCAL_ATTN_NO_CUDA:-}/${LOCAL_ATTN_CUDA_ARCH_LIST:-}"
want=$( (cat "$ROOT/constraints.txt" "$ROOT/requirements.txt" "$ROOT/setup.py" "$ROOT"/csrc/*; \
  echo "$build_switches") | sha256sum | cut -c1-16)
plugin_modules="local_attn_fairseq"
[ "${LOCAL_ATTN_NO_EXTENSION:-}" = 1 ] || plugin_modules="$plugin_modules, local_attn_fairseq._banded_C"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && "$VENV/bin/python" -c "import $plugin_modules" 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q -c "$ROOT/constraints.txt")

log "installing torch, torchaudio and fairseq's build requirements"
"${PIP[@]}" torch torchaudio numpy cython setuptools wheel

# 3. fairseq: its sdist has C++ extensions that must be built against the pinned torch;
#    the wheel is cached so that later set-ups skip the three-minute build.
wheel=$(ls "$WHEEL_CACHE"/fairseq_fixed-0.12.3.1-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  log "building $FAIRSEQ against the pinned torch (about 3 minutes, once)"
  mkdir -p "$WHEEL_CACHE"
  # With CUDA_HOME set the build looks for CUDA sources the sdist does not ship.
  env -u CUDA_HOME "$VENV/bin/python" -m pip wheel --disable-pip-version-check -q \
    --no-build-isolation --no-deps -c "$ROOT/constraints.txt" -w "$WHEEL_CACHE" "$FAIRSEQ"
  wheel=$(ls "$WHEEL_CACHE"/fairseq_fixed-0.12.3.1-*.whl | head -n 1)
fi
log "installing the pinned stack and the plugin"
"${PIP[@]}" "$wheel" -r "$ROOT/requirements.txt"
# The editable install builds the banded attention kernels (csrc/) into the package: the CPU
# ones always, the CUDA ones where nvcc is found (a few minutes; see setup.py). Only this step
# sees CUDA_HOME: the fairseq build above must not.
plugin_env=(MAX_JOBS="${MAX_JOBS:-2}")
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  plugin_env+=(CUDA_HOME=/usr/local/cuda)
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then
  plugin_env+=(TORCH_CUDA_ARCH_LIST="${LOCAL_ATTN_CUDA_ARCH_LIST:-8.0;9.0}")
fi
log "building the plugin and its banded attention kernels"
env "${plugin_env[@]}" "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
if nvidia-smi -L >/dev/null 2>&1; then  # a GPU: cuDNN's banded attention (the cudnn extra)
  log "installing nvidia-cudnn-frontend for the cudnn-band route"
  "${PIP[@]}" nvidia-cudnn-frontend==1.23.0
fi
"$VENV/bin/python" - "$plugin_modules" <<'PY'
import importlib
import sys
for name in ["fairseq.libbleu", "fairseq.data.data_utils_fast", "fairseq.data.token_block_utils_fast",
             "fairseq.libbase", "fairseq.libnat", "alignment_train_cpu_binding",
             "sacremoses",  # the recipes' tokenised BLEU needs Moses' tokeniser
             *sys.argv[1].split(", ")]:
    importlib.import_module(name)
PY
echo "$want" > "$stamp"
log "ready: $VENV"
