#!/usr/bin/env bash
# A/B of the native library: an older csrc_cuda (OLD_SRC) against the working tree's, on a lent GPU.
#   here:   mkdir -p .gpu/ab_old && git archive REV csrc_cuda | tar -x -C .gpu/ab_old
#           (a REV that has csrc_common/, the headers csrc_cuda includes from beside it: archive both)
#   device: carry [".gpu/ab_old"], command: bash scripts/dev/ab_core.sh   (OLD_SRC=.gpu/ab_old/csrc_cuda)
# Builds both, runs the GPU tests, then bench_core.py for each library in the order old, new, old,
# new, the staged timeline probe, and prints the staged device % side by side; everything else
# lands in $OUT/ab.tgz.
set -u -o pipefail
T0=$(date +%s)
OUT=${OUT:-./ab_out}; W=/tmp/ab; mkdir -p "$OUT" $W
export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
python3 csrc_cuda/build.py --out vllm_npu_offload/_native > $W/build_new.log 2>&1 || { tail $W/build_new.log; exit 1; }
python3 "${OLD_SRC:-.gpu/ab_old/csrc_cuda}/build.py" --out /tmp/oldlib > $W/build_old.log 2>&1 || { tail $W/build_old.log; exit 1; }
echo "[build] $(( $(date +%s) - T0 ))s"
NPU_OFFLOAD_REQUIRE_NATIVE=1 NPU_OFFLOAD_CACHE_DIR=$W/cal_tests timeout 240 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider 2>&1 | tail -3
echo "[tests] $(( $(date +%s) - T0 ))s"
S=${SHAPES:-tiny-1k,qwen2.5-0.5b-fp8,qwen2.5-0.5b,llama-8b}
for r in 1 2; do
  for lib in old new; do
    [ $r = 2 ] && [ $lib = old ] && continue
    dir=$([ $lib = old ] && echo /tmp/oldlib || echo $PWD/vllm_npu_offload/_native)
    NPU_OFFLOAD_NATIVE_DIR=$dir NPU_OFFLOAD_CACHE_DIR=$W/cal_$lib timeout 150 python3 scripts/bench_core.py --reps 10 \
      --shapes $S --json $W/core_${lib}$r.json > $W/core_${lib}$r.txt 2>&1
    echo "[core $lib$r] rc=$? $(( $(date +%s) - T0 ))s"
  done
  [ $r = 1 ] && { NPU_OFFLOAD_NATIVE_DIR=/tmp/oldlib NPU_OFFLOAD_CACHE_DIR=$W/cal_old timeout 150 python3 scripts/bench_core.py \
      --reps 10 --shapes $S --json $W/core_old2.json > $W/core_old2.txt 2>&1; echo "[core old2] rc=$? $(( $(date +%s) - T0 ))s"; }
done
timeout 90 python3 scripts/dev/probe_staged_timeline.py --reps 5 --json $W/timeline_new.json > $W/timeline_new.txt 2>&1
grep -A12 "qwen2.5-0.5b-fp8" $W/timeline_new.txt | head -26
python3 - $W <<'PY'
import json, sys, glob, os
W = sys.argv[1]
runs = {os.path.basename(f)[5:-5]: json.load(open(f)) for f in sorted(glob.glob(f"{W}/core_*.json"))}
keys = sorted(runs)
print("staged gpu % / exec % of the contiguous copy:", " | ".join(keys))
rows = {}
for k in keys:
    for s in runs[k]["shapes"]:
        for r in s["rows"]:
            rows.setdefault((s["shape"]["name"], r["dir"], r["host"]), {})[k] = (r["staged_gpu_pct"], r["staged_exec_pct"])
for (name, d, h), v in rows.items():
    print(f"{name:18s} {d} {h:6s} " + "  ".join(f"{v[k][0]:5.1f}/{v[k][1]:5.1f}" if k in v else "   -   " for k in keys))
PY
tar czf $OUT/ab.tgz -C $W . && echo "[done] $(( $(date +%s) - T0 ))s"
