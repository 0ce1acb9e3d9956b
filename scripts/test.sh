#!/usr/bin/env bash
# The test command (README, .ci/run). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup_env.sh)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
# ACL headers from the torch-npu wheel, so csrc_npu is compiled and emulated in CI (no CANN here).
if [ -z "${NPU_OFFLOAD_ACL_INCLUDE:-}" ]; then
  NPU_OFFLOAD_ACL_INCLUDE=$(python3 csrc_npu/fetch_headers.py 2>/dev/null) && export NPU_OFFLOAD_ACL_INCLUDE \
    || echo "[test] could not fetch torch-npu headers; NPU build tests will skip" >&2
fi
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
# The vLLM 0.21-0.25 API generation (what released vLLM-Ascend 0.23 pairs with), against
# vLLM 0.23.0's real Python code in its own venv. NPU_OFFLOAD_SKIP_V023=1 skips it.
if [ "${NPU_OFFLOAD_SKIP_V023:-0}" != "1" ]; then
  PY023=$(bash scripts/setup_v023.sh)
  "$PY023" -m pytest -q -p no:cacheprovider tests/v023
fi
