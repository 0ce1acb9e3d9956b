"""The CPU-side pieces of the GPU end-to-end script (scripts/dev/gpu_e2e.sh): packing into parts,
staging/install/cold-machine detection, prompts, argument parsing and tables. No GPU, no vLLM."""

import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks.gpu_e2e import serve, stage, tables
from benchmarks.gpu_e2e.engine import kv_transfer_config

ROOT = Path(__file__).resolve().parents[2]


def test_plan_parts_fills_budget_and_keeps_pieces_contiguous():
    parts = stage.plan_parts([("t", 250, True), ("a", 30, False), ("b", 90, False)], 100)
    assert all(sum(n for _, _, n in p) <= 100 for p in parts)
    assert len(parts) == 4  # 370 bytes in parts of 100
    whole = [(name, off, n) for p in parts for name, off, n in p if name != "t"]
    assert sorted(whole) == [("a", 0, 30), ("b", 0, 90)]  # wheels never split
    pieces = [(off, n) for p in parts for name, off, n in p if name == "t"]
    assert pieces[0][0] == 0 and sum(n for _, n in pieces) == 250
    assert all(a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_plan_parts_rejects_oversized_whole_item():
    with pytest.raises(stage.StageError, match="does not fit"):
        stage.plan_parts([("big.whl", 200, False)], 100)


def test_deps_are_pinned_once():
    deps = stage.read_deps()
    names = [d.split("==")[0].lower() for d in deps]
    assert len(names) == len(set(names)) and "uvicorn" in names


def _fake_parts(tmp_path: Path, budget: int = 4000):
    """A tiny 'vLLM' tarball split like prepare() does, without downloads."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as t:
        data = os.urandom(6000)
        info = tarfile.TarInfo("vllm/__init__.py")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    tar = tmp_path / "v.tar.xz"
    tar.write_bytes(buf.getvalue())
    man = {"vllm": "0.23.0", "tar": stage.TAR_NAME, "tar_sha256": stage._sha256(tar), "wheels": [], "pieces": []}
    parts = stage.plan_parts([(stage.TAR_NAME, tar.stat().st_size, True)], budget)
    raw = tar.read_bytes()
    for i, part in enumerate(parts, 1):
        d = tmp_path / f"part{i}"
        d.mkdir()
        for _, off, n in part:
            (d / f"{stage.TAR_NAME}.{off:012d}").write_bytes(raw[off:off + n])
            man["pieces"].append({"part": i, "file": f"{stage.TAR_NAME}.{off:012d}", "offset": off, "bytes": n})
    for i in range(1, len(parts) + 1):
        (tmp_path / f"part{i}" / "manifest.json").write_text(json.dumps(man))
    return len(parts)


def test_stage_install_and_cold_detection(tmp_path, capsys):
    n = _fake_parts(tmp_path)
    assert n >= 2
    st, site = tmp_path / "stage", tmp_path / "site"
    assert stage.check(site) == 3
    assert "machine is cold" in capsys.readouterr().err
    missing = stage.stage(tmp_path / "part1", st)
    assert missing  # the later parts are not there yet
    with pytest.raises(stage.StageError, match="stage every part again"):
        stage.install(st, site)
    for i in range(2, n + 1):
        missing = stage.stage(tmp_path / f"part{i}", st)
    assert missing == []
    stage.install(st, site)
    assert (site / "vllm" / "__init__.py").exists() and stage.check(site) == 0


def test_install_on_fresh_machine_says_cold(tmp_path):
    with pytest.raises(stage.StageError, match="went cold"):
        stage.install(tmp_path / "nothing", tmp_path / "site")


def test_script_run_on_cold_machine_exits_3(tmp_path):
    env = {**os.environ, "GPU_E2E_SITE": str(tmp_path / "site"), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts/dev/gpu_e2e.sh"), "run", "correctness"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert "machine is cold" in r.stderr


def test_parse_parts():
    assert tables.parse_parts([]) == ["correctness", "ttft", "miss", "serve"]
    assert tables.parse_parts(["all"]) == tables.parse_parts([])
    assert tables.parse_parts(["miss", "correctness"]) == ["correctness", "miss"]
    assert tables.parse_parts(["serve", "smoke"]) == ["smoke", "serve"]
    with pytest.raises(ValueError, match="unknown part"):
        tables.parse_parts(["speed"])


def test_device_args():
    from benchmarks.gpu_e2e.device import build_parser

    a = build_parser().parse_args(["ttft", "--ttft-lengths", "2048,8192", "--reps", "7"])
    assert a.parts == ["ttft"] and a.ttft_lengths == [2048, 8192] and a.reps == 7 and a.variant == []
    a = build_parser().parse_args(["miss", "--variant", "old:NPU_OFFLOAD_NATIVE_DIR=/tmp/x,NPU_OFFLOAD_STAGED=0"])
    assert a.variant == [("old", {"NPU_OFFLOAD_NATIVE_DIR": "/tmp/x", "NPU_OFFLOAD_STAGED": "0"})]
    for bad in ("ours:A=1", "x", "x:", "x:A", ":A=1"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["miss", "--variant", bad])


def test_miss_table_lists_variants():
    res = {"batch": 2, "prompt_tokens": 8, "max_tokens": 1,
           "runs": {"off": [1.0, 1.0], "native": [1.1, 1.0], "ours": [1.0, 1.02], "old": [1.2, 1.2]}}
    text = tables.miss_table(res)
    assert "| old " in text and "+20.0%" in text and "start_load ms" not in text
    res["step_totals"] = {"ours": [{"step": [3, 30.0], "start_load": [3, 1.5]}, {"step": [3, 34.0]}]}
    text = tables.miss_table(res)
    assert "start_load ms" in text and " 32.0 |" in text and " 0.8 |" in text  # medians; a missing kind counts 0
    assert "ours-disk against ours" not in text
    res["runs"]["ours-disk"] = [1.01, 1.0404]  # +1% and +2% against ours' rounds
    assert "ours-disk against ours (host only), paired: +1.5% (+1.0..+2.0%, 2 rounds)" in tables.miss_table(res)


def test_unique_prompts_exact_and_distinct():
    ps = tables.unique_prompts(48, 2000, seed=3)
    assert all(len(p) == 2000 for p in ps)
    assert len({tuple(p[:16]) for p in ps}) == 48
    assert all(4 <= t < 1000 for p in ps for t in p)
    other = tables.unique_prompts(48, 2000, seed=4)
    assert not {tuple(p[:16]) for p in ps} & {tuple(p[:16]) for p in other}
    assert tables.unique_prompts(2, 10, seed=3) == tables.unique_prompts(2, 10, seed=3)


def test_spread_and_outside():
    assert tables.spread([3.0, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert tables.outside_spread([1.0, 1.1], [1.2, 1.3])
    assert not tables.outside_spread([1.0, 1.25], [1.2, 1.3])
    assert tables.kv_bytes_per_token(32, 8, 128, 2) == 131072


def test_paired_change_on_the_recorded_miss_run():
    """Per-round ratios cancel the machine's drift that the unpaired ranges cannot (H200 run, 2026-11-23)."""
    res = json.loads((ROOT / "docs/results/gpu_e2e_staged_2026-11-23/miss.json").read_text())
    p = tables.paired_change(res["runs"]["ours"], res["runs"]["off"])
    assert p["n"] == 5 and p["min"] <= p["median"] <= p["max"]
    ratios = sorted(o / f - 1 for o, f in zip(res["runs"]["ours"], res["runs"]["off"]))
    assert p["median"] == ratios[2] and (p["min"], p["max"]) == (ratios[0], ratios[-1])
    assert "paired vs off" in tables.miss_table(res) and f"{p['median'] * 100:+.1f}%" in tables.miss_table(res)
    assert tables.paired_change([2.0, 3.0], [1.0]) == {"n": 1, "median": 1.0, "min": 1.0, "max": 1.0}


def test_kv_transfer_configs():
    assert kv_transfer_config("off", 1, 64) is None
    nat = kv_transfer_config("native", 1 << 30, 64)
    assert nat["kv_connector"] == "OffloadingConnector" and "spec_name" not in nat["kv_connector_extra_config"]
    ours = kv_transfer_config("ours", 1 << 30, 64)["kv_connector_extra_config"]
    assert ours["spec_name"] == "NPUOffloadingSpec" and ours["block_size"] == 64
    assert kv_transfer_config("simple", 1, 64)["kv_connector"] == "NPUSimpleCPUOffloadConnector"
    with pytest.raises(ValueError):
        kv_transfer_config("other", 1, 64)


def test_tables_from_recorded_results(tmp_path):
    """The tables render from the JSON recorded on the H200 (docs/results) and are written back."""
    res_dir = ROOT / "docs/results/gpu_e2e_2026-11-23"
    for part in ("correctness", "ttft", "miss", "multiturn"):
        res = json.loads((res_dir / f"{part}.json").read_text())
        text = tables.write_part(tmp_path, part, res)
        assert text.startswith("|") and (tmp_path / f"{part}.json").exists()
    assert "ours" in (tmp_path / "miss.txt").read_text()


def test_write_part_survives_bad_result(tmp_path):
    text = tables.write_part(tmp_path, "ttft", {"error": "boom"})
    assert text.startswith("(no table")
    assert json.loads((tmp_path / "ttft.json").read_text())["error"] == "boom"


class _FakeCore:
    """Just enough of vLLM's in-process engine for timeline.install: a step that schedules a
    load, polls until it is seen, then schedules the forward."""

    def __init__(self, conn):
        from types import SimpleNamespace as NS

        self.conn, self.i = conn, 0
        plan = [(0, {7: 1}), (0, {}), (0, {}), (24, {})]  # (tokens, load jobs) per step
        self.scheduler = NS(schedule=lambda: NS(total_num_scheduled_tokens=plan[self.i][0],
                                                kv_connector_metadata=NS(load_jobs=plan[self.i][1], store_jobs={},
                                                                         jobs_to_flush=None)),
                            update_from_output=lambda *a: None)
        self.model_executor = NS(execute_model=lambda out: None)

    def step_fn(self):
        out = self.scheduler.schedule()
        self.model_executor.execute_model(out)
        self.conn.start_load_kv(None)
        self.conn.get_finished(set())
        self.scheduler.update_from_output(out, None)
        self.i += 1


def test_timeline_breakdown_puts_the_load_on_its_steps(monkeypatch):
    import gc
    import sys
    import time
    from types import ModuleType, SimpleNamespace as NS

    from benchmarks.gpu_e2e import timeline

    polls = iter([set(), set(), {"r"}, set()])
    conn = NS(start_load_kv=lambda ctx: None, get_finished=lambda ids: (set(), next(polls)),
              handle_preemptions=lambda meta: None)
    kt = ModuleType("vllm.distributed.kv_transfer")
    kt.get_kv_transfer_group, kt.has_kv_transfer_group = (lambda: conn), (lambda: True)
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer", kt)
    monkeypatch.setattr(timeline, "_installed", False)
    core = _FakeCore(conn)
    llm = NS(llm_engine=NS(engine_core=NS(engine_core=core)))
    n_callbacks = len(gc.callbacks)
    assert timeline.install(llm) == ["gc", "step", "schedule", "update", "execute", "start_load", "finished",
                                     "preempt"]
    assert timeline.install(llm) == []  # once per process
    start = timeline.mark()
    t0 = time.perf_counter()
    for _ in range(4):
        core.step_fn()
    ev = timeline.since(start, t0)
    assert [e["what"] for e in ev].count("step") == 4
    b = timeline.breakdown(ev, 10.0)
    sched = [e for e in ev if e["what"] == "schedule"]
    seen = [e for e in ev if e["what"] == "finished" and e["recv"]]
    assert b["load_scheduled_ms"] == sched[0]["t_ms"] and sched[0]["loads"] == 1
    assert len(seen) == 1 and b["load_seen_ms"] == pytest.approx(seen[0]["t_ms"] + seen[0]["ms"])
    assert b["forward_scheduled_ms"] == sched[3]["t_ms"] and b["steps"] == 4 and b["flush_steps"] == 0
    runs = [e for e in ev if e["what"] == "execute"]
    assert b["forward_ms"] == runs[3]["ms"] and b["forward_cpu_ms"] == runs[3]["cpu_ms"]
    assert all(0 <= e["cpu_ms"] <= e["ms"] + 0.5 for e in ev if "cpu_ms" in e)  # thread CPU time within the wall
    gc.collect()  # the collector's pauses are recorded too
    try:
        assert any(e["what"] == "gc" and e["gen"] == 2 for e in timeline.since(start, t0))
    finally:
        gc.callbacks.remove(timeline._on_gc)
    assert len(gc.callbacks) == n_callbacks
    assert timeline.mark() == 0 and timeline.since(0, t0) == []  # a new record drops the old one


def test_ttft_steps_table_pairs_native_and_ours():
    def rep(wall):
        return {"wall_ms": wall, "load_scheduled_ms": 1.0, "load_seen_ms": wall - 9, "forward_scheduled_ms": wall - 8,
                "steps": 5, "longest_step_ms": 7.0, "flush_steps": 0, "preempt_ms": 0.0}

    res = {"reps": 3, "rows": [{"prompt_tokens": 2048, "cold_s": {"median": 0.06}, "device_hit_s": {"median": 0.02},
                                "native_s": {"median": 0.03}, "ours_s": {"median": 0.025},
                                "native_steps": [rep(30), rep(31), rep(29)], "ours_steps": [rep(25), rep(33), rep(24)]}]}
    text = tables.ttft_table(res)
    assert "ours - native" in text and "ours faster in 2/3" in text and "-5.0" in text


def test_ttft_floor_table_is_native_fixed_costs_plus_the_link_time():
    """Native: wall 40, load scheduled at 2 and seen at 32 (span 30): fixed 10 ms. 1 GB at 50 GB/s is
    20 ms of link: floor 30 ms = 0.75x native. Ours: wall 35, span 23: 5 over the floor, 3 of it in
    its load beyond the link, 2 in fixed costs beyond native's."""
    def rep(wall, seen):
        return {"wall_ms": wall, "load_scheduled_ms": 2.0, "load_seen_ms": seen}

    res = {"bandwidth": {"h2d_gbps": 50.0},
           "rows": [{"prompt_tokens": 8192, "ours_load_bytes": 10**9, "ours_load_s": 0.0205, "ours_load_seen_s": 0.0215,
                     "native_steps": [rep(40, 32), rep(41, 33), rep(39, 31)],
                     "ours_steps": [rep(35, 25), rep(36, 25), rep(34, 25)]}]}
    text = tables.ttft_floor_table(res)
    row = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    # of ours' 3 ms beyond the link: 1.5 before its submit, 1.0 from submit to seen beyond the device
    # time (21.5 - 20.5), 0.5 of device time beyond the link
    assert row == ["8,192", "20.0", "10.0", "30.0", "0.75x", "40.0", "35.0", "0.88x", "+5.0", "+3.0", "1.5", "1.0",
                   "+0.5", "+2.0"]
    assert tables.ttft_floor_table({"bandwidth": {}, "rows": res["rows"]}) == ""  # no link rate: no table


def _fake_pool(monkeypatch, device, seen):
    monkeypatch.setattr(device, "build_shape_model", lambda out, shape, vocab=None, layers=None: f"model-{shape}")
    monkeypatch.setattr(device, "start_all", lambda specs, timeout=400, in_waves=False: seen.setdefault("specs", specs) and {})


def test_start_pool_adds_one_engine_of_our_spec_per_variant(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device

    seen = {}
    _fake_pool(monkeypatch, device, seen)
    a = device.build_parser().parse_args(["miss", "--variant", "old:NPU_OFFLOAD_NATIVE_DIR=/tmp/x"])
    device.start_pool(tmp_path, a, "uniform", ["miss"])
    specs = seen["specs"]
    assert [(s.label, s.kind, s.env) for s in specs] == [
        ("off", "off", {}), ("native", "native", {}), ("ours", "ours", {}),
        ("old", "ours", {"NPU_OFFLOAD_NATIVE_DIR": "/tmp/x"})]
    assert len({(s.model, s.kv_cache_bytes, s.max_model_len, s.cpu_bytes) for s in specs}) == 1  # same pool


def test_start_pool_without_native(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device

    seen = {}
    _fake_pool(monkeypatch, device, seen)
    a = device.build_parser().parse_args(["miss", "--no-native", "--variant", "d:NPU_OFFLOAD_STAGED=0"])
    device.start_pool(tmp_path, a, "uniform", ["miss"])
    assert [s.label for s in seen["specs"]] == ["off", "ours", "d"]
    assert device.main(["ttft", "--no-native", "--out", str(tmp_path / "o")]) == 2  # nothing to compare with


def test_step_rows_and_step_kind_table():
    from benchmarks.gpu_e2e import timeline

    ev = [{"t_ms": 0.0, "what": "step", "ms": 10.0}, {"t_ms": 0.5, "what": "schedule", "ms": 0.2, "tokens": 300},
          {"t_ms": 1.0, "what": "gpu_execute", "ms": 8.0}, {"t_ms": 9.0, "what": "gpu_sample", "ms": 0.3},
          {"t_ms": 12.0, "what": "step", "ms": 4.0}, {"t_ms": 12.1, "what": "schedule", "ms": 0.1, "tokens": 2},
          {"t_ms": 12.5, "what": "gpu_execute", "ms": 3.0}, {"t_ms": 17.0, "what": "step", "ms": 0.1},
          {"t_ms": 17.01, "what": "schedule", "ms": 0.01, "tokens": 0}]
    ev[4:4] = [{"t_ms": 9.5, "what": "update", "ms": 0.4}, {"t_ms": 9.6, "what": "finished", "ms": 0.05},
               {"t_ms": 9.7, "what": "preempt", "ms": 0.1}]
    ev.insert(9, {"t_ms": 12.4, "what": "execute", "ms": 0.9})
    rows = timeline.step_rows(ev)
    assert rows == [[300, 10.0, 8.0, 0.3, 0.2, 0.0, 0.0, 0.4, 0.15], [2, 4.0, 3.0, 0.0, 0.1, 0.9, 0.0, 0.0, 0.0],
                    [0, 0.1, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0]]
    assert tables.round_split(rows, batch=2) == {"prefill_n": 1, "prefill_ms": 10.0, "prefill_gpu_ms": 8.0,
                                                 "decode_n": 1, "decode_ms": 4.0, "decode_gpu_ms": 3.0}
    slow = [[300, 11.0, 8.8, 0.3, 0.2, 0.0, 0.0, 0.4, 0.15], [2, 4.2, 3.0, 0.0, 0.1, 1.1, 0.0, 0.0, 0.0]]
    text = tables.step_kind_table({"off": [rows, rows], "ours": [slow, slow]}, batch=2)
    assert "8.8 (+10.0%)" in text and "3.0 (+0.0%)" in text and " 1/1 |" in text
    res = {"batch": 2, "prompt_tokens": 8, "max_tokens": 1, "runs": {"off": [1.0], "ours": [1.1]},
           "step_rows": {"off": [rows], "ours": [slow]}}
    assert "prefill device ms" in tables.miss_table(res)
    steady = tables.steady_decode_table({"off": [rows, rows], "ours": [slow, slow]}, batch=2, skip=0)
    assert "1.100 (+200 us)" in steady and "4.200 (+200 us)" in steady and "0.900 |" in steady
    assert tables.steady_decode_table({"off": [[r[:4] for r in rows]]}, batch=2, skip=0) == ""  # old rows


def test_median_ci_order_statistics():
    """Known ranks of the distribution-free 95% interval of a median (1-based: n=6 -> 1..6,
    n=10 -> 2..9, n=56 -> 21..36); n=5 cannot reach 95% (2 x 1/32 > 5%)."""
    assert tables.median_ci([float(x) for x in range(5)]) is None
    assert tables.median_ci([5.0, 0.0, 3.0, 1.0, 4.0, 2.0]) == (0.0, 5.0)
    assert tables.median_ci(list(range(10))) == (1, 8)
    assert tables.median_ci(list(range(56))) == (20, 35)
    assert tables.median_ci(list(range(10)), level=0.5) == (3, 6)


def test_null_engine_splits_the_miss_cost(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device

    null = kv_transfer_config("null", 1 << 30, 64)["kv_connector_extra_config"]
    assert null["spec_name"] == "NullCopySpec" and null["spec_module_path"].endswith("gpu_e2e.null_spec")
    seen = {}
    _fake_pool(monkeypatch, device, seen)
    device.start_pool(tmp_path, device.build_parser().parse_args(["miss", "--null"]), "uniform", ["miss"])
    assert [(s.label, s.kind) for s in seen["specs"]] == [("off", "off"), ("native", "native"), ("ours", "ours"),
                                                          ("null", "null")]
    assert device.main(["ttft", "--null", "--out", str(tmp_path / "o")]) == 2  # a reload would stop the null engine
    with pytest.raises(SystemExit):
        device.build_parser().parse_args(["miss", "--variant", "null:A=1"])

    off = [4.0 + 0.01 * i for i in range(8)]
    runs = {"off": off, "native": [x * 1.02 for x in off], "ours": [x * 1.015 for x in off],
            "null": [x * 1.01 for x in off]}
    text = tables.miss_table({"batch": 2, "prompt_tokens": 8, "max_tokens": 1, "runs": runs})
    lines = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if " vs " in ln and ln.startswith("|")}
    assert "+1.00%" in lines["null vs off"] and "+0.50%" in lines["ours vs null"] and "+1.50%" in lines["ours vs off"]
    assert "+0.99%" in lines["native vs null"]  # 1.02 / 1.01 - 1
    assert "+1.00..+1.00%" in lines["null vs off"]  # every round the same: the interval is that point
    plain = tables.cost_split_table({"off": off, "ours": [x * 1.03 for x in off]})  # no null: against off only
    assert "ours vs off" in plain and "+3.00%" in plain and "null" not in plain
    assert tables.cost_split_table({"ours": off}) == "" and tables.cost_split_table({"off": off}) == ""


def test_pool_miss_runs_from_json_and_log(tmp_path):
    import gzip

    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(
        {"runs": {"off": [4.0, 4.2], "ours": [4.1, 4.2], "null": [4.0, 4.3]}}).encode()))
    (tmp_path / "b.log").write_text("[8b] engines up in 73s: off 49s, ours 47s\n[miss] round 0: \n"
                                    "[miss] round 1: off 3.970s, ours 4.736s, null 4.087s, native 4.1s\n"
                                    "INFO other line 5.0s\n[miss] round 2: off 4.599s, ours 4.405s, null 4.901s\n")
    b = tables.load_miss_runs(tmp_path / "b.log")
    # round 2 lacks native (it failed there): only complete rounds stay, so pairs keep their round
    assert b == {"off": [3.970], "ours": [4.736], "null": [4.087], "native": [4.1]}
    (tmp_path / "b.log").write_text("[miss] round 1: off 3.970s, ours 4.736s, null 4.087s\n"
                                    "[miss] round 2: off 4.599s, ours 4.405s, null 4.901s\n")
    b = tables.load_miss_runs(tmp_path / "b.log")
    pooled = tables.pool_miss_runs([tables.load_miss_runs(tmp_path / "a.json.gz"), b])
    assert pooled == {"off": [4.0, 4.2, 3.970, 4.599], "ours": [4.1, 4.2, 4.736, 4.405],
                      "null": [4.0, 4.3, 4.087, 4.901]}  # native: not in every run
    with pytest.raises(ValueError, match="no engine is in every run"):
        tables.pool_miss_runs([{"off": [1.0]}, {"ours": [1.0]}])
    nested = {"layouts": {"perlayer": {"runs": {"off": [3.4], "ours": [3.43]}, "batch": 48}}, "meta": {}}
    (tmp_path / "d.json").write_text(json.dumps(nested))  # device.py writes each layout's part under "layouts"
    assert tables.load_miss_runs(tmp_path / "d.json") == {"off": [3.4], "ours": [3.43]}
    nested["layouts"]["uniform"] = nested["layouts"]["perlayer"]
    (tmp_path / "d.json").write_text(json.dumps(nested))
    with pytest.raises(ValueError, match=r"exactly one layout .*\['perlayer', 'uniform'\]"):
        tables.load_miss_runs(tmp_path / "d.json")
    (tmp_path / "c.txt").write_text("nothing here\n")
    with pytest.raises(ValueError, match="neither a miss.json nor a log"):
        tables.load_miss_runs(tmp_path / "c.txt")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/dev/pool_miss.py"), str(tmp_path / "a.json.gz"),
                          str(tmp_path / "b.log")], capture_output=True, text=True, check=True).stdout
    assert "| null vs off " in out and "|      4 |" in out


