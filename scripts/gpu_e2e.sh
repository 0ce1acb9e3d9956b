#!/usr/bin/env bash
# Real vLLM 0.23.0 on a lent GPU: correctness, reload TTFT, miss cost, multi-turn serving,
# offload off / vLLM's native CPU offload / ours. docs/gpu_e2e.md has the exact device calls.
#
# Here (registry access):  bash scripts/gpu_e2e.sh prepare      -> parts + code copy under $GPU_E2E_DIR
# On the GPU machine:      bash .gpu/e2e_src/scripts/gpu_e2e.sh stage .gpu/part1
#                          bash .gpu/e2e_src/scripts/gpu_e2e.sh stage .gpu/part2 && ... install
#                          bash .gpu/e2e_src/scripts/gpu_e2e.sh run correctness ttft miss multiturn
set -u -o pipefail
CALLER=$PWD  # part folders are given relative to where the call was made
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
GPU_E2E_DIR=${GPU_E2E_DIR:-/work/main/.gpu}
SITE=${GPU_E2E_SITE:-/tmp/site}
NATIVE=${GPU_E2E_NATIVE:-/tmp/gpu_e2e/native}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cmd=${1:-help}; shift || true

case "$cmd" in
  prepare)
    "$PY" -m benchmarks.gpu_e2e.stage prepare --out "$GPU_E2E_DIR" "$@" || exit $?
    # the code the device runs: the package, benchmarks/, the CUDA library sources and this script
    rm -rf "$GPU_E2E_DIR/e2e_src" && mkdir -p "$GPU_E2E_DIR/e2e_src/scripts"
    cp -r vllm_npu_offload benchmarks csrc_cuda "$GPU_E2E_DIR/e2e_src/" && cp scripts/gpu_e2e.sh "$GPU_E2E_DIR/e2e_src/scripts/"
    find "$GPU_E2E_DIR/e2e_src" \( -name __pycache__ -o -name '*.so' \) -prune -exec rm -rf {} +
    echo "code copy: $GPU_E2E_DIR/e2e_src ($(du -sh "$GPU_E2E_DIR/e2e_src" | cut -f1))"
    rel=$(basename "$GPU_E2E_DIR")
    n=$(ls -d "$GPU_E2E_DIR"/part* | wc -l)
    echo
    echo "Device calls (kind nvidia-h200), back to back; paths relative to the checkout that holds $rel/:"
    for i in $(seq 1 "$n"); do
      c="bash $rel/e2e_src/scripts/gpu_e2e.sh stage $rel/part$i"
      [ "$i" = "$n" ] && c="$c && bash $rel/e2e_src/scripts/gpu_e2e.sh install && bash $rel/e2e_src/scripts/gpu_e2e.sh run correctness"
      echo "  call $i: carry [$rel/part$i, $rel/e2e_src]  command: $c"
    done
    echo "  call $((n+1)): carry [$rel/e2e_src]  command: bash $rel/e2e_src/scripts/gpu_e2e.sh run ttft miss"
    echo "  call $((n+2)): carry [$rel/e2e_src]  command: bash $rel/e2e_src/scripts/gpu_e2e.sh run multiturn"
    ;;
  stage)
    p=${1:?stage needs a part folder}; case "$p" in /*) ;; *) p="$CALLER/$p" ;; esac
    "$PY" -m benchmarks.gpu_e2e.stage stage "$p"
    ;;
  install)
    t=$(date +%s)
    "$PY" -m benchmarks.gpu_e2e.stage install || exit $?
    # our CUDA copy library (cuMemcpyBatchAsync): built here, outside the carried tree
    "$PY" csrc_cuda/build.py --out "$NATIVE" >/tmp/gpu_e2e/native_build.log 2>&1 \
      || { echo "warning: native CUDA library not built (tail below); copies use the Triton/host paths"; tail -5 /tmp/gpu_e2e/native_build.log; }
    echo "[install] done in $(( $(date +%s) - t ))s"
    ;;
  check)
    "$PY" -m benchmarks.gpu_e2e.stage check
    ;;
  run)
    "$PY" -m benchmarks.gpu_e2e.stage check || exit 3
    export PYTHONPATH="$ROOT:$SITE" NPU_OFFLOAD_NATIVE_DIR="$NATIVE" PYTHONUNBUFFERED=1
    export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export OUT=${OUT:-$ROOT/gpu_e2e_out}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu] /'
    lscpu 2>/dev/null | grep -E '^(CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|Model name)' | sed 's/^/[cpu] /'
    "$PY" -m benchmarks.gpu_e2e.device "$@" --out "$OUT" 2>&1 | tee "$OUT/gpu_e2e.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    sed -n 2,9p "$0"; exit 2 ;;
esac
