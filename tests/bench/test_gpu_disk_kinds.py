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


def test_lmcache_servers_config_env_and_path(monkeypatch):
    (load,) = serve.parse_loads("cap")
    plans = {p.label: p for p in serve.plan_servers("uniform", ["ours", "lmcache", "lmcache-disk"], load, H200, HOST)}
    lm, lmd = plans["lmcache"], plans["lmcache-disk"]
    assert lm.kv_config() == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}  # no use_native
    assert lm.cpu_bytes == plans["ours"].cpu_bytes == 8 << 30 and lm.disk_dir is None
    env = dict(lm.env)
    assert env == {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True",
                   "LMCACHE_MAX_LOCAL_CPU_SIZE": "8.00"}
    denv = dict(lmd.env)
    assert denv["LMCACHE_LOCAL_DISK"] == f"file://{lmd.disk_dir}/" and lmd.disk_dir.name == "lmcache-disk"
    assert denv["LMCACHE_MAX_LOCAL_DISK_SIZE"] == f"{serve.DISK_BYTES / (1 << 30):.1f}"
    monkeypatch.setenv("PYTHONPATH", "/repo:/tmp/site")
    assert serve.server_env(lm, {"A": "1"})["PYTHONPATH"] == f"/repo:/tmp/site:{serve.LMCACHE_SITE}"
    assert "PYTHONPATH" not in serve.server_env(plans["ours"], {"A": "1"})  # only LMCache servers see it
    assert serve.server_env(lm, {"A": "1"})["A"] == "1"


LMC_LOG = """\
(EngineCore pid=9) [2026-11-28 23:40:01,123] LMCache INFO: Reqid: chatcmpl-1, Total tokens 4120, Inference Engine computed tokens: 1504, LMCache hit tokens: 1536, need to load: 32 (vllm_v1_adapter.py:1475:lmcache.integration.vllm.vllm_v1_adapter)
(EngineCore pid=9) [2026-11-28 23:40:02,456] LMCache INFO: Reqid: chatcmpl-2, Total tokens 5000, Inference Engine computed tokens: 4096, LMCache hit tokens: 4352, need to load: 256 (vllm_v1_adapter.py:1475:lmcache.integration.vllm.vllm_v1_adapter)
(EngineCore pid=9) [2026-11-28 23:40:03,000] LMCache INFO: Reqid: chatcmpl-3, Total tokens 900, Inference Engine computed tokens: 0, LMCache hit tokens: 0, need to load: -1 (vllm_v1_adapter.py:1475)
"""


def test_lmcache_pass_counts_from_its_log_and_fails_without_loads(tmp_path):
    assert serve.lmcache_log_info(LMC_LOG) == {"lookups": 3, "hit_tokens": 5888, "loaded_tokens": 288,
                                               "degraded": False}
    log, seen = tmp_path / "lm.log", {}
    log.write_text(LMC_LOG)
    run = {}
    serve.lmcache_pass(run, log, seen)
    assert run["lmcache"] == {"lookups": 3, "hit_tokens": 5888, "loaded_tokens": 288, "degraded": False}
    assert "error" not in run
    log.write_text(LMC_LOG + LMC_LOG.splitlines()[2] + "\n")  # the next pass: one lookup, nothing loaded
    run2 = {}
    serve.lmcache_pass(run2, log, seen)
    assert run2["lmcache"]["lookups"] == 1 and "loaded no token" in run2["error"]
    log.write_text(LMC_LOG + "LMCache ERROR: ... System will operate in degraded mode (recompute).\n")
    run3 = {}
    serve.lmcache_pass(run3, log, {})
    assert "degraded mode" in run3["error"]