def test_part_miss_drops_a_round_an_engine_failed_in():
    """Rounds are paired across engines: a round one engine failed in is dropped for all of them,
    so every engine's n-th value comes from the same round."""
    from types import SimpleNamespace

    from benchmarks.gpu_e2e import device
    from benchmarks.gpu_e2e.engine import EngineError

    class Proc:
        def __init__(self, kind, base, fail_round=None):
            self.spec, self.error, self.base, self.fail, self.calls = SimpleNamespace(kind=kind), None, base, fail_round, 0

        def call(self, op, **kw):
            if op == "worker_info":
                return {}
            r = self.calls
            self.calls += 1
            if r == self.fail:
                raise EngineError("boom")
            return {"wall_s": self.base + r, "totals": {}, "step_rows": [], "store_s": 0.0, "store_bytes": 0}

    procs = {"off": Proc("off", 10.0), "ours": Proc("ours", 20.0, fail_round=2)}
    a = device.build_parser().parse_args(["miss", "--miss-reps", "3"])
    res = device.part_miss(procs, a)
    assert res["dropped_rounds"] == [2] and "ours-2" in res["errors"]
    assert res["runs"] == {"off": [11.0, 13.0], "ours": [21.0, 23.0]}  # rounds 1 and 3, paired
    assert len(res["step_rows"]["off"]) == len(res["step_rows"]["ours"]) == 2


