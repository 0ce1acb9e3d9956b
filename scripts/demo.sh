#!/usr/bin/env bash
# The main job: a multi-turn chat served from host KV through NPUOffloadingSpec, checked
# against an offload-off run. Extra arguments go to `python -m vllm_npu_offload.demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m vllm_npu_offload.demo "$@"
