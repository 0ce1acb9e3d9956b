"""The GPU yardstick's disk-tier servers and capacity load, planned on the CPU (no vLLM run)."""

from benchmarks.gpu_e2e import serve
from benchmarks.gpu_e2e.engine import kv_transfer_config

H200, HOST = 143771 * (1 << 20), 126 << 30


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