def test_part_miss_profiles_one_step_per_engine_after_the_timed_rounds():
    """--miss-profile-step: two extra rounds, each engine asked to profile that step's forward;
    the timed rounds stay unprofiled and the table names the kernels that differ from off's."""
    from types import SimpleNamespace

    from benchmarks.gpu_e2e import device

    def prof(extra_ms):
        return {"wall_ms": 9.0, "cpu_ms": 1.0, "device_ops": 100, "device_busy_ms": 8.0 + extra_ms,
                "device_span_ms": 9.0, "top_device": [["gemv", 60, 6.0 + extra_ms], ["attn", 32, 2.0]],
                "top_gaps": [["gemv > attn", 32, 0.5 + extra_ms]]}

    class Proc:
        def __init__(self, kind, extra):
            self.spec, self.error, self.extra, self.kw = SimpleNamespace(kind=kind), None, extra, []

        def call(self, op, **kw):
            if op == "worker_info":
                return {}
            self.kw.append(kw)
            out = {"wall_s": 1.0, "totals": {}, "step_rows": [], "store_s": 0.0, "store_bytes": 0}
            return {**out, "profile": prof(self.extra)} if kw.get("profile") else out

    procs = {"off": Proc("off", 0.0), "ours": Proc("ours", 0.25)}
    a = device.build_parser().parse_args(["miss", "--miss-reps", "2", "--miss-profile-step", "40"])
    res = device.part_miss(procs, a)
    assert [k.get("profile", False) for k in procs["ours"].kw] == [False] * 3 + [True] * 2
    assert procs["ours"].kw[-1]["profile_skip"] == 40 and procs["ours"].kw[-1]["profile_steps"] == 4
    assert len(res["runs"]["ours"]) == 2
    assert len(res["profiles"]["off"]) == len(res["profiles"]["ours"]) == 2
    text = tables.step_profile_table(res["profiles"])
    assert "ours - off, device idle before > after: gemv > attn +0.250" in text
    assert "ours - off, kernels: gemv +0.250; attn +0.000" in text and "8.25" in text and " 0.75 |" in text and " 1.00 |" in text
    assert tables.step_profile_table({}) == ""
    a0 = device.build_parser().parse_args(["miss", "--miss-reps", "1"])
    procs0 = {"off": Proc("off", 0.0)}
    assert "profiles" not in device.part_miss(procs0, a0) and not any(k.get("profile") for k in procs0["off"].kw)


