#!/usr/bin/env bash
# Verify the Ascend NPU backend on a machine with an NPU and CANN (A2/A3, CANN >= 8.5 for batch).
# The NPU path was developed against torch-npu's ACL headers and an ACL emulation only;
# this script is what proves it on hardware: H2D/D2H round trips, the device->device (D2D)
# gather/scatter of staged copies (tests/native/test_npu_device.py::test_staged_d2d_gather_scatter),
# exact pinning, the Ascend K/V layouts, the staged pipeline (one native call per transfer) and its
# speed through the worker core (scripts/bench_core.py, JSON kept in npu_check_results/). Usage (from the repo root, CANN env sourced):
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh   # or your CANN's set_env.sh
#   bash scripts/npu_check.sh [python]
# BENCH_SHAPES (comma list of benchmarks/core_bench.py shapes) and BENCH_REPS tune the benchmark.
set -euo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
BENCH_SHAPES=${BENCH_SHAPES:-llama-8b,qwen2.5-0.5b,mla-ascend-split}
BENCH_REPS=${BENCH_REPS:-20}
RESULTS="$PWD/npu_check_results"
mkdir -p "$RESULTS"
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
  # Staged transfers, each planned and enqueued by one native call (staged GB/s, and "cpu N us": the
  # engine thread's enqueue time per transfer).
  echo "--- staged pipeline (VLLM_ASCEND_ENABLE_BATCH_MEMCPY=$toggle) ---"
  "$PY" scripts/bench_core.py --device npu --shapes "$BENCH_SHAPES" \
    --reps "$BENCH_REPS" --json "$RESULTS/bench_core_batch${toggle}.json" || status=1
done
unset NPU_OFFLOAD_NATIVE_DIR
echo "=== CPU test suite (emulation) ==="
"$PY" -m pytest -q tests -k "npu or layout" -m "not npu" || status=1
[ $status -eq 0 ] && echo "npu_check: ALL PASSED" || echo "npu_check: FAILURES above"
exit $status
