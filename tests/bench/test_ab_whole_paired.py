"""scripts/dev/ab_whole_paired.py: two package trees' worker cores in one process, a transfer of
each per rep; the per-rep differences and their intervals are what it reports."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "dev" / "ab_whole_paired.py"
_spec = importlib.util.spec_from_file_location("ab_whole_paired", SCRIPT)
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)


def test_rows_are_per_rep_differences_with_the_medians_interval():
    base = [1e-3 + i * 1e-6 for i in range(40)]  # a drifting host: both sides drift together
    new = [b - 2e-6 for b in base]  # new 2 us faster in every pair
    ref = [0.9e-3 + i * 1e-6 for i in range(40)]
    r = paired.pair_rows(base, new, ref)
    assert r["diff_us"] == pytest.approx((-2.0, -2.0, -2.0))
    assert r["new_faster"] == 1.0 and r["reps"] == 40
    assert r["points"][0] > 0  # faster whole, more % of the same copy, in every pair
    assert r["new%"] > r["base%"]
    rows = {"s@1": {"H2D": dict(r, **{"base%": 89.5, "new%": 92.0}), "D2H": dict(r, **{"base%": 95.0, "new%": 90.0})}}
    t = paired.at_target(rows)
    assert t["new"] == {"rows": 2, "at": 2, "lowest": ["s@1 D2H", 90.0]}
    assert t["base"] == {"rows": 2, "at": 1, "lowest": ["s@1 H2D", 89.5]}
    lo, med, hi = paired.interval(list(range(100)))
    assert (lo, med, hi) == (39, 49.5, 60)  # the order statistics of the project's median_ci (binomial ranks)


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict({k: v for k, v in os.environ.items() if k != "NPU_OFFLOAD_NATIVE_DIR"},
                                             **(env or {})))


def test_runs_both_trees_interleaved_on_this_platform(tmp_path):
    """This tree against itself imported as the baseline, on the CPU platform: every row has both
    directions, the reps asked for, and the two packages are two imports."""
    out = tmp_path / "paired.json"
    r = _run("--base", str(ROOT), "--no-build", "--reps", "6", "--warmup", "1", "--shapes", "qwen2.5-0.5b-fp8@8",
             "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    rows = doc["shapes"]["qwen2.5-0.5b-fp8@8"]
    assert set(rows) == {"H2D", "D2H"} and all(row["reps"] == 6 for row in rows.values())
    assert "vllm_npu_offload_baseline from" in r.stdout and "new: vllm_npu_offload from" in r.stdout
    assert doc["at_target"]["new"]["rows"] == 2 and "new: " in r.stdout.splitlines()[-1]
    # padded device blocks and mixed page sizes (issue #22's other shapes) run the same way
    r = _run("--base", str(ROOT), "--no-build", "--reps", "6", "--warmup", "1", "--shapes",
             "hd112-3.5k-stride4k@4,mixed-16k-2k@2", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert set(json.loads(out.read_text())["shapes"]) == {"hd112-3.5k-stride4k@4", "mixed-16k-2k@2"}
    # host chunks of 3 blocks, 7 blocks: two whole chunks and a partial one (the 82% row)
    r = _run("--base", str(ROOT), "--no-build", "--reps", "6", "--warmup", "1", "--shapes", "llama-8b-b64x3@7",
             "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["ref"] == "pool"  # the copy reads / writes the pool's bytes the transfers moved
    rows = doc["shapes"]["llama-8b-b64x3@7"].values()
    assert all((row["reps"], row["blocks_per_chunk"], row["chunks"]) == (6, 3, 3) for row in rows)
    r = _run("--base", str(ROOT), "--no-build", "--reps", "6", "--warmup", "1", "--shapes", "qwen2.5-0.5b@4",
             "--ref", "pinned", "--json", str(out))
    assert r.returncode == 0 and json.loads(out.read_text())["ref"] == "pinned", r.stdout + r.stderr
    # --auto: each core's own choice, as under a connector (the CPU platform has no staging: direct)
    r = _run("--base", str(ROOT), "--no-build", "--reps", "6", "--warmup", "1", "--shapes", "qwen2.5-0.5b@4",
             "--auto", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["auto"] and all(row["mode"] == {"base": "direct", "new": "direct"}
                               for row in doc["shapes"]["qwen2.5-0.5b@4"].values())


@pytest.mark.parametrize("args, env, says", [
    (["--base", str(ROOT), "--reps", "5"], None, "--reps 5: at least 6"),
    (["--base", "/nonexistent"], None, "no vllm_npu_offload package there"),
    (["--base", str(ROOT)], {"NPU_OFFLOAD_NATIVE_DIR": "/tmp"}, "NPU_OFFLOAD_NATIVE_DIR is set"),
])
def test_bad_arguments_are_named(args, env, says):
    r = _run(*args, "--no-build", env=env)
    assert r.returncode != 0 and says in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_side_without_its_library_is_refused_on_cuda(tmp_path):
    """Without its library a side falls back to direct copies; on CUDA the pair would then compare that
    fallback with the other side's library, so the tool stops and names the side (none needed on CPU)."""
    import shutil

    from benchmarks.step_cpu import load_baseline

    shutil.copytree(ROOT / "vllm_npu_offload", tmp_path / "vllm_npu_offload",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    sides = {"base": load_baseline(tmp_path)}
    paired.require_libraries(sides, "cpu")
    with pytest.raises(SystemExit, match=r"base \(.*vllm_npu_offload\): its copy library does not load .*"
                                         r"libnpu_offload_cuda.so not found.*run without --no-build"):
        paired.require_libraries(sides, "cuda")
