"""The GPU yardstick's pair part (two servers behind a round-robin router, with and without the Mooncake
tier) and Mooncake's staging for the GPU machine: on CPU, with stand-in servers and a real master."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_e2e import mooncake_stage, pair, rr_proxy, serve, tables

from test_gpu_yard import H200, HOST, _args, _fake_client

GiB = 1 << 30


def _chat(n_user: int, first: str = "conversation one") -> dict:
    msgs = [{"role": "user", "content": first}]
    for i in range(1, n_user):
        msgs += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"question {i}"}]
    return {"model": "m", "messages": msgs}


def test_route_alternates_each_conversations_turns():
    for first in ("a", "b", "conversation 7"):
        got = [rr_proxy.route(_chat(n, first), 2) for n in range(1, 7)]
        assert all(x != y for x, y in zip(got, got[1:])), got  # every next turn on the other server
    firsts = {rr_proxy.route(_chat(1, f"c{i}"), 2) for i in range(20)}
    assert firsts == {0, 1}  # first turns spread over both
    assert rr_proxy.route(_chat(3), 3) in (0, 1, 2)


def test_router_streams_and_splits_requests(tmp_path):
    from fake_openai import FakeVLLM

    with FakeVLLM("m") as a, FakeVLLM("m") as b:
        r = pair.Router([a, b], tmp_path / "router.log")
        try:
            for n in range(1, 5):
                body = {**_chat(n), "stream": n % 2 == 0, "max_tokens": 3}
                req = urllib.request.Request(f"{r.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                text = urllib.request.urlopen(req, timeout=10).read().decode()
                assert ("data: [DONE]" in text) if n % 2 == 0 else json.loads(text)["choices"]
            assert r.counts() == [2, 2]
            assert json.loads(urllib.request.urlopen(f"{r.url}/version", timeout=10).read())["version"] == "fake"
        finally:
            r.stop()
    assert r.proc.poll() is not None


def test_router_needs_two_servers():
    with pytest.raises(SystemExit):
        rr_proxy.main(["--port", "1", "--server", "http://x"])


def test_pair_plans_fit_one_h200_with_the_tier_on_two_servers():
    extra = {"master": "127.0.0.1:5", "metadata_server": "http://127.0.0.1:6/metadata"}
    plans = pair.pair_plans(H200, HOST, extra, site=Path("/s"))
    assert [p.label for p in plans] == ["host-a", "host-b", "mooncake-a", "mooncake-b"]
    for p in plans:
        env, kv = dict(p.env), p.kv_config()["kv_connector_extra_config"]
        assert env["PYTHONHASHSEED"] == "0" and kv["spec_name"] == "NPUOffloadingSpec"
        assert kv["cpu_bytes_to_use"] == pair.PAIR_LOAD.host_tokens * 131072  # 8 GiB at the 8B shape
        if p.label.startswith("mooncake"):
            assert kv["mooncake_master"] == "127.0.0.1:5" and kv["mooncake_tenant"] == pair.TENANT
            assert kv["mooncake_segment_bytes"] == pair.SEGMENT_BYTES
            assert env["PYTHONPATH"].endswith(":/s") or env["PYTHONPATH"] == "/s"
            assert env["LD_LIBRARY_PATH"].startswith("/s/syslib")
        else:
            assert not any(k.startswith("mooncake") for k in kv) and "LD_LIBRARY_PATH" not in env
    from vllm_npu_offload.tiers.mooncake_store import MooncakeConfig

    kv = plans[2].kv_config()["kv_connector_extra_config"]
    MooncakeConfig.from_extra_config({k: v for k, v in kv.items() if k.startswith("mooncake_")})  # valid keys
    cap = pair.pair_plans(H200, HOST, extra, serve.CAPACITY)  # --pair-load cap: the disk tier's sizes
    assert all(p.device_kv_bytes == 4 * GiB and p.cpu_bytes == 8 * GiB for p in cap)
    with pytest.raises(pair.GPUFitError, match="GPU memory"):
        pair.pair_plans(80 * GiB, HOST, extra)
    with pytest.raises(serve.PlanError, match="host KV, pool segments"):
        pair.pair_plans(H200, 64 * GiB, extra)


def test_a_disk_pair_shares_one_folder_through_our_connector(tmp_path):
    from vllm_npu_offload.integration.tier_options import disk_options

    plans = pair.pair_plans(H200, HOST, {"master": "127.0.0.1:5"}, serve.CAPACITY, pairs=("mooncake", "disk"),
                            disk_root=tmp_path)
    assert [p.label for p in plans] == ["mooncake-a", "mooncake-b", "disk-a", "disk-b"]
    kvs = [p.kv_config() for p in plans]
    assert all(k["kv_connector"] == "NPUOffloadingConnector" for k in kvs)  # the prefetch on arrival
    extra = [k["kv_connector_extra_config"] for k in kvs[2:]]
    assert extra[0]["disk_path"] == extra[1]["disk_path"] == str(tmp_path / "pair-disk")
    assert all(disk_options(e).budget_bytes == serve.DISK_BYTES for e in extra)  # valid keys, as the spec reads them
    assert all(dict(p.env)["PYTHONHASHSEED"] == "0" and not any(k.startswith("mooncake") for k in e)
               for e, p in zip(extra, plans[2:]))
    host = pair.pair_plans(H200, HOST, None, serve.CAPACITY, pairs=("host", "disk"), disk_root=tmp_path)
    assert not any(k.startswith("disk_") for k in host[0].kv_config()["kv_connector_extra_config"])
    pair.pair_plans(H200, 80 * GiB, None, pairs=("host", "disk"))  # no pool segments to fit beside them
    with pytest.raises(serve.PlanError, match="host KV"):
        pair.pair_plans(H200, 80 * GiB, {"master": "127.0.0.1:5"}, pairs=("host", "mooncake"))
    for bad in ("host", "host,host", "host,nvme", "host,disk,mooncake"):
        with pytest.raises(serve.PlanError, match="--pairs"):
            pair.parse_pairs(bad)


def _run(p, kind, pair_, rps, p50, p99, routed=(3, 3), n=6, planned=6, events=()):
    return {"pass_": p, "kind": kind, "pair": pair_, "planned": planned, "routed": list(routed), "events": list(events),
            "summary": {"requests": n, "requests_per_s": rps, "ttft_later_ms": {"p50": p50, "p99": p99},
                        "tpot_ms": {"p99": 9.0}}, "metrics": {"prompt_external_kv_transfer": 100.0}}


def test_pair_ratios_checks_and_table():
    runs = [_run(0, "pass", "host", 4.0, 800, 2000), _run(0, "pass", "mooncake", 5.0, 400, 1000),
            _run(1, "pass", "mooncake", 6.0, 300, 900), _run(1, "pass", "host", 4.0, 600, 1800),
            _run(2, "outage", "mooncake", 4.5, 500, 3000,
                 events=[{"t_s": 1.0, "event": "master killed (SIGKILL)"}, {"t_s": 3.0, "event": "master started again"}])]
    res = {"runs": runs, "alive_after": {"host-a": True}}
    r = pair.pair_ratios(res)
    assert r["req/s"] == [1.25, 1.5] and r["later TTFT p50"] == [0.5, 0.5]
    checks = pair.pair_checks(res)
    assert all(checks.values()) and len(checks) == 4
    text = pair.pair_table({**res, "checks": checks})
    assert "mooncake / host, per pass: req/s 1.25, 1.50" in text and "master started again" in text
    assert text.count("PASS") == 4
    runs[1]["summary"]["requests"] = 5  # one request never answered
    runs[3]["routed"] = [6, 0]  # the router sent everything to one server
    checks = pair.pair_checks(res)
    assert not checks["every request answered"] and not checks["both servers of a pair served"]
    runs[4]["events"] = runs[4]["events"][:1]
    assert not pair.pair_checks(res)["master killed and restarted inside the outage pass"]


def test_part_pair_with_stand_in_servers_and_a_real_master(tmp_path, monkeypatch):
    """The whole part on CPU: four stand-in servers, two routers, a real mooncake_master killed and
    started again inside the outage pass; every run answered, both servers of each pair used."""
    from fake_openai import FakeVLLM
    from mooncake_master import master_binary

    from benchmarks.multiturn import launcher

    binary = master_binary()
    started = []

    @contextlib.contextmanager
    def fake_server(model, args, *, label, env=None, **kw):
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        started.append((label, kv.get("mooncake_master"), (env or {}).get("PYTHONHASHSEED")))
        with FakeVLLM(args[args.index("--served-model-name") + 1]) as url:
            yield url

    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    monkeypatch.setattr(mooncake_stage, "ready", lambda site=None: {"mooncake": "test", "libraries_given": []})
    monkeypatch.setattr(mooncake_stage, "master_binary", lambda site=None: Path(binary))
    monkeypatch.setattr(pair, "PAIR_LOAD", serve.Load(clients=2, active=3, conversations=3, user_turns=2,
                                                      device_tokens=4096, host_tokens=8192, capacity=True))
    a = _args(_fake_client(tmp_path), passes=2, pair_kill_at_s=0.0, pair_down_s=0.2)
    writes = []
    res = pair.part_pair(tmp_path / "w", a, tmp_path / "o", serve.Budget(600), {"gpu_bytes": H200, "host_bytes": HOST},
                         write=lambda r: writes.append(len(r["runs"])))
    assert not res["errors"], res["errors"]
    masters = {m for _, m, _ in started if m}
    assert len(started) == 4 and len(masters) == 1 and all(h == "0" for _, _, h in started)
    kinds = [(r["pass_"], r["kind"], r["pair"]) for r in res["runs"]]
    assert kinds == [(0, "pass", "host"), (0, "pass", "mooncake"), (1, "pass", "mooncake"), (1, "pass", "host"),
                     (2, "outage", "mooncake"), (3, "after", "mooncake")]
    assert writes == list(range(1, 7))
    assert all(res["checks"].values()) and res["ok"], res["checks"]
    assert [e["event"] for e in res["runs"][4]["events"]] == ["master killed (SIGKILL)", "master started again"]
    assert all(sum(r["routed"]) == 6 for r in res["runs"])
    text = tables.write_part(tmp_path / "o", "pair", res)
    assert "outage" in text and (tmp_path / "o" / "pair.json").exists()


def test_part_pair_of_disk_pairs_needs_no_master(tmp_path, monkeypatch):
    """``--pairs host,disk``: no mooncake_master, the disk pair's one folder made fresh, passes
    alternating, no outage pass, ratios of disk against host."""
    from fake_openai import FakeVLLM

    from benchmarks.multiturn import launcher

    started = []

    @contextlib.contextmanager
    def fake_server(model, args, *, label, env=None, **kw):
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        started.append((label, kv.get("disk_path"), kv.get("mooncake_master")))
        with FakeVLLM(args[args.index("--served-model-name") + 1]) as url:
            yield url

    monkeypatch.setattr(launcher, "vllm_server", fake_server)
    monkeypatch.setattr(mooncake_stage, "ready", lambda site=None: pytest.fail("a disk pair needs no Mooncake"))
    monkeypatch.setattr(pair, "DISK_ROOT", tmp_path / "disk")
    monkeypatch.setattr(pair, "PAIR_LOAD", serve.Load(clients=2, active=3, conversations=3, user_turns=2,
                                                      device_tokens=4096, host_tokens=8192, capacity=True))
    monkeypatch.setattr(pair, "DISK_BYTES", 1 << 20)
    stale = tmp_path / "disk" / "pair-disk" / "old-record"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    a = _args(_fake_client(tmp_path), passes=2, pairs="host,disk")
    res = pair.part_pair(tmp_path / "w", a, tmp_path / "o", serve.Budget(600), {"gpu_bytes": H200, "host_bytes": HOST})
    assert not res["errors"], res["errors"]
    assert sorted(started) == [("disk-a", str(tmp_path / "disk" / "pair-disk"), None),
                               ("disk-b", str(tmp_path / "disk" / "pair-disk"), None),
                               ("host-a", None, None), ("host-b", None, None)]
    assert not stale.exists()
    assert [(r["pass_"], r["pair"]) for r in res["runs"]] == [(0, "host"), (0, "disk"), (1, "disk"), (1, "host")]
    assert res["ok"] and "disk / host, per pass: req/s" in pair.pair_table(res)

    # a GPU that holds two servers, not four (an H100 at the capacity load): one pair after the other
    started.clear()
    res = pair.part_pair(tmp_path / "w2", a, tmp_path / "o2", serve.Budget(600), {"gpu_bytes": 60 * GiB,
                                                                                 "host_bytes": HOST})
    assert not res["errors"], res["errors"]
    assert res["one_pair_at_a_time"] and [x[0] for x in started] in (["host-a", "host-b", "disk-a", "disk-b"],
                                                                     ["host-b", "host-a", "disk-b", "disk-a"],
                                                                     ["host-a", "host-b", "disk-b", "disk-a"],
                                                                     ["host-b", "host-a", "disk-a", "disk-b"])
    assert [(r["pass_"], r["pair"]) for r in res["runs"]] == [(0, "host"), (1, "host"), (0, "disk"), (1, "disk")]
    assert res["ok"] and all(res["alive_after"].values()) and len(res["alive_after"]) == 4
    assert "one pair after the other" in pair.pair_table(res) and pair.pair_ratios(res)["req/s"]
    with pytest.raises(serve.PlanError, match="2 servers need"):
        pair.pair_plans(30 * GiB, HOST, None, serve.CAPACITY, pairs=("host", "disk"), one_at_a_time=True)


def test_part_pair_without_mooncake_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(mooncake_stage, "ready", lambda site=None: None)
    res = pair.part_pair(tmp_path, _args(_fake_client(tmp_path)), tmp_path, serve.Budget(60), {})
    assert not res["ok"] and "Mooncake: not installed" in res["errors"][0]["error"]


# ---------------------------------------------------------------------------- staging
def _deb(path: Path, files: dict[str, bytes]) -> Path:
    """A minimal .deb: ar archive with debian-binary, control.tar.xz and data.tar.xz."""
    def tar_xz(members: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as t:
            for name, data in members.items():
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
        return buf.getvalue()

    out = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("control.tar.xz", tar_xz({"./control": b"x"})),
                       ("data.tar.xz", tar_xz(files))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        if len(data) % 2:
            out += b"\n"
    path.write_bytes(out)
    return path


def test_deb_unpacks_and_only_missing_libraries_are_given(tmp_path):
    deb = _deb(tmp_path / "libx.deb", {"./usr/lib/x86_64-linux-gnu/libx.so.1": b"X",
                                       "./usr/lib/x86_64-linux-gnu/libc.so.6": b"C"})
    mooncake_stage.unpack_deb(deb, tmp_path / "root")
    given = mooncake_stage.link_missing(tmp_path / "root", tmp_path / "lib", {"libc.so.6"})
    assert given == ["libx.so.1"] and (tmp_path / "lib" / "libx.so.1").read_bytes() == b"X"
    assert "libc.so.6" in mooncake_stage.system_sonames() or not mooncake_stage.system_sonames()
    (tmp_path / "bad.deb").write_bytes(b"not a deb")
    with pytest.raises(mooncake_stage.MooncakeStageError, match="bad.deb: not a Debian package"):
        mooncake_stage.deb_data(tmp_path / "bad.deb")


def test_trimmed_tar_keeps_the_store_and_the_master(tmp_path):
    whl = tmp_path / "mooncake_x-1-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for k in mooncake_stage.KEEP:
            z.writestr(f"mooncake/{k}", k)
        z.writestr("mooncake/transfer_engine_bench", "big")
        z.writestr(f"{mooncake_stage.LIBS_DIR}/libglog.so", "g")
    tar = mooncake_stage.trimmed_tar(whl, tmp_path / "cache")
    names = tarfile.open(tar, "r:xz").getnames()
    assert sorted(names) == sorted([f"mooncake/{k}" for k in mooncake_stage.KEEP] + [f"{mooncake_stage.LIBS_DIR}/libglog.so"])
    assert mooncake_stage.trimmed_tar(whl, tmp_path / "cache") == tar  # cached by the wheel's hash
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("mooncake/__init__.py", "")
    with pytest.raises(mooncake_stage.MooncakeStageError, match="has no mooncake/buffer_pool.py"):
        mooncake_stage.trimmed_tar(whl, tmp_path / "cache2")


def test_pins_name_missing_or_changed_files(tmp_path):
    (tmp_path / "a.whl").write_bytes(b"a")
    pins = {"a.whl": mooncake_stage.sha256(tmp_path / "a.whl"), "debs/b.deb": "0" * 64}
    with pytest.raises(mooncake_stage.MooncakeStageError, match="debs/b.deb missing"):
        mooncake_stage.pinned_files(tmp_path, pins)
    assert mooncake_stage.pinned_files(tmp_path / "absent", pins) == []
    assert set(mooncake_stage.read_pins()) >= {"debs/libcurl4_7.88.1-10+deb12u15_amd64.deb"}


def test_install_of_the_real_wheel_finds_every_library(tmp_path):
    """The pinned wheel and packages (when fetched into .cache/mooncake): trimmed, installed as on the GPU
    machine, ``ldd`` finds every library, and the master answers ``--help``."""
    files = mooncake_stage.pinned_files(mooncake_stage.DEFAULT_DIR) if mooncake_stage.DEFAULT_DIR.is_dir() else []
    if not files:
        pytest.skip(".cache/mooncake is not filled (benchmarks/gpu_e2e/mooncake_files.txt)")
    wheel = next(f for f in files if f.suffix == ".whl")
    debs = [f for f in files if f.suffix == ".deb"]
    trim = mooncake_stage.trimmed_tar(wheel, Path.home() / ".cache" / "npu_offload_gpu_e2e")
    stage_dir = tmp_path / "stage"
    stage_dir.mkdir()
    for f in [trim, *debs]:
        (stage_dir / (mooncake_stage.TRIM_NAME if f == trim else f.name)).symlink_to(f)
    entry = mooncake_stage.manifest_entry(debs, trim)
    info = mooncake_stage.install(entry, stage_dir, tmp_path / "site")
    assert info["mooncake"] == mooncake_stage.MOONCAKE_VERSION and mooncake_stage.ready(tmp_path / "site") == info
    import subprocess

    env = mooncake_stage.runtime_env(tmp_path / "site", {"PATH": "/usr/bin:/bin"})
    p = subprocess.run([str(mooncake_stage.master_binary(tmp_path / "site")), "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert "rpc_port" in p.stdout + p.stderr