def test_forward_profile_skips_the_calls_it_is_told_to(monkeypatch):
    from types import SimpleNamespace as NS

    from benchmarks.gpu_e2e import forward_profile as fp

    monkeypatch.setitem(fp._state, "installed", False)
    ex = NS(execute_model=lambda out: out.total_num_scheduled_tokens)
    assert fp.install(NS(llm_engine=NS(engine_core=NS(engine_core=NS(model_executor=ex)))))
    fp.arm(skip=2)
    for n in (4, 0, 4):  # two calls with tokens pass unprofiled (the empty one does not count)
        ex.execute_model(NS(total_num_scheduled_tokens=n))
        assert fp._state["last"] is None and fp._state["armed"]
    ex.execute_model(NS(total_num_scheduled_tokens=4))
    assert fp.take() is not None
    fp.arm(steps=3)  # one profile over three steps: closed where the fourth step's forward begins
    for _ in range(3):
        ex.execute_model(NS(total_num_scheduled_tokens=4))
        assert fp._state["open"] is not None and fp._state["last"] is None
    ex.execute_model(NS(total_num_scheduled_tokens=4))
    assert fp._state["open"] is None and fp.take() is not None
    fp.arm(steps=5)  # the run ends inside the window: take() closes it
    ex.execute_model(NS(total_num_scheduled_tokens=4))
    assert fp.take() is not None and fp._state["open"] is None


