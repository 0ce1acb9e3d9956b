#!/usr/bin/env bash
# One command for the GPU machine, from the repo root:  bash scripts/dev/gpu_check.sh
# Builds libnpu_offload_cuda.so in place, runs the gpu tests, then the transfer
# benchmarks: whole transfers through the worker core (direct vs staged, + GEMM
# interference), then the per-path tables (+ interference, block sweep, SM grid on request). Logs and JSON go
# to $OUT (default ./gpu_out). Each step has its own time limit; ~5-8 min on an H100.
# STEPS="build tests" runs only those steps.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NPU_OFFLOAD_CACHE_DIR="$OUT/calibration"   # calibration cache lands with the results
export NPU_OFFLOAD_REQUIRE_NATIVE=1               # tests fail (not skip) if the library is missing
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
declare -a SUMMARY=()
T0=$(date +%s)

STEPS=${STEPS:-env build tests core core_triton core_pyloop core_interference bench interference}  # a subset re-runs parts
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t=$(date +%s)
  echo; echo "=================== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$(printf '%-14s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - t ))")")
  return 0
}

step env 60 bash -c "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; $PY -c 'import triton; print(\"triton\", triton.__version__)'; nvcc --version | tail -2; ${CXX:-c++} --version | head -1"
step build 120 bash -c "$PY csrc_cuda/build.py --out vllm_npu_offload/_native && NPU_OFFLOAD_CUDA_BATCH_MEMCPY=0 $PY csrc_cuda/build.py --out $OUT/loop_build && $PY -c 'from vllm_npu_offload._native.cuda import load_library; print(load_library().describe())'"
if $PY -c 'import pytest' 2>/dev/null; then
  step tests 300 $PY -m pytest -m gpu tests/ -v -rs -p no:cacheprovider --continue-on-collection-errors
else
  echo "pytest not installed: running tests/native/test_cuda_gpu.py directly"
  step tests 300 $PY tests/native/test_cuda_gpu.py
fi
step core 240 $PY scripts/bench_core.py --reps 10 --json "$OUT/core.json"
step core_triton 120 env NPU_OFFLOAD_STAGE_GATHER=triton $PY scripts/bench_core.py --reps 10 \
  --shapes tiny-1k,qwen2.5-0.5b-fp8,llama-70b-tp8,llama-8b,mla-ascend-split --json "$OUT/core_triton.json"
step core_pyloop 120 env NPU_OFFLOAD_STAGE_PIPELINE=python $PY scripts/bench_core.py --reps 10 \
  --shapes tiny-1k,qwen2.5-0.5b-fp8,llama-70b-tp8,llama-8b,mla-ascend-split --json "$OUT/core_pyloop.json"
step slices 240 $PY scripts/dev/bench_slices.py --json "$OUT/slices.json"
step probe 120 $PY scripts/dev/probe_link_ops.py --reps 30 --json "$OUT/probe.json"
step stall 300 bash -c "$PY scripts/dev/probe_stall.py --json $OUT/stall_store.json && \
  $PY scripts/dev/probe_stall.py --direction H2D --json $OUT/stall_load.json"
step core_interference 120 $PY scripts/bench_core.py --shapes "" --interference llama-8b,qwen2.5-0.5b,mla-ascend-split \
  --json "$OUT/core_interference.json"
step bench 200 $PY scripts/bench_transfer.py --reps 20 --json "$OUT/bench.json"
step interference 90 $PY scripts/bench_transfer.py --no-table --configs llama-8b,qwen2.5-0.5b,llama-70b-tp4 \
  --interference --json "$OUT/interference.json"
step sweep 90 $PY scripts/bench_transfer.py --configs "" --sweep 1,4,16,64,256 \
  --sweep-configs llama-8b,qwen2.5-0.5b,llama-70b-tp4 --reps 10 --json "$OUT/sweep.json"
step sm_variants 120 $PY scripts/bench_transfer.py --no-table --configs qwen2.5-0.5b,llama-8b --sm-variants \
  --json "$OUT/sm_variants.json"

echo; echo "=================== summary ($(( $(date +%s) - T0 ))s total; logs and JSON in $OUT)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
grep -hE "^(PASSED|FAILED|SKIPPED)|passed|failed" "$OUT/tests.log" | tail -3
