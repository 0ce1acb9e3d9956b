"""LMCache in the GPU yardstick (server kinds lmcache / lmcache-disk, the --lmcache engines, staging its
wheels), planned, parsed and packed on the CPU: no GPU, no vLLM, no LMCache."""

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.gpu_e2e import engine, lmcache_log, serve, stage, tables

ROOT = Path(__file__).resolve().parents[2]
H200, HOST = 143771 * (1 << 20), 126 << 30
GiB = 1 << 30
LMC_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True"}

# LMCache 0.5.3's own lines (its formatter colours them, in a log file too), as its vLLM adapter and manager
# write them: a lookup that loads, one below min_retrieve, one not answered yet, a failed start
_C = "\x1b[32;20m[2026-11-28 19:40:{:02d},345] LMCache INFO:\x1b[0m "
_TAIL = " \x1b[3m(vllm_v1_adapter.py:1474:lmcache.integration.vllm.vllm_v1_adapter)\x1b[0m"


def hit_line(req: str, total: int, computed: int, hit: int, load: int, sec: int = 1) -> str:
    return (_C.format(sec) + f"Reqid: {req}, Total tokens {total}, Inference Engine computed tokens: {computed}, "
            f"LMCache hit tokens: {hit}, need to load: {load}" + _TAIL)


def retrieved_line(req: str, tokens: int, total: int, sec: int = 2) -> str:
    """LMCache 0.5.3's cache engine after a retrieve (cache_engine.py:958), as a GPU run's log held it."""
    return (_C.format(sec) + f"[req_id={req}] Retrieved {tokens} out of {tokens} required tokens (from {total} total "
            f"tokens). size: 0.0625 gb, cost 2.0679 ms, throughput: 30.2233 GB/s; "
            "\x1b[3m(cache_engine.py:958:lmcache.v1.cache_engine)\x1b[0m")


# and as a GPU run's server log held them (2026-11-28, lmcache-disk, 32 clients): vLLM's engine-core prefix
SERVED = """\
(EngineCore pid=1550) [2026-11-28 23:48:27,536] LMCache INFO: Reqid: chatcmpl-9a4c655c743b2d99-90eb0ac8, Total \
tokens 5468, Inference Engine computed tokens: 5328, LMCache hit tokens: 5120, need to load: 0 \
(vllm_v1_adapter.py:1473:lmcache.integration.vllm.vllm_v1_adapter)
(EngineCore pid=1550) [2026-11-28 23:48:27,746] LMCache INFO: Reqid: chatcmpl-b62b817357db654b-abf3611f, Total \
tokens 3770, Inference Engine computed tokens: 1024, LMCache hit tokens: 3584, need to load: 2560 \
(vllm_v1_adapter.py:1473:lmcache.integration.vllm.vllm_v1_adapter)
(EngineCore pid=1550) [2026-11-28 23:48:27,845] LMCache INFO: Reqid: chatcmpl-b62b817357db654b-abf3611f, Total \
tokens 3770, Inference Engine computed tokens: 1024, LMCache hit tokens: 3584, need to load: 2560 \
(vllm_v1_adapter.py:1473:lmcache.integration.vllm.vllm_v1_adapter)
(APIServer pid=1284) INFO 11-28 23:48:28 [loggers.py:259] Engine 000: Avg prompt throughput: 6123.4 tokens/s
"""


BELOW_MIN = (_C.format(3) + "Reqid: chatcmpl-77-0, Total tokens 900, Inference Engine computed tokens: 768, LMCache "
             "hit tokens: 768, but need to load: 0 < min_retrieve 256, skip retrieve but record for save skip" + _TAIL)
UNANSWERED = "Reqid: chatcmpl-78-0, Total tokens 700, Inference Engine computed tokens: 0, LMCache hit tokens: None."
DEGRADED = ("\x1b[31;20m[2026-11-28 19:39:58,101] LMCache ERROR:\x1b[0m Failed to initialize LMCacheManager "
            "components: Traceback (most recent call last):\n  File \"/tmp/site_lmcache/lmcache/v1/manager.py\", line "
            "90, in __init__\nRuntimeError: CUDA error: invalid argument\n. System will operate in degraded mode "
            "(recompute). \x1b[3m(manager.py:107:lmcache.v1.manager)\x1b[0m")
VLLM_LINES = ("INFO 11-28 19:39:50 [gpu_model_runner.py:4210] GPU KV cache size: 32,768 tokens\n"
              "INFO 11-28 19:39:51 [lmcache_connector.py:107] Initializing latest dev LMCache connector\n")


