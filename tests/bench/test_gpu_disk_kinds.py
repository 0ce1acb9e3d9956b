"""The GPU yardstick's disk-tier servers and capacity load, planned on the CPU (no vLLM run)."""

import pytest

from benchmarks.gpu_e2e import serve
from benchmarks.gpu_e2e.engine import kv_transfer_config

H200, HOST = 143771 * (1 << 20), 126 << 30
GiB = 1 << 30


def test_disk_kinds_configs():
    ours = kv_transfer_config("ours-disk", 8 << 30, 64, None, "/d/ours-disk", 24 << 30)
    x = ours["kv_connector_extra_config"]
    assert x["spec_name"] == "NPUOffloadingSpec" and x["disk_path"] == "/d/ours-disk"
    assert x["disk_bytes_to_use"] == 24 << 30 and x["cpu_bytes_to_use"] == 8 << 30
    fs = kv_transfer_config("native-fs", 8 << 30, 64, None, "/d/native-fs")
    x = fs["kv_connector_extra_config"]
    assert x["spec_name"] == "TieringOffloadingSpec" and x["secondary_tiers"] == [{"type": "fs", "root_dir": "/d/native-fs"}]
    assert fs["kv_connector"] == "OffloadingConnector"


def test_capacity_load_plans_five_servers_on_one_h200():
    (load,) = serve.parse_loads("cap")
    assert load is serve.CAPACITY and load.capacity
    load.check()  # running requests need not fit device KV here
    names = ["off", "native", "native-fs", "ours", "ours-disk"]
    plans = serve.plan_servers("uniform", names, load, H200, HOST)
    per_tok = 128 << 10  # 8B shape, bf16
    assert {p.label: p.cpu_bytes for p in plans} == {
        "off": 0, "native": 8 << 30, "native-fs": 8 << 30, "ours": 8 << 30, "ours-disk": 8 << 30}
    assert all(p.device_kv_bytes == 4 << 30 for p in plans)
    working_set = load.conversations * load.final_context(load.prefix_avg) * per_tok
    assert working_set >= 3 * (8 << 30)  # the tiers' case: >= 3x host KV
    dirs = {p.label: p.disk_dir for p in plans}
    assert dirs["ours"] is None and dirs["ours-disk"].name == "ours-disk" and dirs["native-fs"].name == "native-fs"
    assert plans[-1].kv_config()["kv_connector_extra_config"]["disk_path"] == str(dirs["ours-disk"])


def test_disk_variants_change_only_their_keys():
    (load,) = serve.parse_loads("cap")
    plans = serve.plan_servers("uniform", ["ours-disk", "ours-disk/q2.5", "ours-disk/reuse"], load, H200, HOST)
    x = {p.label: p.kv_config()["kv_connector_extra_config"] for p in plans}
    assert "disk_read_queue_s" not in x["ours-disk"] and x["ours-disk/q2.5"]["disk_read_queue_s"] == 2.5
    assert x["ours-disk/reuse"]["disk_admit"] == "reuse"
    assert x["ours-disk/q2.5"]["disk_path"].endswith("ours-disk-q2.5")  # each its own folder
    for bad in ("ours-disk/q9", "native-fs/q2.5", "ours/q2.5"):
        try:
            serve.plan_servers("uniform", [bad], load, H200, HOST)
        except serve.PlanError as e:
            assert "ours-disk/{" in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_the_pool_adds_ours_with_its_disk_tier_for_the_no_reuse_cost(monkeypatch, tmp_path):
    """``miss --disk --no-native``: off, ours and ours + disk in one pool (fits one H200); ours-disk's
    engine gets its own emptied folder and the disk budget, through NPUOffloadingConnector."""
    from test_gpu_e2e import _fake_pool

    from benchmarks.gpu_e2e import device

    seen = {}
    _fake_pool(monkeypatch, device, seen)
    monkeypatch.setattr(device, "DISK_ROOT", tmp_path / "disk")
    stale = tmp_path / "disk" / "pool-ours-disk" / "old.r0"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    a = device.build_parser().parse_args(["miss", "--disk", "--no-native"])
    device.check_pool_fits("uniform", a, ["miss"], H200)
    device.start_pool(tmp_path, a, "uniform", ["miss"])
    specs = {s.label: s for s in seen["specs"]}
    assert list(specs) == ["off", "ours", "ours-disk"]
    assert specs["ours"].disk_dir is None and "disk_path" not in specs["ours"].llm_kwargs()["kv_transfer_config"][
        "kv_connector_extra_config"]
    kt = specs["ours-disk"].llm_kwargs()["kv_transfer_config"]
    assert kt["kv_connector"] == "NPUOffloadingConnector"
    x = kt["kv_connector_extra_config"]
    assert x["disk_path"] == str(tmp_path / "disk" / "pool-ours-disk") and x["disk_bytes_to_use"] == device.DISK_BYTES
    assert not stale.exists()  # an earlier call's records say nothing about this one's prompts
    with pytest.raises(serve.PlanError, match=r"4 engines \(off, native, ours, ours-disk\)"):
        device.check_pool_fits("uniform", device.build_parser().parse_args(["miss", "--disk"]), ["miss"], H200)