def test_forward_profile_summarizes_one_armed_forward(monkeypatch):
    import torch
    from types import SimpleNamespace as NS

    from benchmarks.gpu_e2e import forward_profile as fp

    monkeypatch.setitem(fp._state, "installed", False)
    calls = []

    def execute_model(out):
        calls.append(out.total_num_scheduled_tokens)
        if out.total_num_scheduled_tokens:
            x = torch.randn(64, 64)
            for _ in range(3):
                x = x @ x
        return len(calls)

    ex = NS(execute_model=execute_model)
    llm = NS(llm_engine=NS(engine_core=NS(engine_core=NS(model_executor=ex))))
    assert fp.install(llm) and fp.install(llm)  # once
    assert ex.execute_model(NS(total_num_scheduled_tokens=4)) == 1 and fp.take() is None  # not armed
    fp.arm()
    assert ex.execute_model(NS(total_num_scheduled_tokens=0)) == 2 and fp._state["last"] is None  # no tokens: waits
    assert ex.execute_model(NS(total_num_scheduled_tokens=4)) == 3
    p = fp.take()
    assert p is not None and fp.take() is None and calls == [4, 0, 4]
    mm = [row for row in p["top_host"] if row[0] == "aten::mm"]
    assert mm and mm[0][1] == 3 and p["host_ops"] >= 3 and 0 < p["cpu_ms"] and p["device_ops"] == 0
    assert ex.execute_model(NS(total_num_scheduled_tokens=4)) == 4 and fp.take() is None  # one forward per arm()


def test_forward_profile_summary_and_table():
    from types import SimpleNamespace as NS

    from benchmarks.gpu_e2e import forward_profile as fp

    dev = lambda name, a, b: NS(name=name, device_type="DeviceType.CUDA", time_range=NS(start=a, end=b))
    host = lambda name, us: NS(name=name, device_type="DeviceType.CPU", self_cpu_time_total=us,
                               time_range=NS(start=0, end=us))
    ev = [host("aten::mm", 300.0), host("aten::mm", 100.0), host("cudaLaunchKernel", 50.0),
          dev("gemm", 0.0, 1000.0), dev("gemm", 500.0, 1500.0), dev("copy", 3000.0, 3500.0)]
    s = fp.summarize(ev, 0.01, 0.008)
    assert s["device_ops"] == 3 and s["device_busy_ms"] == 2.0 and s["device_span_ms"] == 3.5  # overlap counted once
    assert s["top_host"][0] == ["aten::mm", 2, 0.4] and s["top_device"][0] == ["gemm", 2, 2.0]
    assert s["host_ops"] == 3 and s["host_self_ms"] == 0.45 and s["wall_ms"] == 10.0 and s["cpu_ms"] == 8.0
    assert s["top_gaps"] == [["gemm > copy", 1, 1.5]]  # the idle between the last gemm's end and the copy
    slower = fp.summarize(ev + [host("aten::mm", 1000.0)], 0.012, 0.01)
    res = {"rows": [{"prompt_tokens": 2048, "native_profiles": [s, s], "ours_profiles": [slower, slower]}]}
    text = tables.forward_profile_table(res)
    assert "2048: aten::mm +1.00" in text and "12.0" in text and "10.0" in text
    assert tables.forward_profile_table({"rows": [{"prompt_tokens": 1}]}) == ""


def test_cpus_option_pins_every_engine(monkeypatch, tmp_path):
    from benchmarks.gpu_e2e import device, engine

    a = device.build_parser().parse_args(["ttft", "--cpus", "0,2-3"])
    assert a.cpus == [0, 2, 3] and device.build_parser().parse_args(["ttft"]).cpus == []
    for bad in ("x", "3-a", "", "-1", "0,3-1"):
        with pytest.raises(SystemExit):
            device.build_parser().parse_args(["ttft", "--cpus", bad])
    assert device.main(["ttft", "--cpus", "100000", "--out", str(tmp_path)]) == 2  # not on this machine
    seen = {}
    _fake_pool(monkeypatch, device, seen)
    device.start_pool(tmp_path, device.build_parser().parse_args(["ttft", "--cpus", "0"]), "uniform", ["ttft"])
    assert [s.cpus for s in seen["specs"]] == [(0,), (0,), (0,)]

    class FakeEngine:  # the child pins itself before it builds the engine
        def __init__(self, spec):
            self.start_s, self.cpus = 0.0, sorted(os.sched_getaffinity(0))

        def affinity(self):
            return self.cpus

    sent, ops = [], iter([("affinity", {}), ("quit", {})])
    conn = type("Conn", (), {"send": lambda self, m: sent.append(m), "recv": lambda self: next(ops)})()
    monkeypatch.setattr(engine, "_Engine", FakeEngine)
    monkeypatch.setattr(engine, "ENV", {})
    before = os.sched_getaffinity(0)
    try:
        engine._child(conn, engine.EngineSpec("ours", "ours", "m", cpus=(0,)))
    finally:
        os.sched_setaffinity(0, before)
    assert sent[0][0] == "ready" and sent[1] == ("ok", [0])


@pytest.mark.parametrize("reps", [1, 3])
def test_multiturn_passes_pair_servers_that_stay_up(monkeypatch, tmp_path, reps):
    import contextlib

    from benchmarks.gpu_e2e import device
    from benchmarks.multiturn import compare, launcher, report

    started, runs = [], []

    @contextlib.contextmanager
    def fake_server(model, args, *, label, cpus, **kw):
        started.append((label, tuple(cpus), "--kv-transfer-config" in args or kw.get("offload")))
        yield f"http://x/{label}"

    speed = {"off": 10.0, "native": 9.0, "ours": 9.5, "null": 9.8}

    def fake_run_one(convs, dcfg, label, server):
        if server is not None:
            with server() as url:
                assert url.endswith(label)
        else:
            assert dcfg.url.endswith(label)
        runs.append((label, convs[0]))
        rps = speed[label] * (1.0 + 0.1 * len(runs))  # a drift: pairs by pass cancel it only roughly
        return {"results": []}, {"label": label, "requests_per_s": rps, "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 20.0},
                    "completed": 4, "planned": 4, "server": {}}

    monkeypatch.setattr(device, "build_shape_model", lambda out, shape, vocab=None, layers=None: "model-dir")
    monkeypatch.setattr(device, "_mt_conversations", lambda a, seed: ({"seed": seed}, [f"conv-seed{seed}"]))
    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    monkeypatch.setattr(compare, "run_one", fake_run_one)
    monkeypatch.setattr(report, "write_json", lambda path, data: None)
    monkeypatch.setattr(report, "format_compare", lambda off, on: f"{off['label']}/{on['label']} pass {on['rep']}")
    a = device.build_parser().parse_args(["multiturn", "--mt-reps", str(reps), "--null", "--cpus", "0"])
    if reps > 1:
        assert device.main(["multiturn", "--mt-reps", str(reps), "--cpus", "0", "--out", str(tmp_path)]) == 2
    res = device.part_multiturn(tmp_path, a, tmp_path)
    assert [res[f"compare_off_{k}"] for k in ("native", "ours", "null")] == [f"off/{k} pass 0" for k in
                                                                             ("native", "ours", "null")]
    labels = ["off", "native", "ours", "null"]
    assert sorted(s[0] for s in started) == sorted(labels) and all(s[1] == (0,) for s in started)  # once each
    assert all(s[2] == (s[0] != "off") for s in started)  # every server but off offloads
    assert len(res["summaries"]) == 4 * reps and not res["errors"]
    if reps == 1:
        assert [r[0] for r in runs] == labels and tables.multiturn_paired_table(res) == ""
        return
    assert [r[0] for r in runs] == labels + labels[::-1] + labels  # the one going first alternates
    assert [r[1] for r in runs[::4]] == ["conv-seed0", "conv-seed1", "conv-seed2"]  # new texts per pass
    paired = tables.multiturn_paired_table(res)
    assert paired and paired in tables.multiturn_table(res)
    native = next(ln for ln in paired.splitlines() if ln.startswith("| native"))
    # passes 0/1/2: 10.8/11.0, 15.3/18.0, 18.0/19.0 req/s against off in the same pass
    assert "-5.3% (-15.0..-1.8%)" in native and "+0.0% (+0.0..+0.0%)" in native  # TPOT and TTFT unchanged