# ---------------------------------------------------------------------------- kinds, plans, configs
def test_lmcache_kinds_parse_and_plan_like_the_other_offloaders():
    (load,) = serve.parse_loads("cap")
    names = ["off", "ours", "ours-disk", "native-fs", "lmcache", "lmcache-disk"]
    plans = serve.plan_servers("uniform", names, load, H200, HOST)
    by = {p.label: p for p in plans}
    assert {p.label: p.cpu_bytes for p in plans} == {"off": 0, **{k: 8 * GiB for k in names[1:]}}
    assert by["lmcache"].disk_dir is None and by["lmcache-disk"].disk_dir == serve.DISK_ROOT / "lmcache-disk"
    assert by["ours"].env == () and by["ours-disk"].env == ()
    assert dict(by["lmcache"].env) == {**LMC_ENV, "LMCACHE_MAX_LOCAL_CPU_SIZE": "8.000"}
    assert dict(by["lmcache-disk"].env) == {
        **LMC_ENV, "LMCACHE_MAX_LOCAL_CPU_SIZE": "8.000",
        "LMCACHE_LOCAL_DISK": f"file://{serve.DISK_ROOT}/lmcache-disk/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": f"{serve.DISK_BYTES / GiB:.3f}"}
    for label in ("lmcache", "lmcache-disk"):
        assert by[label].kv_config() == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}  # no use_native
        args = serve.server_args(by[label], load, eager=False, attention_backend="TRITON_ATTN", chat_template="t",
                                 served_name="m")
        assert json.loads(args[args.index("--kv-transfer-config") + 1]) == by[label].kv_config()
    # the host bytes follow the plan's cap, as for the others; LMCache's size is per rank with tensor parallelism
    small = serve.plan_servers("uniform", ["ours", "lmcache"], serve.LOADS[32], H200, 40 * GiB, tp=2)
    assert small[0].cpu_bytes == small[1].cpu_bytes < serve.LOADS[32].host_tokens * (128 << 10)
    gib = int(small[1].cpu_bytes / 2 / GiB * 1000) / 1000
    assert dict(small[1].env)["LMCACHE_MAX_LOCAL_CPU_SIZE"] == f"{gib:.3f}"


def test_lmcache_kinds_refused_where_they_cannot_run():
    for bad, why in (("perlayer:lmcache", "another layout's connector"), ("lmcache/dstore", "variants"),
                     ("lmcache-disk/q2.5", "variants")):
        with pytest.raises(serve.PlanError, match=why):
            serve.plan_servers("uniform", [bad], serve.LOADS[8], 0, 0)