def test_disk_records_counted_by_rank_for_the_tensor_parallel_run(tmp_path):
    """At TP 2 every rank writes its own record of a key (``<key>.r<rank>``): the serve part reports
    each rank's files and bytes after each pass, and the table lists them for servers with two ranks."""
    from benchmarks.gpu_e2e import serve, tables

    fp = tmp_path / "ab12fingerprint"
    for key, sizes in {"aa01": (4096 + 100, 4096 + 100), "ab02": (4096 + 300, 4096 + 300),
                       "ac03": (4096 + 50,)}.items():
        (fp / key[:2]).mkdir(parents=True, exist_ok=True)
        for rank, size in enumerate(sizes):
            (fp / key[:2] / f"{key}.r{rank}").write_bytes(b"x" * size)
    (fp / "aa" / "aa09.r1.tmp.123").write_bytes(b"x" * 7)  # a write in flight: not a record
    (tmp_path / "README").write_text("not ours")
    assert serve.disk_ranks(tmp_path) == {0: {"files": 3, "bytes": 3 * 4096 + 450},
                                          1: {"files": 2, "bytes": 2 * 4096 + 400}}
    assert serve.disk_ranks(tmp_path / "gone") == {} and serve.disk_ranks(None) == {}
    runs = [{"label": "ours-disk", "pass_": p, "disk_ranks_now": serve.disk_ranks(tmp_path)} for p in (1, 0)]
    runs.append({"label": "ours-disk-tp1", "pass_": 0, "disk_ranks_now": {0: {"files": 1, "bytes": 10}}})
    line = tables.disk_rank_lines({"runs": runs})
    assert line == ("ours-disk disk records by rank, after each pass: pass 0: r0 3 files 0.0 GB, r1 2 files 0.0 GB; "
                    "pass 1: r0 3 files 0.0 GB, r1 2 files 0.0 GB")


def test_the_capacity_bound_holds_every_conversation_in_host():
    """``ours/allhost``: ours with host KV for every conversation of a pass (the issue's capacity bound),
    beside 8 GiB for the others; refused rather than cut when the call's servers cannot pin it all."""
    from benchmarks.gpu_e2e.kv_layouts import LAYOUTS

    (load,) = serve.parse_loads("cap")
    per_tok = LAYOUTS["uniform"].model.kv_bytes_per_token()
    plans = serve.plan_servers("uniform", ["ours", "ours-disk", "ours/allhost"], load, 80 * GiB, HOST)
    cpu = {p.label: p.cpu_bytes for p in plans}
    assert cpu["ours/allhost"] == load.upper_tokens * per_tok > 3 * cpu["ours"] and cpu["ours"] == 8 * GiB
    kv = plans[2].kv_config()["kv_connector_extra_config"]
    assert kv["cpu_bytes_to_use"] == cpu["ours/allhost"] and "disk_path" not in kv and plans[2].env == ()
    with pytest.raises(serve.PlanError, match="ours/allhost needs"):
        serve.plan_servers("uniform", ["ours", "ours-disk", "native", "ours/allhost"], load, 0, 90 * GiB)
    with pytest.raises(serve.PlanError, match="variants"):
        serve.plan_servers("uniform", ["native/allhost"], load, 0, HOST)