def test_benchmarks_are_not_packaged():
    """benchmarks/ runs from a checkout (the device copy, e2e_src): setup.py must not install it."""
    code = ("import runpy, setuptools; seen = {}; setuptools.setup = lambda **kw: seen.update(kw); "
            "runpy.run_path('setup.py'); print('\\n'.join(seen['packages']))")
    pkgs = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "vllm_npu_offload" in pkgs and "vllm_npu_offload.integration" in pkgs
    assert not [p for p in pkgs if p.split(".")[0] == "benchmarks"] and "benchmarks.gpu_e2e" not in pkgs
    assert (ROOT / "benchmarks/gpu_e2e/device.py").exists()


def test_layerwise_kind_in_pools_and_servers(monkeypatch, tmp_path):
    """--layerwise adds ours loading layer by layer to a pool of a one-group layout; serve takes it
    as a server kind (also through the per-layer connector); a two-group layout refuses it."""
    from benchmarks.gpu_e2e import device

    seen = {}
    _fake_pool(monkeypatch, device, seen)
    device.start_pool(tmp_path, device.build_parser().parse_args(["ttft", "--layerwise"]), "uniform", ["ttft"])
    assert [(s.label, s.kind) for s in seen["specs"]][-1] == ("layerwise", "layerwise")
    seen.clear()
    device.start_pool(tmp_path, device.build_parser().parse_args(["ttft"]), "perlayer", ["ttft"])
    assert "layerwise" not in [s.label for s in seen["specs"]]  # opt-in
    seen.clear()
    device.start_pool(tmp_path, device.build_parser().parse_args(["ttft", "--layerwise"]), "multigroup", ["ttft"])
    assert "layerwise" not in [s.label for s in seen["specs"]]
    assert serve.parse_server("layerwise", "uniform") == ("uniform", "layerwise", "")
    assert serve.parse_server("perlayer:layerwise", "uniform") == ("perlayer", "layerwise", "")
    with pytest.raises(serve.PlanError, match="layer-wise loads need one KV-cache group; multigroup has 2"):
        serve.parse_server("layerwise", "multigroup")


def test_layerwise_load_auto_reaches_the_engines_config(monkeypatch):
    """--layerwise-load auto: the layerwise kind's connector gets layerwise_load "auto" and auto's own
    min_tokens (none set), in this process and, through the environment, in every child."""
    from benchmarks.gpu_e2e import device, engine

    monkeypatch.setenv(engine.LAYERWISE_MODE_ENV, "true")  # restored to what it was after the test
    monkeypatch.delenv(engine.LAYERWISE_MODE_ENV)
    extra = engine.kv_transfer_config("layerwise", 1 << 30, 64)["kv_connector_extra_config"]
    assert extra["layerwise_load"] is True and extra["layerwise_min_tokens"] == 256
    # main sets the variable before anything starts (this call stops at an argument check right after)
    assert device.main(["ttft", "--layerwise", "--layerwise-load", "auto", "--no-native"]) == 2
    assert os.environ[engine.LAYERWISE_MODE_ENV] == "auto"
    extra = engine.kv_transfer_config("layerwise", 1 << 30, 64)["kv_connector_extra_config"]
    assert extra["layerwise_load"] == "auto" and "layerwise_min_tokens" not in extra
    assert engine.kv_transfer_config("ours", 1 << 30, 64)["kv_connector_extra_config"].get("layerwise_load") is None
    with pytest.raises(SystemExit):
        device.build_parser().parse_args(["ttft", "--layerwise-load", "yes"])


class _TtftEngine:
    """A pool engine for part_ttft: reloads take ``wall`` seconds, every reload hits 2000 host tokens."""

    def __init__(self, kind: str, wall: float):
        self.kind, self.wall, self.error = kind, wall, None

    def call(self, op, **kw):
        if op == "bandwidth":
            return {"h2d_gbps": 50.0, "d2h_gbps": 50.0}
        if op == "flush_reset":
            return {"ok": True}
        if op == "worker_info":
            return {"cores": [], "layerwise": {"loads": 3, "full_graph_steps": 0} if self.kind == "layerwise" else None}
        step = {"wall_ms": self.wall * 1e3, "load_scheduled_ms": 1.0, "load_seen_ms": 2.0, "forward_scheduled_ms": 3.0,
                "steps": 2, "longest_step_ms": 4.0, "flush_steps": 0}
        return {"wall_s": self.wall, "rows": [{"cached": 2000 if self.kind != "off" else 0}], "load_s": 0.004,
                "load_wall_s": 0.005, "load_bytes": 2000 * 131072, "breakdown": step, "events": []}


def test_part_ttft_runs_layerwise_beside_native_and_ours():
    from benchmarks.gpu_e2e import device

    procs = {"off": _TtftEngine("off", 0.01), "native": _TtftEngine("native", 0.03), "ours": _TtftEngine("ours", 0.025),
             "layerwise": _TtftEngine("layerwise", 0.02)}
    a = device.build_parser().parse_args(["ttft", "--ttft-lengths", "2048", "--reps", "3", "--off-reps", "1"])
    res = device.part_ttft(procs, a)
    (row,) = res["rows"]
    assert row["layerwise_s"]["median"] == 0.02 and row["layerwise_host_tokens"] == [2000] * 3
    assert row["layerwise_load_s"] == 0.004 and res["layerwise"] == {"loads": 3, "full_graph_steps": 0}
    text = tables.ttft_table(res)
    assert "reload layerwise ms" in text and "layerwise - ours" in text and "loads 3, full_graph_steps 0" in text
    assert "0.80x" in text  # layerwise / ours
    del procs["layerwise"]
    assert "reload layerwise ms" not in tables.ttft_table(device.part_ttft(procs, a))


def test_part_ttft_with_tensor_parallelism_splits_the_link_time_over_the_ranks():
    """--tp 2: the loaded bytes are both ranks', each rank moves its half over its own GPU's link, so
    the ideal's link time halves; the floor table does the same and leaves out reps whose engine
    timeline never saw the load (with TP the worker connector lives in the worker processes)."""
    from benchmarks.gpu_e2e import device

    procs = {"off": _TtftEngine("off", 0.01), "native": _TtftEngine("native", 0.03), "ours": _TtftEngine("ours", 0.025)}
    args = ["ttft", "--ttft-lengths", "2048", "--reps", "3", "--off-reps", "1"]
    one = device.part_ttft(procs, device.build_parser().parse_args(args))
    two = device.part_ttft(procs, device.build_parser().parse_args(args + ["--tp", "2"]))
    hit = two["rows"][0]["device_hit_s"]["median"]
    link = 2000 * 131072 / 50e9
    assert one["tp"] == 1 and one["rows"][0]["ideal_s"] == pytest.approx(link + hit)
    assert two["tp"] == 2 and two["rows"][0]["ideal_s"] == pytest.approx(link / 2 + hit)
    assert "ideal divides by 2" in tables.ttft_table(two) and "ideal divides by" not in tables.ttft_table(one)

    def rep(wall, seen):
        return {"wall_ms": wall, "load_scheduled_ms": 2.0 if seen is not None else None, "load_seen_ms": seen}

    row = {"prompt_tokens": 8192, "ours_load_bytes": 2 * 10**9, "native_steps": [rep(40, 32), rep(41, None)],
           "ours_steps": [rep(35, 25)]}
    text = tables.ttft_floor_table({"bandwidth": {"h2d_gbps": 50.0}, "tp": 2, "rows": [row]})
    assert [c.strip() for c in text.splitlines()[2].strip("|").split("|")][:4] == ["8,192", "20.0", "10.0", "30.0"]
    blind = {**row, "native_steps": [rep(40, None)]}  # no rep saw the load: no row, no error
    assert tables.ttft_floor_table({"bandwidth": {"h2d_gbps": 50.0}, "tp": 2, "rows": [blind]}) == ""