def test_kv_transfer_config_and_engine_env():
    for kind in ("lmcache", "lmcache-disk"):
        assert engine.kv_transfer_config(kind, 5 * GiB, 64) == {"kv_connector": "LMCacheConnectorV1",
                                                                "kv_role": "kv_both"}
    assert engine.lmcache_env(3 * GiB) == {**LMC_ENV, "LMCACHE_MAX_LOCAL_CPU_SIZE": "3.000"}
    assert engine.lmcache_env(3 * GiB, 2, "/d/x", 24 * GiB) == {
        **LMC_ENV, "LMCACHE_MAX_LOCAL_CPU_SIZE": "1.500", "LMCACHE_LOCAL_DISK": "file:///d/x/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "12.000"}
    assert engine.lmcache_path("/repo:/tmp/site") == f"/repo:/tmp/site:{stage.LMCACHE_SITE}"
    assert engine.lmcache_path(f"/repo:{stage.LMCACHE_SITE}:/tmp/site") == f"/repo:/tmp/site:{stage.LMCACHE_SITE}"
    spec = engine.EngineSpec("lmcache", "lmcache", "m", cpu_bytes=2 * GiB)
    assert spec.llm_kwargs()["kv_transfer_config"] == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    env = spec.child_env()
    assert {k: env[k] for k in LMC_ENV} == LMC_ENV and env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "2.000"
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == str(stage.LMCACHE_SITE)
    path = ["/x/run", "/repo", "/tmp/site", "/usr/lib/python3.12", "/usr/lib/python3/dist-packages"]
    engine.add_to_sys_path(f"/repo:/tmp/site:{stage.LMCACHE_SITE}", path)  # as the engine process does
    assert path == ["/x/run", "/repo", "/tmp/site", str(stage.LMCACHE_SITE), "/usr/lib/python3.12",
                    "/usr/lib/python3/dist-packages"]  # where PYTHONPATH would have put it: as the servers
    ours = engine.EngineSpec("ours", "ours", "m", env={"A": "1"})
    assert ours.child_env() == {"A": "1"}  # LMCache's folder and variables for LMCache engines only


def test_pythonpath_has_lmcache_only_for_its_servers(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/repo:/tmp/site")
    plans = serve.plan_servers("uniform", ["off", "native", "ours", "lmcache", "lmcache-disk"], serve.LOADS[8], 0, 0)
    base = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    for p in plans:
        env = serve.server_env(p, base)
        if p.kind.startswith("lmcache"):
            assert env["PYTHONPATH"] == f"/repo:/tmp/site:{stage.LMCACHE_SITE}"  # after vLLM's site
            assert env["LMCACHE_CHUNK_SIZE"] == "256" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
        else:
            assert "PYTHONPATH" not in env and not any(k.startswith("LMCACHE_") for k in env)


def test_variants_set_only_variables_the_package_reads():
    from vllm_npu_offload.env import KNOBS

    assert set(serve.VARIANTS) == {"dstore", "sstore", "dload"}
    assert all(var in KNOBS for env in serve.VARIANTS.values() for var in env)


# ---------------------------------------------------------------------------- LMCache's log
def test_lmcache_log_lines_parsed():
    text = "\n".join([VLLM_LINES, hit_line("chatcmpl-1-0", 1800, 0, 1536, 1536),
                      hit_line("chatcmpl-2-0", 2900, 1024, 2816, 1792),
                      hit_line("chatcmpl-2-0", 2900, 1024, 2816, 1792, 5),  # looked up again while waiting: once
                      retrieved_line("chatcmpl-1-0", 1536, 1536), retrieved_line("chatcmpl-2-0", 2048, 2816),
                      BELOW_MIN, UNANSWERED, "LMCache hit tokens:   512"])
    info = lmcache_log.log_info(text)
    assert info == {"lookups": 4, "hit_tokens": 1536 + 2816 + 768 + 512, "loaded_tokens": 1536 + 1792,
                    "retrieved_tokens": 1536 + 2048, "unretrieved": [], "degraded": False}
    assert lmcache_log.failure(info) is None
    # a request the server's log promised 2,560 tokens and never retrieved: no number
    assert lmcache_log.log_info(SERVED) == {"lookups": 2, "hit_tokens": 5120 + 3584, "loaded_tokens": 2560,
                                              "retrieved_tokens": 0, "unretrieved": ["chatcmpl-b62b817357db654b-abf3611f"],
                                              "degraded": False}  # the request looked up twice counts once
    why = lmcache_log.failure(lmcache_log.log_info(SERVED))
    assert "promised tokens to 1 request(s) and logged no retrieve" in why and "chatcmpl-b62b817357db654b-abf3611f" in why
    assert lmcache_log.log_info(VLLM_LINES + DEGRADED)["degraded"] is True
    assert "degraded mode" in lmcache_log.failure({**info, "degraded": True})
    assert "no lookup" in lmcache_log.failure(lmcache_log.log_info(VLLM_LINES))
    zero = lmcache_log.log_info(hit_line("a", 900, 0, 0, 0) + "\n" + hit_line("b", 900, 0, 0, 0))
    assert zero["lookups"] == 2 and "no hit tokens" in lmcache_log.failure(zero)
    on_device = lmcache_log.log_info(hit_line("a", 900, 768, 768, 0))  # hits the device still held: a number
    assert on_device["loaded_tokens"] == 0 and lmcache_log.failure(on_device) is None
    assert serve.server_log_info(VLLM_LINES + DEGRADED)["lmcache"]["degraded"] is True
    assert "lmcache" not in serve.server_log_info("GPU KV cache size: 1,024 tokens")


def test_lmcache_pass_reads_only_what_the_log_gained(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(VLLM_LINES + hit_line("w-0", 700, 0, 512, 512) + "\n")  # the warm-up's lookups
    off = log.stat().st_size
    with open(log, "a") as f:
        f.write(hit_line("c-1", 2000, 0, 1792, 1792) + "\n")
    info, off2 = lmcache_log.read_pass(log, off)
    assert (info["lookups"], info["hit_tokens"], info["loaded_tokens"], info["degraded"]) == (1, 1792, 1792, False)
    assert info["unretrieved"] == ["c-1"] and info["retrieved_tokens"] == 0  # its retrieve is not in the log yet
    info, _ = lmcache_log.read_pass(log, off2)  # a pass that added nothing: no LMCache number
    assert info["lookups"] == 0 and lmcache_log.failure(info)
    with open(log, "a") as f:
        f.write(hit_line("c-2", 2000, 0, 1792, 1792) + "\n")
    log.write_text(DEGRADED + "\n" + log.read_text())  # degraded anywhere in the log fails every pass
    assert lmcache_log.read_pass(log, off2)[0]["degraded"]
    assert lmcache_log.read_pass(tmp_path / "none.log", 0)[0]["lookups"] == 0


# ---------------------------------------------------------------------------- run_serve with fake servers
def _client(tmp_path):
    from test_gpu_yard import _args, _fake_client

    return _args(_fake_client(tmp_path), passes=2, smoke=True, smoke_layers=2)


def test_run_serve_lmcache_passes_hits_and_failures(tmp_path, monkeypatch):
    from fake_openai import FakeVLLM

    from benchmarks.multiturn import launcher

    monkeypatch.setenv("PYTHONPATH", "/repo:/tmp/site")
    monkeypatch.setattr(serve, "DISK_ROOT", tmp_path / "disk")
    monkeypatch.setattr(serve, "DISK_BYTES", 1 << 20)
    monkeypatch.setattr(stage, "lmcache_ready", lambda target=None: True)
    envs, logs = {}, {}

    @contextlib.contextmanager
    def fake_server(model, args, *, label, env, log_path, **kw):
        envs[label], logs[label] = env, Path(log_path)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(log_path).write_text(VLLM_LINES if label.startswith("lmcache") else VLLM_LINES.splitlines()[0] + "\n")
        with FakeVLLM(args[args.index("--served-model-name") + 1]) as url:
            yield url

    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    real_run_one = serve.run_one
    disk_seen = []

    def spy(label, url, model, served, wl, load, a, run_dir, seed, timeout):
        out = real_run_one(label, url, model, served, wl, load, a, run_dir, seed, timeout)
        if label == "lmcache-disk":
            disk_seen.append(sorted(p.name for p in (tmp_path / "disk" / "lmcache-disk").iterdir()))
            (tmp_path / "disk" / "lmcache-disk" / f"chunk{seed}.pt").write_bytes(b"x" * 10)  # LMCache's files
        if label.startswith("lmcache"):  # pass 0: hits; pass 1: lmcache silent (as if it had stopped looking up)
            with open(logs[label], "a") as f:
                if seed == 0:
                    f.write(hit_line(f"{label}-{seed}", 2000, 256, 1792, 1536) + "\n"
                            + retrieved_line(f"{label}-{seed}", 1536, 2000) + "\n")
        return out

    monkeypatch.setattr(serve, "run_one", spy)
    load = serve.Load(clients=2, active=4, conversations=2, user_turns=2, device_tokens=4096, host_tokens=8192,
                      prefix_avg=600, prefix_max=900)
    res = serve.run_serve("uniform", load, ["off", "ours", "lmcache", "lmcache-disk"], _client(tmp_path),
                          tmp_path / "w", tmp_path / "o", serve.Budget(600), H200, HOST)
    assert not res["errors"]
    assert envs["lmcache"]["PYTHONPATH"] == envs["lmcache-disk"]["PYTHONPATH"] == f"/repo:/tmp/site:{stage.LMCACHE_SITE}"
    assert "PYTHONPATH" not in envs["ours"] and "PYTHONPATH" not in envs["off"]
    assert envs["lmcache-disk"]["LMCACHE_LOCAL_DISK"] == f"file://{tmp_path / 'disk' / 'lmcache-disk'}/"
    assert envs["lmcache-disk"]["LMCACHE_MAX_LOCAL_DISK_SIZE"] == "0.000" and res["disk_need"] == {"lmcache-disk": 1 << 20}
    assert disk_seen == [[], ["chunk0.pt"]]  # fresh at the start, not emptied under LMCache between passes
    runs = {(r["label"], r["pass_"]): r for r in res["runs"]}
    assert runs[("lmcache", 0)]["lmcache"] == {"lookups": 1, "hit_tokens": 1792, "loaded_tokens": 1536,
                                               "retrieved_tokens": 1536, "unretrieved": [], "degraded": False}
    assert "failed" not in runs[("lmcache", 0)]
    assert "no lookup" in runs[("lmcache", 1)]["failed"] and "no lookup" in runs[("lmcache-disk", 1)]["failed"]
    assert not any("lmcache" in r or "failed" in r for r in res["runs"] if not r["label"].startswith("lmcache"))
    assert res["server_logs"]["lmcache"]["lmcache"]["lookups"] == 1  # the logs as they were after the passes
    assert "lmcache" not in res["server_logs"]["ours"]
    text = tables.serve_table({"runs": [res]})
    rows = {c[0]: c for c in ([x.strip() for x in ln.split("|")[1:-1]] for ln in text.splitlines()
                              if ln.startswith("| "))}
    assert rows["lmcache"][1] == "1" and rows["lmcache"][-1].startswith("FAILED in 1 pass(es): LMCache's log reports")
    assert rows["ours"][1] == "2" and rows["ours"][-1] == ""
    assert "LMCache lmcache-disk (max_local_cpu_size" in text and "pass 0: hit 1,792 / to load 1,536 / retrieved 1,536 tokens" in text
    assert "pass 1: FAILED (LMCache's log reports no lookup" in text
    assert "lmcache vs off" in text  # paired over the passes that count only
    # the device part's verdict: a failed LMCache pass fails the part
    from benchmarks.gpu_e2e import device

    monkeypatch.setattr(device, "run_serve", lambda *a_, **k: res)
    a = device.build_parser().parse_args(["serve", "--loads", "8"])
    assert device.part_serve(tmp_path, a, tmp_path / "o", serve.Budget(600), {})["ok"] is False


def test_run_serve_without_lmcache_installed_reports_and_runs_the_rest(tmp_path, monkeypatch):
    from fake_openai import FakeVLLM

    from benchmarks.multiturn import launcher

    started = []

    @contextlib.contextmanager
    def fake_server(model, args, *, label, **kw):
        started.append(label)
        with FakeVLLM(args[args.index("--served-model-name") + 1]) as url:
            yield url

    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    monkeypatch.setattr(stage, "lmcache_ready", lambda target=None: False)
    load = serve.Load(clients=2, active=4, conversations=2, user_turns=1, device_tokens=4096, host_tokens=8192,
                      prefix_avg=600, prefix_max=900)
    a = _client(tmp_path)
    a.passes = 1
    res = serve.run_serve("uniform", load, ["off", "lmcache"], a, tmp_path / "w", tmp_path / "o", serve.Budget(600),
                          H200, HOST)
    assert started == ["off"] and [s["label"] for s in res["servers"]] == ["off"]
    assert res["errors"][0]["label"] == "lmcache" and "not installed" in res["errors"][0]["error"]


# ---------------------------------------------------------------------------- staging
REAL = {  # bytes on 2026-11-28: the stripped vLLM tarball, the 56 wheels of deps.txt, LMCache's five
    "tar": 97_501_800, "wheels": 38_868_983,
    "lmcache": {"lmcache-0.5.3-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl": 15_263_628,
                "nvtx-0.2.17-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl":
                    3_050_476,
                "sortedcontainers-2.4.0-py2.py3-none-any.whl": 29_575, "caio-0.12.10-py3-none-any.whl": 26_166,
                "aiofile-3.12.3-py3-none-any.whl": 22_122}}
CALL_LIMIT = 64 << 20
CODE_COPY, TREE = 1_300_000, 10_200_000  # e2e_src and the checkout's tree, carried by every stage call


def _sized(path: Path, n: int, seed: str) -> Path:
    """A file of ``n`` bytes (its head differs per name: distinct sha256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(seed.encode())
        f.truncate(n)
    return path


def test_pins_match_the_wheel_names_and_the_fetch_command():
    pins = stage.read_lmcache_pins()
    assert set(pins) == set(REAL["lmcache"]) and all(re.fullmatch(r"[0-9a-f]{64}", d) for d in pins.values())
    text = stage.LMCACHE_PINS.read_text()
    assert ("pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64"
            in text and "lmcache==0.5.3 nvtx==0.2.17 sortedcontainers==2.4.0 caio==0.12.10 aiofile==3.12.3" in text)
    assert stage.LMCACHE_SITE == Path("/tmp/site_lmcache") and stage.LMCACHE_DEFAULT_DIR == ROOT / ".cache/lmcache"
    sh = (ROOT / "scripts/dev/gpu_e2e.sh").read_text()
    assert f"LMCACHE_SITE={stage.LMCACHE_SITE} " in sh  # the script's import check looks where install put it


def test_prepare_packs_lmcache_into_three_parts_under_the_call_limit(tmp_path, monkeypatch):
    cache, out, lmc = tmp_path / "cache", tmp_path / "out", tmp_path / "lmc"
    wheels = [_sized(cache / "wheels" / f"dep{i}-1.0-py3-none-any.whl", n, f"w{i}")
              for i, n in enumerate([9_592_992, 8_044_600, 6_589_302] + [1_460_000] * 10)]
    _sized(cache / "wheels" / "last-1.0-py3-none-any.whl", REAL["wheels"] - sum(w.stat().st_size for w in wheels), "l")
    wheels = sorted((cache / "wheels").glob("*.whl"))
    monkeypatch.setattr(stage, "download", lambda c: (cache / "dl" / stage.VLLM_WHEEL, wheels))
    key = hashlib.sha256(json.dumps([stage.VLLM_WHEEL, stage.STRIP, stage.EDITS]).encode()).hexdigest()[:16]
    _sized(cache / f"vllm-{key}.tar.xz", REAL["tar"], "tar")  # the cached tarball: no build
    for name, n in REAL["lmcache"].items():
        _sized(lmc / name, n, name)
    pins = {name: stage._sha256(lmc / name) for name in REAL["lmcache"]}
    monkeypatch.setattr(stage, "read_lmcache_pins", lambda path=None: dict(pins))
    man = stage.prepare(out, cache, stage.DEFAULT_PART_BYTES, lmcache_dir=lmc)
    sizes = stage.part_sizes(out)
    assert man["parts"] == len(sizes) == 3  # no fourth part for LMCache's 18.4 MB
    assert all(n + CODE_COPY + TREE < CALL_LIMIT for n in sizes.values()), sizes
    assert max(sizes.values()) - min(sizes.values()) < 1_000_000  # balanced: every call keeps the same room
    assert man["lmcache"]["wheels"] == list(REAL["lmcache"]) and man["lmcache"]["version"] == "0.5.3"
    assert man["lmcache"]["sha256"] == stage.read_lmcache_pins()
    staged = {f.name for d in out.glob("part*") for f in d.iterdir()}
    assert set(REAL["lmcache"]) <= staged
    assert stage.server_kinds(man)[-2:] == ["lmcache", "lmcache-disk"]
    # every part in the stage folder: nothing missing; without one of LMCache's wheels install would refuse
    st = tmp_path / "stage"
    for d in sorted(out.glob("part*")):
        missing = stage.stage(d, st)
    assert missing == []
    (st / "caio-0.12.10-py3-none-any.whl").unlink()
    assert stage.missing_pieces(man, st) == ["caio-0.12.10-py3-none-any.whl"]
    # without LMCache's folder: the same three parts, no lmcache kinds
    man = stage.prepare(out, cache, stage.DEFAULT_PART_BYTES, lmcache_dir=tmp_path / "absent")
    assert man["lmcache"] is None and man["parts"] == 3 and "lmcache" not in stage.server_kinds(man)
    # a folder with a changed wheel is an error, not a silent skip
    (lmc / "caio-0.12.10-py3-none-any.whl").write_bytes(b"other")
    with pytest.raises(stage.StageError, match="caio-0.12.10-py3-none-any.whl: sha256"):
        stage.prepare(out, cache, stage.DEFAULT_PART_BYTES, lmcache_dir=lmc)


def test_balanced_parts():
    items = [("t", 250, True), ("a", 30, False), ("b", 90, False)]
    parts = stage.balanced_parts(items, 150)
    assert len(parts) == 3 and all(sum(n for _, _, n in p) <= 124 for p in parts)  # 370 / 3, not 150 + 150 + 70
    assert len(stage.balanced_parts(items, 1000)) == 1
    assert len(stage.balanced_parts([("t", 10, True), ("big", 95, False)], 100)) == 2  # 95 whole: 100 + 5


def _staged(tmp_path: Path) -> tuple[Path, dict]:
    """A stage folder with a tiny vLLM tarball and fake LMCache wheels, as install finds it."""
    st = tmp_path / "stage"
    st.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as t:
        info = tarfile.TarInfo("vllm/__init__.py")
        info.size = 3
        t.addfile(info, io.BytesIO(b"x=1"))
    (st / f"{stage.TAR_NAME}.{0:012d}").write_bytes(buf.getvalue())
    lmc = [_sized(st / name, 100, name) for name in REAL["lmcache"]]
    man = {"vllm": "0.23.0", "tar": stage.TAR_NAME, "tar_sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
           "wheels": [], "pieces": [{"part": 1, "file": f"{stage.TAR_NAME}.{0:012d}", "offset": 0,
                                     "bytes": len(buf.getvalue())}], "lmcache": stage.lmcache_manifest(lmc)}
    (st / "manifest.json").write_text(json.dumps(man))
    return st, man


def test_install_puts_lmcache_in_its_own_folder_without_dependencies(tmp_path, monkeypatch, capsys):
    st, man = _staged(tmp_path)
    site, lmc_site = tmp_path / "site", tmp_path / "site_lmcache"
    cmds = []

    def fake_run(cmd, check=False, **kw):
        cmds.append(cmd)
        (Path(cmd[cmd.index("--target") + 1]) / "lmcache").mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(stage.subprocess, "run", fake_run)
    assert stage.install(st, site, lmc_site) is True
    (cmd,) = cmds
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in cmd and "--no-index" in cmd
    assert cmd[cmd.index("--target") + 1] == str(lmc_site)
    assert [Path(c).name for c in cmd if c.endswith(".whl")] == list(REAL["lmcache"])
    assert stage.lmcache_ready(lmc_site) and stage.check(site, lmc_site) == 0
    assert "LMCache 0.5.3: installed in" in capsys.readouterr().out
    default = stage.pip_target_command(stage.LMCACHE_SITE, ["a.whl"])
    assert default[default.index("--target") + 1] == "/tmp/site_lmcache" and "--no-deps" in default
    # a staged wheel whose bytes changed: refused before pip runs
    (st / "nvtx-0.2.17-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl").write_bytes(b"y")
    cmds.clear()
    with pytest.raises(stage.StageError, match="nvtx.*sha256"):
        stage.install(st, site, lmc_site)
    assert not cmds


def test_install_without_lmcache_staged_and_check_says_so(tmp_path, monkeypatch, capsys):
    st, man = _staged(tmp_path)
    man["lmcache"] = None
    (st / "manifest.json").write_text(json.dumps(man))
    monkeypatch.setattr(stage.subprocess, "run", lambda *a, **k: pytest.fail("nothing to pip-install"))
    assert stage.install(st, tmp_path / "site", tmp_path / "site_lmcache") is False
    assert stage.check(tmp_path / "site", tmp_path / "site_lmcache") == 0
    out = capsys.readouterr().out
    assert "LMCache: not installed" in out and "no lmcache server kinds" in out


# ---------------------------------------------------------------------------- in-process engines (--lmcache)
def test_correctness_with_lmcache_equal_to_off_and_failed_without_hits():
    from benchmarks.gpu_e2e import device

    plain = device.correctness_plan(["uniform", "perlayer"])
    with_lmc = device.correctness_plan(["uniform", "perlayer"], lmcache=True)
    assert [x for x in with_lmc if x not in plain] == [("uniform/lmcache-fp32", "uniform", "lmcache", "float32"),
                                                       ("uniform/lmcache-bf16", "uniform", "lmcache", "bfloat16")]
    assert len(with_lmc) == len(plain) + 2  # uniform only
    assert device.engine_kind("lmcache") == ("lmcache", {}) and device._kind_connector("perlayer", "lmcache") is None

    def gen(tokens, cached=0):
        return {"rows": [{"tokens": t, "cached": cached} for t in tokens]}

    A, B = [[1, 2], [3, 4]], [[9, 9], [3, 4]]
    runs = {"uniform/off-fp32": {"r1": gen(A), "r2": gen(A), "w1": gen(A)},
            "uniform/lmcache-fp32": {"r1": gen(A), "r2": gen(A, 768), "w2": gen(A, 1023), "scrub": [{"ok": True}]}}
    lmc = [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if "lmcache" in c["engine"]]
    assert [c["engine"] for c in lmc] == ["uniform/lmcache-fp32 (first run)", "uniform/lmcache-fp32 (after reset)",
                                          "uniform/lmcache-fp32 (the 1,024-token prompt alone, after reset, device KV "
                                          "scrubbed)"]
    assert all(c["pass"] for c in lmc) and lmc[1]["host_tokens"] == 1536
    runs["uniform/lmcache-fp32"]["r2"] = gen(A, 0)  # same tokens, recomputed: LMCache served nothing
    bad = [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if "lmcache" in c["engine"]
           and not c["pass"]]
    assert len(bad) == 1 and "LMCache served no hit after the reset" in bad[0]["error"]
    assert "FAIL" in tables.correctness_table({"checks": bad})
    runs["uniform/lmcache-fp32"]["r2"] = gen(B, 768)  # hits, other tokens
    assert not [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if "after reset" in c["engine"]
                and "lmcache" in c["engine"]][0]["pass"]


def test_part_correctness_starts_an_lmcache_engine(monkeypatch, tmp_path):
    from test_gpu_yard import _FakeEngine

    from benchmarks.gpu_e2e import device

    seen = {}

    def fake_start(specs, timeout=400, in_waves=False):
        seen["specs"] = specs
        return {s.label: _FakeEngine(s) for s in specs}

    monkeypatch.setattr(device, "start_all", fake_start)
    monkeypatch.setattr(device, "build_tiny", lambda out, shape: f"tiny-{shape}")
    a = device.build_parser().parse_args(["correctness", "--layouts", "uniform", "--lmcache"])
    res = device.part_correctness(tmp_path, a, serve.Budget(600))
    spec = next(s for s in seen["specs"] if s.label == "uniform/lmcache-fp32")
    assert spec.kind == "lmcache" and spec.connector is None and spec.dtype == "float32" and spec.cpu_bytes == GiB
    assert spec.llm_kwargs()["kv_transfer_config"]["kv_connector"] == "LMCacheConnectorV1"
    assert res["ok"] and any("lmcache" in c["engine"] for c in res["layouts"]["uniform"]["checks"])
    assert "worker" not in res["layouts"]["uniform"]["runs"]["uniform/lmcache-fp32"]  # no worker_info: not ours


def test_pool_and_ttft_with_lmcache(monkeypatch, tmp_path):
    from test_gpu_e2e import _fake_pool, _TtftEngine

    from benchmarks.gpu_e2e import device

    seen = {}
    _fake_pool(monkeypatch, device, seen)
    a = device.build_parser().parse_args(["ttft", "--lmcache", "--ttft-lengths", "2048,8192", "--reps", "3",
                                          "--off-reps", "1"])
    assert [x[0] for x in device.pool_labels(a, "uniform")] == ["off", "native", "ours", "lmcache"]
    device.start_pool(tmp_path, a, "uniform", ["ttft"])
    spec = seen["specs"][-1]
    assert (spec.label, spec.kind, spec.connector) == ("lmcache", "lmcache", None)
    assert spec.child_env()["LMCACHE_MAX_LOCAL_CPU_SIZE"] == f"{spec.cpu_bytes / GiB:.3f}"
    with pytest.raises(serve.PlanError, match=r"4 engines \(off, native, ours, lmcache\)"):
        device.check_pool_fits("uniform", device.build_parser().parse_args(["ttft", "miss", "--lmcache"]),
                               ["ttft", "miss"], H200)

    class Silent(_TtftEngine):  # LMCache without hits at 8k: recomputed
        def call(self, op, **kw):
            out = super().call(op, **kw)
            if op == "generate" and len(kw["prompts"][0]) > 4000:
                out["rows"] = [{"cached": 0}]
            return out

    procs = {"off": _TtftEngine("off", 0.01), "native": _TtftEngine("native", 0.03), "ours": _TtftEngine("ours", 0.025),
             "lmcache": Silent("lmcache", 0.04)}
    res = device.part_ttft(procs, a)
    r2k, r8k = res["rows"]
    assert r2k["lmcache_s"]["median"] == 0.04 and r2k["lmcache_host_tokens"] == [2000] * 3 and not r2k["lmcache_failed"]
    assert r8k["lmcache_failed"] == "LMCache served no hit in 3 of 3 reloads"
    text = tables.ttft_table(res)
    assert tables.lmcache_ttft_table(res) in text
    rows = {c[0]: c for c in ([x.strip() for x in ln.split("|")[1:-1]] for ln in
                              tables.lmcache_ttft_table(res).splitlines() if ln.startswith("| "))}
    assert rows["2,048"][1:4] == ["40.0", "25.0", "30.0"] and rows["2,048"][5:7] == ["1.60x", "1.33x"]
    assert rows["8,192"][1] == "FAILED" and rows["8,192"][-1] == "LMCache served no hit in 3 of 3 reloads"
    assert "lmcache - native" in text
    assert device.lmcache_ttft_failure([], "EngineError: boom\nmore") == "error: EngineError: boom"


def test_ttft_fails_lmcache_reloads_it_never_retrieved(monkeypatch):
    """As on the H200 (2026-11-29): LMCache held the 8k prompt whole, reported a hit of 8,191 tokens, and
    logged no retrieve; the reload took 13.9 ms, under the 19.4 ms the link needs for its 1 GiB."""
    from test_gpu_e2e import _TtftEngine

    from benchmarks.gpu_e2e import device

    class Dry(_TtftEngine):  # hits at 8k, retrieves nothing there
        def call(self, op, **kw):
            out = super().call(op, **kw)
            if op == "generate":
                out["lmcache_retrieved"] = 0 if len(kw["prompts"][0]) > 4000 else 2048
            return out

    a = device.build_parser().parse_args(["ttft", "--lmcache", "--ttft-lengths", "2048,8192", "--reps", "3",
                                          "--off-reps", "1"])
    procs = {"off": _TtftEngine("off", 0.01), "native": _TtftEngine("native", 0.03), "ours": _TtftEngine("ours", 0.025),
             "lmcache": Dry("lmcache", 0.005)}
    r2k, r8k = device.part_ttft(procs, a)["rows"]
    assert r2k["lmcache_retrieved"] == [2048] * 3 and r2k["lmcache_failed"] is None
    assert r8k["lmcache_retrieved"] == [0] * 3
    assert r8k["lmcache_failed"] == "LMCache reported a hit of 2,000 tokens and logged no retrieve in 3 of 3 reloads: " \
                                    "nothing was loaded"
    # not counted (tensor parallel, or a record from before the counter): no verdict from it
    assert device.lmcache_ttft_failure([8191, 8191], None, [None, None]) is None
    assert device.lmcache_ttft_failure([8191, 8191], None, [8192, 0]).endswith("in 1 of 2 reloads: nothing was loaded")


def test_retrieve_counter_counts_what_lmcache_logs_as_retrieved():
    import logging

    from benchmarks.gpu_e2e import lmcache_log

    log = logging.getLogger(lmcache_log.CACHE_ENGINE_LOGGER)
    old_level, old_handlers, old_prop = log.level, list(log.handlers), log.propagate
    try:
        log.setLevel(logging.WARNING)  # as LMCACHE_LOG_LEVEL=WARNING would leave it
        log.propagate = False  # LMCache's loggers do not propagate: the handler must sit on this one
        counter = lmcache_log.RetrieveCounter.attach()
        assert log.level == logging.INFO
        log.info("[req_id=%s] Retrieved %d out of %d required tokens (from %d total tokens). size: %.4f gb",
                 "cmpl-1", 512, 512, 512, 0.0625)
        log.info("[req_id=%s] Stored %d out of total %d tokens", "cmpl-1", 768, 768)  # a store: not counted
        log.info("Retrieved %d out of %d required tokens", "oops")  # a record that does not format: ignored
        log.info("[req_id=cmpl-2] Retrieved 1280 out of 1280 required tokens (from 1300 total tokens)")
        assert (counter.tokens, counter.retrieves) == (512 + 1280, 2)
    finally:
        log.handlers[:] = old_handlers
        log.setLevel(old_level)
        log.propagate = old_prop


def test_whole_prompt_check_fails_lmcache_without_a_retrieve():
    from benchmarks.gpu_e2e import device

    def gen(tokens, cached=0, **kw):
        return {"rows": [{"tokens": t, "cached": cached} for t in tokens], **kw}

    A, W = [[1, 2], [3, 4]], [[5, 6]]
    ok = [{"ok": True, "rank": 0}]
    runs = {"uniform/off-fp32": {"r1": gen(A), "r2": gen(A), "w1": gen(W)},
            "uniform/lmcache-fp32": {"r1": gen(A), "r2": gen(A, 768), "w2": gen(W, 1023, lmcache_retrieved=1024),
                                     "scrub": ok}}
    assert device.whole_hits("uniform", runs) == ("uniform/off-fp32", "uniform/lmcache-fp32")
    assert device.whole_hits("perlayer", runs) == ()
    lmc = [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if "lmcache" in c["engine"]]
    assert [c["pass"] for c in lmc] == [True, True, True] and "scrubbed" in lmc[2]["engine"]
    # the same tokens without a retrieve: the scrub should have changed them, the log says nothing was loaded
    runs["uniform/lmcache-fp32"]["w2"] = gen(W, 1023, lmcache_retrieved=0)
    bad = [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if not c["pass"] and "lmcache" in c["engine"]]
    assert len(bad) == 1 and bad[0]["error"] == "LMCache reported 1023 hit tokens and logged no retrieve"
    runs["uniform/lmcache-fp32"]["w2"] = gen([[9, 9]], 1023)  # not counted, other tokens than off's
    assert not [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if "scrubbed" in c["engine"]][0]["pass"]


def test_device_refuses_lmcache_when_not_installed(monkeypatch, capsys):
    from benchmarks.gpu_e2e import device

    monkeypatch.setattr(stage, "lmcache_ready", lambda target=None: False)
    assert device.main(["ttft", "--lmcache"]) == 2
    assert "--lmcache: LMCache: not installed" in capsys.readouterr().err


def test_disk_tiers_checked_against_the_free_disk(tmp_path, monkeypatch):
    (load,) = serve.parse_loads("cap")
    per_tok = 128 << 10
    plans = serve.plan_servers("uniform", ["ours", "ours-disk", "native-fs", "lmcache-disk"], load, H200, HOST)
    need = serve.disk_need(plans, load, per_tok)
    assert need["ours-disk"] == need["lmcache-disk"] == serve.DISK_BYTES
    assert need["native-fs"] == 40 * load.final_context(load.prefix_avg) * per_tok  # one pass, ~24.2 GiB
    serve.check_disk(need, 80 * GiB)
    with pytest.raises(serve.PlanError, match=r"need up to 72\.2 GiB .* 60\.0 GiB free .*GPU_E2E_DISK_BYTES"):
        serve.check_disk(need, 60 * GiB)
    two = serve.disk_need(serve.plan_servers("uniform", ["ours", "ours-disk", "lmcache", "lmcache-disk"], load, H200,
                                             HOST), load, per_tok)
    assert two == {"ours-disk": 24 * GiB, "lmcache-disk": 24 * GiB}
    serve.check_disk(two, 55 * GiB)
    assert serve.disk_need(serve.plan_servers("uniform", ["off", "lmcache"], load, H200, HOST), load, per_tok) == {}
    # run_serve refuses before any server starts
    monkeypatch.setattr(serve, "DISK_ROOT", tmp_path / "disk")
    monkeypatch.setattr(serve.shutil, "disk_usage", lambda p: type("U", (), {"free": 30 * GiB})())
    monkeypatch.setattr(stage, "lmcache_ready", lambda target=None: True)
    monkeypatch.setattr(serve, "start_servers", lambda *a, **k: pytest.fail("no server may start"))
    a = _client(tmp_path)
    res = serve.run_serve("uniform", load, ["ours-disk", "lmcache-disk"], a, tmp_path / "w", tmp_path / "o",
                          serve.Budget(600), H200, HOST)
    assert res["errors"][0]["label"] == "-" and "disk tiers need up to 48.0 GiB" in res["errors"][0]["error"]


def test_lmcache_bfloat16_equals_native_without_hits_and_records_its_reload():
    """bf16: no hit must equal native's computation; after the reset LMCache's chunk-aligned load leaves
    another remainder to compute than native's, so its equality is recorded (not judged), but it must
    have had hits."""
    from benchmarks.gpu_e2e import device

    def gen(tokens, cached=0):
        return {"rows": [{"tokens": t, "cached": cached} for t in tokens]}

    A, B = [[1, 2], [3, 4]], [[9, 9], [3, 4]]
    runs = {"uniform/native-bf16": {"r1": gen(A), "r2": gen(A, 960)},
            "uniform/lmcache-bf16": {"r1": gen(A), "r2": gen(B, 768)}}

    def bf16():
        return [c for c in device.correctness_checks("uniform", runs, ["uniform"]) if "lmcache-bf16" in c["engine"]]

    first, reload = bf16()
    assert first["pass"] and first["expect_equal"] is True
    assert reload["pass"] and reload["expect_equal"] is None and reload["equal"] is False
    cells = [c.strip() for line in tables.correctness_table({"checks": [reload]}).splitlines() for c in line.split("|")]
    assert "recorded" in cells and "PASS" in cells
    runs["uniform/lmcache-bf16"]["r2"] = gen(A, 0)  # recomputed: no hit is a failure even when recorded
    assert not bf16()[1]["pass"] and "served no hit" in bf16()[1]["error"]
    runs["uniform/lmcache-bf16"]["r1"] = gen(B)  # without a hit it must compute what native computes
    assert not bf16()[0]["pass"]
