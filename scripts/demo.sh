#!/usr/bin/env bash
# The main job: a multi-turn chat served from host KV through NPUOffloadingSpec, checked
# against an offload-off run. Extra arguments go to `python -m vllm_npu_offload.demo`
# (--help lists them; --verbose shows vLLM's logs and the native build's report).
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in *" --verbose "*) ;; *) export NPU_OFFLOAD_QUIET_BUILD=1 ;; esac
PY=$(bash scripts/setup_env.sh)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m vllm_npu_offload.demo "$@"
