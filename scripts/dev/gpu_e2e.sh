#!/usr/bin/env bash
# Real vLLM 0.23.0 on a GPU machine, in vLLM's default mode (torch.compile + CUDA graphs): smoke,
# correctness, reload TTFT, miss cost and serving with vLLM's own multi-turn client, per KV layout,
# offload off / vLLM's native CPU offload / ours. docs/gpu_e2e.md has the exact device calls.
#
# Here (registry access):  bash scripts/dev/gpu_e2e.sh prepare      -> parts + code copy under $GPU_E2E_DIR
#                          (LMCache's wheels from .cache/lmcache too: benchmarks/gpu_e2e/lmcache_wheels.txt)
# On the GPU machine:      bash .gpu/e2e_src/scripts/dev/gpu_e2e.sh stage .gpu/part1
#                          bash .gpu/e2e_src/scripts/dev/gpu_e2e.sh stage .gpu/part2 && ... install
#                          bash .gpu/e2e_src/scripts/dev/gpu_e2e.sh run smoke --layouts all   (then `prepare`'s list)
set -u -o pipefail
CALLER=$PWD  # part folders are given relative to where the call was made
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
GPU_E2E_DIR=${GPU_E2E_DIR:-/work/main/.gpu}
SITE=${GPU_E2E_SITE:-/tmp/site}
NATIVE=${GPU_E2E_NATIVE:-/tmp/gpu_e2e/native}
LMCACHE_SITE=/tmp/site_lmcache  # = benchmarks/gpu_e2e/stage.py LMCACHE_SITE (only LMCache engines/servers use it)
MOONCAKE_SITE=${GPU_E2E_MOONCAKE_SITE:-/tmp/site_mooncake}  # = benchmarks/gpu_e2e/mooncake_stage.py MOONCAKE_SITE
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cmd=${1:-help}; shift || true

case "$cmd" in
  prepare)
    # vLLM 0.23.0's sdist: a copy setup_v023.sh downloaded, if there (prepare checks its sha256)
    sd=()
    for c in "${V023_DL:-$ROOT/.cache/v023}/vllm-0.23.0.tar.gz"; do
      [ -f "$c" ] && sd+=(--sdist "$c")
    done
    "$PY" -m benchmarks.gpu_e2e.stage prepare --out "$GPU_E2E_DIR" "${sd[@]}" "$@" || exit $?
    # the code the device runs: the package, benchmarks/, the CUDA library sources with the headers
    # they share with csrc_npu (csrc_common/), this script, and vLLM's multi-turn client (taken out
    # of the sdist by prepare; run there, not committed here)
    rm -rf "$GPU_E2E_DIR/e2e_src" && mkdir -p "$GPU_E2E_DIR/e2e_src/scripts/dev"
    cp -r vllm_npu_offload benchmarks csrc_cuda csrc_common "$GPU_E2E_DIR/e2e_src/" && cp scripts/dev/gpu_e2e.sh "$GPU_E2E_DIR/e2e_src/scripts/dev/"
    cp -r "$GPU_E2E_DIR/vllm_multi_turn" "$GPU_E2E_DIR/e2e_src/vllm_multi_turn"
    find "$GPU_E2E_DIR/e2e_src" \( -name __pycache__ -o -name '*.so' \) -prune -exec rm -rf {} +
    rm -rf "$GPU_E2E_DIR/lmcache"  # LMCache's wheels travel in the parts (stage.py), not in a folder of their own
    echo "code copy: $GPU_E2E_DIR/e2e_src ($(du -sh "$GPU_E2E_DIR/e2e_src" | cut -f1))"
    # what one stage call carries: the checkout's tree (tracked + untracked-not-ignored) + a part + e2e_src
    tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null \
            | awk '$2=="total"{s+=$1} END{print s+0}')
    src=$(du -sb "$GPU_E2E_DIR/e2e_src" | cut -f1)
    over=0
    for d in "$GPU_E2E_DIR"/part*; do
      n=$(( $(du -sb "$d" | cut -f1) + src + tree ))
      flag=""; [ "$n" -gt 67108864 ] && { flag="  OVER the 64 MiB a call carries: prepare --part-bytes SMALLER"; over=1; }
      echo "$(basename "$d") call: $((n / 1000000)) MB (part + code copy + this checkout's tree $((tree / 1000000)) MB)$flag"
    done
    rel=$(basename "$GPU_E2E_DIR")
    n=$(ls -d "$GPU_E2E_DIR"/part* | wc -l)
    echo
    echo "Device calls (kind nvidia-h200), back to back; paths relative to the checkout that holds $rel/:"
    "$PY" -m benchmarks.gpu_e2e.plan --parts "$n" --rel "$rel"
    # a stage call over the limit fails on the device after the machine's start: stop here instead
    [ "$over" = 0 ] || { echo "prepare: a stage call is over 64 MiB (see above); re-run with --part-bytes SMALLER" >&2; exit 4; }
    ;;
  stage)
    p=${1:?stage needs a part folder}; case "$p" in /*) ;; *) p="$CALLER/$p" ;; esac
    "$PY" -m benchmarks.gpu_e2e.stage stage "$p"
    ;;
  install)
    t=$(date +%s)
    "$PY" -m benchmarks.gpu_e2e.stage install || exit $?
    # LMCache, when staged: its compiled extension and vLLM adapter must load against this torch and vLLM
    if [ -f "$LMCACHE_SITE/.gpu_e2e_ready" ]; then
      LMCACHE_TRACK_USAGE=false PYTHONPATH="$ROOT:$SITE:$LMCACHE_SITE" timeout 240 "$PY" -c "from importlib.metadata import version
import lmcache.c_ops
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
print('[install] LMCache', version('lmcache'), 'imports (c_ops, vllm_v1_adapter) beside vLLM', version('vllm'))" 2>&1 | tail -4 \
        || echo "warning: LMCache does not import (above): lmcache servers will fail"
    fi
    # Mooncake, when staged: the store extension must import and the master start with the libraries given
    if [ -f "$MOONCAKE_SITE/.gpu_e2e_ready" ]; then
      PYTHONPATH="$ROOT:$SITE:$MOONCAKE_SITE" LD_LIBRARY_PATH="$MOONCAKE_SITE/syslib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        timeout 120 "$PY" -c "from mooncake.store import MooncakeDistributedStore
print('[install] Mooncake store imports:', MooncakeDistributedStore.__name__)" 2>&1 | tail -3 \
        || echo "warning: mooncake.store does not import (above): no pair part"
    fi
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
    sed -n 2,10p "$0"; exit 2 ;;
esac
