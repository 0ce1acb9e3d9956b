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
# Other vLLM releases' real Python code, each in its own venv: one release per branch of the
# version shim (docs/support.md, "What CI runs"). NPU_OFFLOAD_SKIP_MATRIX=1 skips it.
if [ "${NPU_OFFLOAD_SKIP_MATRIX:-${NPU_OFFLOAD_SKIP_V023:-0}}" != "1" ]; then
  bash scripts/dev/version_matrix.sh --ci
fi