def test_part_ttft_reloads_variants_in_turn_and_compares_them_with_ours():
    from benchmarks.gpu_e2e import device

    procs = {"off": _TtftEngine("off", 0.01), "native": _TtftEngine("native", 0.03), "ours": _TtftEngine("ours", 0.025),
             "dgat": _TtftEngine("dgat", 0.02)}
    a = device.build_parser().parse_args(["ttft", "--ttft-lengths", "2048", "--reps", "3", "--off-reps", "1",
                                          "--variant", "dgat:NPU_OFFLOAD_STAGE_GATHER=dma"])
    res = device.part_ttft(procs, a)
    (row,) = res["rows"]
    assert res["variants"] == {"dgat": {"NPU_OFFLOAD_STAGE_GATHER": "dma"}}
    assert row["dgat_s"]["median"] == 0.02 and row["dgat_load_s"] == 0.004 and len(row["dgat_steps"]) == 3
    text = tables.ttft_table(res)
    assert "dgat - ours" in text and "dgat faster in 3/3" in text
    assert "dgat = ours with {'NPU_OFFLOAD_STAGE_GATHER': 'dma'}" in text


def test_part_ttft_without_off_takes_the_device_hit_on_ours(monkeypatch, tmp_path):
    """--no-off: room for layerwise beside native and ours; cold and hit come from ours, stores flushed first."""
    from benchmarks.gpu_e2e import device

    seen = {}
    _fake_pool(monkeypatch, device, seen)
    a = device.build_parser().parse_args(["ttft", "--no-off", "--layerwise", "--ttft-lengths", "2048", "--reps", "3",
                                          "--off-reps", "1"])
    device.start_pool(tmp_path, a, "perlayer", ["ttft"])
    assert [s.label for s in seen["specs"]] == ["native", "ours", "layerwise"]
    calls = []

    class Ours(_TtftEngine):
        def call(self, op, **kw):
            calls.append((op, kw.get("reset")))
            return super().call(op, **kw)

    procs = {"native": _TtftEngine("native", 0.03), "ours": Ours("ours", 0.025), "layerwise": _TtftEngine("layerwise", 0.02)}
    res = device.part_ttft(procs, a)
    assert res["hit_engine"] == "ours" and res["rows"][0]["device_hit_s"]["n"] == 1
    # cold generate, flush without a reset, device-hit generate (twice: one warm-up rep)
    assert calls[1:7] == [("generate", None), ("flush_reset", False), ("generate", None)] * 2
    assert "--no-off" in tables.ttft_table(res)
    assert device.main(["miss", "--no-off", "--out", str(tmp_path / "o")]) == 2


def test_part_ttft_with_a_suffix_times_the_same_new_request_for_every_kind():
    """--ttft-suffix: every timed request is the stored prompt plus new tokens, the same for each kind
    in a rep and new in every rep; the device hit is timed with a suffix too."""
    from benchmarks.gpu_e2e import device

    seen: dict = {}

    class Rec(_TtftEngine):
        def call(self, op, **kw):
            if op == "generate":
                seen.setdefault(self.kind, []).append(kw["prompts"][0])
            return super().call(op, **kw)

    procs = {k: Rec(k, w) for k, w in (("off", 0.01), ("native", 0.03), ("ours", 0.025), ("layerwise", 0.02))}
    a = device.build_parser().parse_args(["ttft", "--ttft-lengths", "2048", "--reps", "3", "--off-reps", "1",
                                          "--ttft-suffix", "256"])
    res = device.part_ttft(procs, a)
    assert res["rows"][0]["suffix_tokens"] == 256
    off = seen["off"]  # (cold, hit) for the warm-up rep and one timed rep
    assert [len(x) for x in off] == [2048, 2048 + 256] * 2 and off[1][:2048] == off[0]
    for kind in ("native", "ours", "layerwise"):
        first, *reloads = seen[kind]
        assert len(first) == 2048 and [len(x) for x in reloads] == [2048 + 256] * 4
        assert all(x[:2048] == first for x in reloads)
        assert len({tuple(x[2048:]) for x in reloads}) == 4  # warm-up + 3 reps, each suffix new
    assert [x[2048:] for x in seen["ours"][2:]] == [x[2048:] for x in seen["native"][2:]]
    assert "prompt tok (+256 new)" in tables.ttft_table(res)


def test_pool_fit_refuses_what_ran_out_of_memory_on_the_h200():
    """Both pools that ran out of GPU memory at start on an H200 (2026-11-26) are refused before any
    engine starts; the pools that ran there pass."""
    from benchmarks.gpu_e2e import device

    h200 = 150_754_820_096
    args = lambda *xs: device.build_parser().parse_args(list(xs))  # noqa: E731
    with pytest.raises(device.PlanError, match=r"5 engines \(off, native, ours, layerwise, dstore\).*separate calls"):
        device.check_pool_fits("uniform", args("ttft", "miss", "--layerwise", "--variant", "dstore:X=0"),
                               ["ttft", "miss"], h200)
    with pytest.raises(device.PlanError, match="4 engines"):
        device.check_pool_fits("uniform", args("miss", "--variant", "dstore:X=0"), ["miss"], h200)
    device.check_pool_fits("perlayer", args("miss"), ["miss"], h200)
    device.check_pool_fits("perlayer", args("ttft", "--layerwise"), ["ttft"], h200)
    device.check_pool_fits("multigroup", args("ttft"), ["ttft"], h200)
    device.check_pool_fits("uniform", args("ttft", "--layerwise", "--no-off"), ["ttft"], 85_520_809_984)  # H100
    with pytest.raises(device.PlanError):
        device.check_pool_fits("uniform", args("ttft", "--layerwise"), ["ttft"], 85_520_809_984)


def test_timeline_without_gpu_events_for_tensor_parallel(monkeypatch):
    """TP > 1: the model runs in worker processes; no CUDA events are wrapped around the executor."""
    import sys
    from types import ModuleType, SimpleNamespace as NS

    from benchmarks.gpu_e2e import timeline

    kt = ModuleType("vllm.distributed.kv_transfer")
    kt.get_kv_transfer_group, kt.has_kv_transfer_group = (lambda: None), (lambda: False)
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer", kt)
    asked = []
    monkeypatch.setattr(timeline, "_wrap_gpu", lambda obj, name, what: asked.append(what) or True)
    core = _FakeCore(NS(start_load_kv=lambda ctx: None, get_finished=lambda ids: (set(), set())))
    llm = NS(llm_engine=NS(engine_core=NS(engine_core=core)))
    import gc

    n_callbacks = len(gc.callbacks)
    monkeypatch.setattr(timeline, "_installed", False)
    done = timeline.install(llm, gpu_events=False)
    assert "execute" in done and not any(d.startswith("gpu_") for d in done) and asked == []
    monkeypatch.setattr(timeline, "_installed", False)
    assert "gpu_execute" in timeline.install(llm) and asked  # one GPU: the events are wanted
    del gc.callbacks[n_callbacks:]


