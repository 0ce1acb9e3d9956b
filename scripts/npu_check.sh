#!/usr/bin/env bash
# Verify the Ascend NPU backend on a machine with an NPU and CANN (A2/A3, CANN >= 8.5 for batch).
# The NPU path was developed against torch-npu's ACL headers and an ACL emulation only;
# this script is what proves it on hardware: H2D/D2H round trips, the device->device (D2D)
# gather/scatter of staged copies (tests/native/test_npu_device.py::test_staged_d2d_gather_scatter),
# exact pinning and the Ascend K/V layouts. Usage (from the repo root, CANN env sourced):
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh   # or your CANN's set_env.sh
#   bash scripts/npu_check.sh [python]
set -euo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -c "import torch, torch_npu; assert torch.npu.is_available(), 'no NPU visible'; print('torch', torch.__version__, 'torch_npu', torch_npu.__version__, 'devices', torch.npu.device_count())"

status=0
for toggle in 1 0; do
  echo "=== VLLM_ASCEND_ENABLE_BATCH_MEMCPY=$toggle ==="
  mkdir -p "$OUT/$toggle"
  VLLM_ASCEND_ENABLE_BATCH_MEMCPY=$toggle "$PY" csrc_npu/build.py --out "$OUT/$toggle"
  export NPU_OFFLOAD_NATIVE_DIR="$OUT/$toggle"
  "$PY" -m vllm_npu_offload info
  "$PY" -m pytest -q -rs -m npu tests || status=1   # -rs: a skipped check (e.g. batch) says why
  if [ -f scripts/bench_transfer.py ]; then
    "$PY" scripts/bench_transfer.py --device npu || status=1
  else
    echo "(scripts/bench_transfer.py not present: benchmark skipped)"
  fi
done
unset NPU_OFFLOAD_NATIVE_DIR
echo "=== CPU test suite (emulation) ==="
"$PY" -m pytest -q tests -k "npu or layout" -m "not npu" || status=1
[ $status -eq 0 ] && echo "npu_check: ALL PASSED" || echo "npu_check: FAILURES above"
exit $status
