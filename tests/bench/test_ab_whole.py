"""scripts/dev/ab_whole.py: its variants are checked before any GPU work, and its table is the
medians per shape, direction and variant of what the probe measured."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ab_whole", ROOT / "scripts" / "dev" / "ab_whole.py")
ab_whole = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_whole)


def test_variants_name_a_tree_with_the_probe_and_their_environment():
    label, tree, env = ab_whole.parse_variant(f"inl={ROOT}:NPU_OFFLOAD_STAGE_LOAD_INLINE_IDS=1,A=b")
    assert (label, tree, env) == ("inl", ROOT, {"NPU_OFFLOAD_STAGE_LOAD_INLINE_IDS": "1", "A": "b"})
    for bad, why in (("new", "expected LABEL=TREE"), (f"x={ROOT}:NOEQUALS", "'NOEQUALS' is not VAR=VAL"),
                     ("x=/nonexistent", "has no scripts/dev/probe_whole_split.py")):
        with pytest.raises(SystemExit, match=why):
            ab_whole.parse_variant(bad)


def _doc(plan, pre, finish, ref, whole, spin, floor):
    row = {"plan": plan, "pre_native": pre, "finish": finish, "ref": ref, "whole": whole, "ref_spin": ref,
           "spin": spin, "floor": floor}
    return {"shapes": {"s@1": {"H2D": row}}}


def test_summary_is_the_median_per_variant_with_its_range():
    runs = {"a": [_doc(5, 8, 10, 300, 400, 375, 310), _doc(7, 9, 12, 300, 300, 300, 300),
                  _doc(6, 10, 11, 300, 375, 400, 330)],
            "b": [_doc(4, 6, 8, 300, 330, 330, 300)]}
    t = ab_whole.summarize(runs)["s@1 H2D"]
    assert t["a"]["plan"] == 6 and t["a"]["pre_native"] == 9 and t["a"]["finish"] == 11 and t["a"]["critical"] == 26
    assert t["a"]["whole%"] == 80.0 and t["a"]["whole% range"] == [75.0, 100.0] and t["a"]["runs"] == 3
    assert t["a"]["spin%"] == 80.0 and t["b"]["critical"] == 18 and t["b"]["runs"] == 1


def test_pairs_compare_each_round_with_the_first_variant_of_that_round():
    runs = {"base": [_doc(5, 10, 10, 300, 400, 400, 300), _doc(10, 20, 20, 300, 500, 500, 300)],
            "new": [_doc(0, 10, 10, 300, 375, 375, 300), _doc(0, 25, 20, 300, 480, 480, 300)]}
    p = ab_whole.paired(runs)["new"]
    assert p["pairs"] == 2 and p["critical_ratio"] == pytest.approx([0.8, 0.85, 0.9])
    assert p["whole_points"][0] == pytest.approx(100 * 300 / 480 - 60) and p["whole_points"][2] == pytest.approx(5)


def test_rows_at_the_target_count_every_row_and_name_the_lowest():
    runs = {"a": [_doc(5, 8, 10, 300, 330, 330, 310)], "b": [_doc(5, 8, 10, 300, 340, 340, 310)]}
    runs["a"][0]["shapes"]["s@1"]["D2H"] = dict(runs["a"][0]["shapes"]["s@1"]["H2D"], whole=320)
    runs["b"][0]["shapes"]["s@1"]["D2H"] = dict(runs["b"][0]["shapes"]["s@1"]["H2D"], whole=333)
    t = ab_whole.at_target(ab_whole.summarize(runs))
    # a: 300/330 = 90.9% and 300/320 = 93.75%: both at 90%; b: 88.2% and 90.1%: one of two
    assert (t["a"]["at"], t["a"]["rows"]) == (2, 2) and t["a"]["lowest"][0] == "s@1 H2D"
    assert (t["b"]["at"], t["b"]["rows"]) == (1, 2) and t["b"]["lowest"] == ["s@1 H2D", pytest.approx(88.235, 1e-3)]


def test_cpus_pin_every_probe_and_bad_lists_name_what_is_allowed():
    import os
    import sys

    mine = sorted(os.sched_getaffinity(0))
    assert ab_whole.parse_cpus(None) is None and ab_whole.parse_cpus("") is None
    assert ab_whole.parse_cpus(f"{mine[0]}") == {mine[0]}
    assert ab_whole.parse_cpus(f"{mine[0]}-{mine[-1]}") == set(mine)
    for bad, why in (("x", "'x' is not a CPU number"), ("99999", r"CPUs \[99999\] are not among")):
        with pytest.raises(SystemExit, match=why):
            ab_whole.parse_cpus(bad)
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    r = ab_whole.run_probe([sys.executable, "-c", code], {mine[-1]}, capture_output=True, text=True)
    assert r.stdout.strip() == str([mine[-1]])  # the child runs on the chosen CPU only
    r = ab_whole.run_probe([sys.executable, "-c", code], None, capture_output=True, text=True)
    assert r.stdout.strip() == str(mine)