def test_thread_cpu_sees_a_busy_thread_and_the_table_names_it():
    import threading as th

    from benchmarks.gpu_e2e import timeline

    stop = th.Event()

    def spin():
        with open(f"/proc/self/task/{th.get_native_id()}/comm", "w") as f:
            f.write("spinner")  # the OS thread name /proc reports (Python's own name is not it)
        while not stop.is_set():
            sum(range(1000))

    t = th.Thread(target=spin, name="spinner")
    before = timeline.thread_cpu()
    t.start()
    time.sleep(0.3)
    after = timeline.thread_cpu()  # while it lives: /proc lists living threads only
    stop.set()
    t.join()
    d = timeline.thread_cpu_delta(before, after, th.get_native_id())
    assert timeline.thread_cpu_delta(before, timeline.thread_cpu(), th.get_native_id())["others_ms"] >= 30  # ended
    assert d["others_ms"] >= 30 and d["busiest"][0][0] == "spinner" and d["main_ms"] < d["others_ms"]
    text = tables.thread_cpu_table({"ours": [d, d], "off": [{"main_ms": 5.0, "others_ms": 0.0, "threads": 3,
                                                            "busiest": []}]})
    assert "spinner" in text and "| off " in text and " - |" in text
    assert tables.thread_cpu_table({}) == ""


FAKE_SMI = """#!/bin/sh
# nvidia-smi -lms stand-in: a sample every 20 ms until stopped, with one unreadable field and a header-like line
echo "clocks.sm [MHz], clocks.mem [MHz], power.draw [W], temperature.gpu"
while true; do echo "1980, 3201, 450.5, [N/A]"; sleep 0.02; done
"""


def test_clock_sampler_reads_samples_and_summarizes_the_tail(tmp_path):
    from benchmarks.gpu_e2e import gpu_clocks

    assert gpu_clocks.parse_line("1755, 2619, 312.40, 41") == {"sm_mhz": 1755.0, "mem_mhz": 2619.0, "power_w": 312.4,
                                                                "temp_c": 41.0}
    assert gpu_clocks.parse_line("[N/A], 2619, 312.40, 41")["mem_mhz"] == 2619.0
    assert gpu_clocks.parse_line("garbage") is None and gpu_clocks.parse_line("a, b, c, d") is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    with gpu_clocks.ClockSampler(command=str(smi)) as s:
        time.sleep(0.4)
    out = s.summary(tail_s=0.1)
    assert out["samples"] >= 3 and out["all_sm_mhz"] == 1980.0 and out["tail_power_w"] == 450.5
    assert out["all_temp_c"] is None  # never readable
    with gpu_clocks.ClockSampler(command=str(tmp_path / "absent")) as none:
        pass
    assert none.summary(0.1) == {"samples": 0, **{f"{p}_{n}": None for p in ("all", "tail") for n in gpu_clocks.NAMES}}


def test_part_miss_records_clocks_when_nvidia_smi_answers(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks.gpu_e2e import device

    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    class Proc:
        def __init__(self, kind):
            self.spec, self.error = SimpleNamespace(kind=kind), None

        def call(self, op, **kw):
            if op == "worker_info":
                return {}
            time.sleep(0.15)
            return {"wall_s": 1.0, "totals": {}, "step_rows": [], "store_s": 0.0, "store_bytes": 0}

    a = device.build_parser().parse_args(["miss", "--miss-reps", "1"])
    res = device.part_miss({"off": Proc("off"), "ours": Proc("ours")}, a)
    assert len(res["clocks"]["ours"]) == 1 and res["clocks"]["ours"][0]["all_sm_mhz"] == 1980.0
    text = tables.clock_table(res["clocks"])
    assert "| ours " in text and "1,980" in text and "450" in text
    assert tables.clock_table({}) == ""


def _serve_doc(passes):
    """A serve.json as device.py writes it: per pass, each server's summary."""
    runs = []
    for k, (ours, native) in enumerate(passes):
        for label, (rps, ttft, tpot) in (("ours", ours), ("native", native)):
            runs.append({"label": label, "pass_": k, "summary": {
                "requests": 10, "requests_per_s": rps, "ttft_later_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot}}})
    return {"runs": [{"layout": "perlayer", "load": {"clients": 32}, "runs": runs},
                     {"layout": "uniform", "load": {"clients": 32}, "runs": runs[:2]}]}


def test_serve_passes_pool_paired_within_each_pass(tmp_path):
    import gzip

    a = _serve_doc([((21.0, 90.0, 12.0), (20.0, 100.0, 12.5)), ((19.0, 110.0, 13.0), (20.0, 100.0, 13.0))])
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(a).encode()))
    doc = _serve_doc([((22.0, 80.0, 11.0), (20.0, 100.0, 11.0))])
    doc["runs"][0]["runs"] += [
        {"label": "ours", "pass_": 1, "summary": {  # native never ran pass 1
            "requests": 10, "requests_per_s": 99.0, "ttft_later_ms": {"p50": 1.0}, "tpot_ms": {"p50": 1.0}}},
        {"label": "ours", "pass_": 2, "error": "server died", "summary": {"requests": 10, "requests_per_s": 1.0}},
        {"label": "native", "pass_": 2, "summary": {  # ours failed pass 2
            "requests": 10, "requests_per_s": 20.0, "ttft_later_ms": {"p50": 1.0}, "tpot_ms": {"p50": 1.0}}}]
    (tmp_path / "b.json").write_text(json.dumps(doc))
    pa = tables.serve_pass_pairs(tmp_path / "a.json.gz", "perlayer", 32, "ours", "native")
    pb = tables.serve_pass_pairs(tmp_path / "b.json", "perlayer", 32, "ours", "native")
    assert [round(p["req/s"], 4) for p in pa] == [0.05, -0.05] and [p["later TTFT p50"] for p in pa] == [0.9, 1.1]
    assert len(pb) == 1 and round(pb[0]["req/s"], 4) == 0.1  # the unpaired and the failed pass add nothing
    assert tables.serve_pass_pairs(tmp_path / "b.json", "perlayer", 8, "ours", "native") == []
    later = tables.serve_pass_pairs(tmp_path / "a.json.gz", "perlayer", 32, "ours", "native", from_pass=1)
    assert [(p["pass"], round(p["req/s"], 4)) for p in later] == [(1, -0.05)]  # the first pass left out
    text, nums = tables.pooled_serve_table({"a": pa, "pooled": pa + pb})
    s = nums["pooled"]["req/s"]
    assert s["n"] == 3 and round(s["median"], 4) == 0.05 and round(s["mean"], 4) == round(0.1 / 3, 4)
    assert round(s["se"], 5) == round(statistics.stdev([0.05, -0.05, 0.1]) / 3 ** 0.5, 5)
    assert "median_lo" not in s  # 3 passes give no 95% interval of the median
    row = next(line for line in text.splitlines() if line.startswith("| pooled") and "req/s" in line)
    assert "+5.0%" in row and "1 of 3" in row  # one pass below native
    ttft = next(line for line in text.splitlines() if line.startswith("| pooled") and "TTFT" in line)
    assert "0.900x" in ttft and "1 of 3" in ttft  # one pass slower than native
    many = tables.pooled([float(x) for x in range(10)])
    assert (many["median_lo"], many["median_hi"]) == (1.0, 8.0)
