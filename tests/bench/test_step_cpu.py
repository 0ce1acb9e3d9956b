"""The engine-step CPU benchmark (benchmarks/step_cpu.py) runs: two reps of one shape, staged on
the ACL emulation and direct on the host path, with this checkout as its own baseline tree; the
library's planner runs in the timed enqueue (plan-only)."""

from pathlib import Path

import pytest

from _npu_build_support import INCLUDE, SKIP_REASON
from benchmarks import step_cpu
from vllm_npu_offload._native import acl

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)


def test_two_reps_of_one_shape_with_a_baseline(tmp_path, monkeypatch):
    for var in ("NPU_OFFLOAD_NATIVE_DIR", "NPU_OFFLOAD_ACL_LIBRARY"):  # build_emulation sets them: restore after
        monkeypatch.setenv(var, "")
    plans, real_plan = [], acl.staged_plan
    monkeypatch.setattr(acl, "staged_plan", lambda req, out, lib: plans.append(req) or real_plan(req, out, lib))
    lines: list[str] = []
    report = step_cpu.run(["qwen2.5-0.5b-fp8"], blocks=(16,), reps=2, warmup=1, hosts=("random",),
                          native_dir=str(tmp_path), json_path=str(tmp_path / "out.json"),
                          baseline_tree=str(ROOT), printer=lines.append)
    rows = report["rows"]
    assert [(r["dir"], r["mode"]) for r in rows] == [(d, m) for d in ("H2D", "D2H") for m in ("staged", "direct")]
    for r in rows:
        for part in (r, r["before"]):
            assert all(part[m]["wall"]["median"] > 0 for m in step_cpu.METRICS), r
        pages = 16 * 48  # staged: one gather per page plus the link runs; direct: at most one per page
        assert r["descriptors"] > pages if r["mode"] == "staged" else 0 < r["descriptors"] <= pages
    assert rows[0]["slices"] >= 1 and "after/before" in "\n".join(lines)
    # this tree's every timed staged transfer (warm-up + reps, both directions) planned by the library
    assert len(plans) >= 2 * (1 + 2)
    assert (tmp_path / "out.json").exists()


def test_shapes_are_the_issue_22_ones():
    got = {n: (len(s.kv.pages), sorted(set(s.kv.pages)), s.groups) for n, s in step_cpu.STEP_SHAPES.items()}
    assert got == {"llama-8b": (64, [32768], 1), "qwen2.5-0.5b-fp8": (48, [2048], 1),
                   "dsv2_lite": (27, [18432], 1), "llama-70b-tp8": (160, [4096], 1),
                   "gemma2_9b": (42, [131072], 2)}
