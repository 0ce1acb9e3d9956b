"""The GPU reliability part's logic on CPU (benchmarks/gpu_e2e/reliability.py): the flag, the server plans
with the fault hook, the log and client counters, the soak's and the kill's checks on synthetic samples
and real throwaway processes, the schedule, the table and JSON, and the whole part against fakes (a
local HTTP server standing in for vLLM, a sleeping process standing in for its tree). No GPU, no vLLM."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.gpu_e2e import device, reliability as rel, serve, tables
from benchmarks.gpu_e2e.serve import CAPACITY, DISK_BYTES, GiB
from benchmarks.multiturn.resources import alive, sample, temporaries
from vllm_npu_offload.tiers.contract import TierStats
from vllm_npu_offload.tiers.disk_io import TMP_MARK


# ---------------------------------------------------------------------------- flag and plans
def test_faults_flag_is_normalised_and_bad_values_name_flag_value_and_syntax(capsys):
    assert rel.faults_arg("load=0.010, disk_corrupt=1") == "load=0.01,disk_corrupt=1"
    assert rel.faults_arg("none") == ""
    with pytest.raises(argparse.ArgumentTypeError, match="'load=2'.*disk_corrupt.*0 <= PROBABILITY <= 1"):
        rel.faults_arg("load=2")
    with pytest.raises(SystemExit):
        device.build_parser().parse_args(["reliability", "--faults", "bogus=0.1"])
    err = capsys.readouterr().err
    assert "--faults" in err and "'bogus=0.1'" in err and "disk_write" in err
    a = device.build_parser().parse_args(["reliability"])
    assert a.faults == rel.DEFAULT_FAULTS and tables.parse_parts(["reliability"]) == ["reliability"]


def test_plan_puts_the_fault_hook_on_ours_disk_only():
    off, ours = rel.plan("uniform", CAPACITY, 139 * GiB, 128 * GiB, rel.DEFAULT_FAULTS)
    assert (off.kind, ours.kind) == ("off", "ours-disk")
    assert rel.FAULTS_VAR not in dict(off.env)
    assert dict(off.env)["PYTHONHASHSEED"] == dict(ours.env)["PYTHONHASHSEED"] == "0"  # 0.23: hashes survive a restart
    assert dict(ours.env)[rel.FAULTS_VAR] == rel.DEFAULT_FAULTS
    assert serve.server_env(ours, {"A": "1"})[rel.FAULTS_VAR] == rel.DEFAULT_FAULTS
    assert ours.kv_config()["kv_connector_extra_config"]["disk_path"] == str(ours.disk_dir)
    again = rel.without_faults(ours)
    assert rel.FAULTS_VAR not in dict(again.env) and again.disk_dir == ours.disk_dir  # the same folder
    assert again.kv_config() == ours.kv_config()
    _, plain = rel.plan("uniform", CAPACITY, 139 * GiB, 128 * GiB, "")
    assert rel.FAULTS_VAR not in dict(plain.env)


def test_probe_prompt_is_fixed_and_spans_many_offloaded_blocks():
    from benchmarks.gpu_e2e.models import corpus_words

    p = rel.probe_prompt()
    assert p == rel.probe_prompt()
    words = p.split()
    assert len(words) == rel.PROBE_WORDS and len(words) // 64 >= 60 and set(words) <= set(corpus_words())


def test_probes_are_compared_with_off_for_the_same_reuse():
    """bf16: a probe that reused nothing is compared with off from scratch, one that reused the whole
    prefix with off reusing it; a partial reuse has no reference (n/a), an error fails."""
    refs = rel.References(rel.Probe("off", "a", [1]), rel.Probe("off reusing", "b", [2], device_hit_tokens=4032.0))
    assert refs.compare(rel.Probe("x", "a", [1])) == (True, "off from scratch")
    assert refs.compare(rel.Probe("x", "b", [2], external_hit_tokens=4032.0))[0] is True
    assert refs.compare(rel.Probe("x", "b", [2], device_hit_tokens=32.0, external_hit_tokens=4000.0))[0] is True
    assert refs.compare(rel.Probe("x", "a", [1], external_hit_tokens=4032.0))[0] is False  # reused, scratch's tokens
    assert refs.compare(rel.Probe("x", "a", [1], external_hit_tokens=1024.0))[0] is None
    assert refs.compare(rel.Probe("x", error="boom")) == (False, "error: boom")


def test_probe_equality_needs_text_and_ids():
    ref = rel.Probe("off", "w1 w2", [1, 2])
    assert rel.Probe("x", "w1 w2", [1, 2]).same_as(ref)
    assert rel.Probe("x", "w1 w2", None).same_as(ref)  # ids not returned: the text decides
    assert not rel.Probe("x", "w1 w2", [1, 3]).same_as(ref)
    assert not rel.Probe("x", "w1 w3", [1, 2]).same_as(ref)
    assert not rel.Probe("x", error="URLError").same_as(ref)
    assert not ref.same_as(rel.Probe("off", error="boom"))


# ---------------------------------------------------------------------------- logs and counters
def test_tier_counters_read_the_tiers_own_line():
    s = TierStats(hits=7, misses_cost=1, misses_no_chunk=2, timeouts=3, read_failures=5, checksum_failures=4,
                  stores=11, dropped_stores=6, evictions=9, used_bytes_now=3_500_000_000, read_bytes=10**9,
                  read_seconds=0.5, write_bytes=2 * 10**9)
    old = TierStats(hits=1)
    log = (f"INFO 11-29 [tiered_manager.py:133] disk tier: {old.line()}; reads 1.0 GB/s\n"
           f"INFO 11-29 [tiered_manager.py:133] disk tier: {s.line()}; reads 2.0 GB/s\n")
    got = rel.tier_counters(log)
    assert got == {"hits": 7, "misses_cost": 1, "misses_no_chunk": 2, "timeouts": 3, "read_failures": 5,
                   "checksum_failures": 4, "stores": 11, "dropped_stores": 6, "evictions": 9, "on_disk_gb": 3.5}
    assert rel.tier_counters("no tier here") is None
    # the serve part's log summary takes the same line
    assert serve.server_log_info(log)["disk_tier"].startswith("hits 7 ")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_fault_log_counts_the_hooks_warning_and_injected_copy_failures(monkeypatch):
    from vllm_npu_offload import faults
    from vllm_npu_offload.copy.base import Direction
    from vllm_npu_offload.integration import workers

    monkeypatch.setenv("NPU_OFFLOAD_FAULTS", "load=0.5")
    # Listen on the package's own logger: each record reaches it exactly once, whether it then
    # propagates to the root or (once the integration is imported) goes out through vLLM's logger.
    pkg = logging.getLogger("vllm_npu_offload")
    got = _Records()
    pkg.addHandler(got)
    monkeypatch.setattr(pkg, "level", logging.INFO)
    try:
        faults.reload()
        core = SimpleNamespace(num_groups=1, submit=lambda *a, **k: None)
        retries = workers.Retries(core)
        spec = SimpleNamespace(block_ids=[0], group_sizes=[1], block_indices=[0])
        retries.submit(5, Direction.H2D, spec, spec)
        bad = SimpleNamespace(job_id=5, success=False, error="injected fault (NPU_OFFLOAD_FAULTS)",
                              direction=Direction.H2D)
        assert retries.results([bad]) == []  # submitted again, not reported
    finally:
        pkg.removeHandler(got)
    monkeypatch.delenv("NPU_OFFLOAD_FAULTS")
    faults.reload()
    text = "\n".join(r.getMessage() for r in got.records)
    text += "\nERROR KV offload job 9 (D2H) failed: injected fault (NPU_OFFLOAD_FAULTS)\n"
    text += f"INFO disk tier: {TierStats(read_failures=3, checksum_failures=2, dropped_stores=4).line()}; x\n"
    seen = rel.fault_log(text)
    assert seen["hook_on"] and "load=0.5" in seen["hook_line"]
    assert seen["copy_injected_retried"] == 1 and seen["copy_failed"] == 1
    assert seen["disk_tier"]["read_failures"] == 3 and seen["disk_tier"]["dropped_stores"] == 4
    assert rel.injected_counted(seen)
    assert not rel.injected_counted(rel.fault_log("nothing"))
    assert not rel.fault_log("plain log")["hook_on"]


def test_the_kill_comes_once_the_cut_pass_has_written_half_the_disk_budget(tmp_path, monkeypatch):
    """Read off the records' mtimes, so also while evictions hold the folder at its budget; a record
    written before the pass (the probe's) and a temporary do not count."""
    monkeypatch.setattr(rel, "KILL_LEAST_S", 0.2)
    monkeypatch.setattr(rel, "KILL_AFTER_S", 5.0)
    monkeypatch.setattr(rel, "POLL_S", 0.02)
    sub = tmp_path / "ab"
    sub.mkdir()
    old = sub / "probe.r0"
    old.write_bytes(b"p" * 4096)
    os.utime(old, (time.time() - 60, time.time() - 60))
    (sub / f"x.r0{TMP_MARK}vm.1").write_bytes(b"t" * 8192)  # a temporary: not a record yet
    since = time.time()

    def writer():
        for i in range(4):
            time.sleep(0.15)
            (sub / f"new{i}.r0").write_bytes(b"n" * 1024)

    th = threading.Thread(target=writer)
    th.start()
    waited, written = rel.wait_for_kill(tmp_path, since, 4096)  # half of 4 KiB: 2 records of 1 KiB
    th.join()
    assert 0.2 <= waited < 2.0 and written >= 2048
    assert rel.written_since(tmp_path, since) == 4096  # the probe's record and the temporary never count
    monkeypatch.setattr(rel, "KILL_AFTER_S", 0.3)  # a pass that writes too little: killed at the longest
    t0 = time.monotonic()
    waited, written = rel.wait_for_kill(tmp_path, time.time() + 1, 1 << 30)
    assert 0.3 <= waited < 1.0 and written == 0 and time.monotonic() - t0 < 1.0


def test_client_counts_failed_unanswered_and_clients_that_ended():
    log = ("01-12 [INFO] - Client 0 is done (num_successes=10, num_failures=2)\n"
           "\x1b[36mClient 1 is done (num_successes=8, num_failures=0)\x1b[0m\n")
    assert rel.client_counts(log, 18, 24, 2) == {"planned": 24, "ok": 18, "failed": 2, "unanswered": 0,
                                                 "rows_lost": 0, "clients": 2, "clients_done": 2}
    assert rel.client_counts(log, 16, 24, 3)["unanswered"] == 2  # counted as answered, no stats row
    # the server finished all 18: the client lost a row of an answered request, nothing is unanswered
    lost_row = rel.client_counts(log, 17, 24, 2, finished=18.0)
    assert lost_row["unanswered"] == 0 and lost_row["rows_lost"] == 1
    assert rel.client_counts(log, 16, 24, 2, finished=17.0)["unanswered"] == 1  # one the server never finished
    assert rel.client_counts("", 0, 24, 2)["clients_done"] == 0  # a client that died says nothing


# ---------------------------------------------------------------------------- the soak's checks
def _samples(n: int, grow: str = "", gpu: float | None = 100.0, disk_mib: float = 100.0) -> list[dict]:
    out = []
    for i in range(n):
        s = {"t_s": 10.0 * i, "rss_mib": 5000.0, "locked_mib": 8192.0, "threads": 300, "open_files": 200,
             "shm_entries": 12, "gpu_mib": gpu, "disk_records": 10, "disk_tmp": 0, "disk_mib": disk_mib}
        if grow:
            s[grow] = s[grow] * (1 + 0.1 * i)
        out.append(s)
    return out


PASS_OK = {"planned": 160, "ok": 140, "failed": 0, "unanswered": 0, "clients": 32, "clients_done": 32}


def test_soak_checks_pass_on_flat_resources_and_fail_on_growth_or_lost_requests():
    ok = rel.soak_checks(_samples(12), [PASS_OK, PASS_OK], DISK_BYTES)
    assert all(v is True for v in ok.values()), ok
    grown = rel.soak_checks(_samples(12, grow="rss_mib"), [PASS_OK], DISK_BYTES)
    assert grown["soak: rss_mib flat"] is False and grown["soak: threads flat"] is True
    lost = rel.soak_checks(_samples(12), [PASS_OK, {**PASS_OK, "ok": 130, "failed": 4, "unanswered": 6}], DISK_BYTES)
    assert lost["soak: no failed requests"] is False and lost["soak: no unanswered requests"] is False
    died = rel.soak_checks(_samples(12), [{**PASS_OK, "clients_done": 31}], DISK_BYTES)
    assert died["soak: every client ran to its end"] is False and died["soak: no failed requests"] is True
    broke = rel.soak_checks(_samples(12), [{**PASS_OK, "error": "client exit 1"}], DISK_BYTES)
    assert broke["soak: every client ran to its end"] is False
    over = rel.soak_checks(_samples(12, disk_mib=(DISK_BYTES >> 20) + 1000), [PASS_OK], DISK_BYTES)
    assert over["soak: disk tier within its budget"] is False


def test_soak_checks_say_na_when_not_measurable():
    few = rel.soak_checks(_samples(4), [], DISK_BYTES)
    assert few["soak: rss_mib flat"] is None and few["soak: no failed requests"] is None
    no_smi = rel.soak_checks(_samples(12, gpu=None), [PASS_OK], DISK_BYTES)
    assert no_smi["soak: gpu_mib flat"] is None and no_smi["soak: rss_mib flat"] is True
    hidden = rel.soak_checks(_samples(12, gpu=0.0), [PASS_OK], DISK_BYTES)  # pids not visible to nvidia-smi
    assert hidden["soak: gpu_mib flat"] is None
    assert rel.soak_checks([], [], DISK_BYTES)["soak: disk tier within its budget"] is None


def test_gpu_memory_is_summed_over_the_trees_pids():
    table = "123, 4000\n456, 1000\n789, 50\nbad line\n"
    assert rel.gpu_mib_of(table, [123, 789]) == 4050.0
    assert rel.gpu_mib_of("", [1]) == 0.0


# ---------------------------------------------------------------------------- the kill's leftovers
def test_disk_records_and_temporaries(tmp_path):
    d = tmp_path / "fp" / "ab"
    d.mkdir(parents=True)
    (d / "abcd.r0").write_bytes(b"x" * 8192)
    (d / "abce.r0").write_bytes(b"x" * 8192)
    (d / "abcd.r0.tmp.123.456").write_bytes(b"x" * 100)
    s = sample([], tmp_path)
    assert (s["disk_records"], s["disk_tmp"], s["disk_mib"]) == (2, 1, 16384 / 2**20)
    assert temporaries(tmp_path) == ["abcd.r0.tmp.123.456"]
    assert temporaries(tmp_path / "missing") == []


def test_leftovers_and_kill_report_checks():
    live, shm = rel.leftovers([], {"psm_1", "gone"}, {"a"}, {"a", "psm_1", "npu-kv-x", "other"})
    assert live == [] and shm == ["npu-kv-x", "psm_1"]  # the tree's still there, and any new one of ours
    rep = rel.KillReport(pids=[1], shm_left=["psm_1"], tree_locked_mib=8192, others_locked_mib=100,
                         mlocked_start_mib=50, mlocked_after_mib=300, gpu_before_mib=30000, gpu_after_mib=0)
    assert all(rep.checks().values()), rep.checks()
    rep.shm_left = ["psm_1", "npu-kv-x"]
    rep.mlocked_after_mib = 8000  # the killed tree's pinned memory still locked
    rep.gpu_after_mib = 30000
    rep.alive_after = [1]
    assert not any(rep.checks().values())
    na = rel.KillReport(pids=[1], mlocked_start_mib=None, gpu_before_mib=0.0, gpu_after_mib=0.0)
    c = na.checks()
    assert c["kill: locked memory released"] is None and c["kill: GPU memory released"] is None
    # pids hidden from nvidia-smi: the GPU's used memory must drop by half of what the server was planned
    hidden = rel.KillReport(pids=[1], gpu_before_mib=0.0, gpu_after_mib=0.0, planned_gpu_mib=24000,
                            gpu_used_before_mib=50000, gpu_used_after_mib=30000)
    assert hidden.checks()["kill: GPU memory released"] is True
    hidden.gpu_used_after_mib = 45000
    assert hidden.checks()["kill: GPU memory released"] is False


def test_kill_tree_kills_every_process_and_shm_of_sees_mapped_entries(tmp_path):
    from benchmarks.multiturn.procs import tree_pids

    shm = Path("/dev/shm")
    name = f"npu-reliability-test-{os.getpid()}"
    code = ("import mmap, os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "m = None\n"
            f"if os.path.isdir('/dev/shm'):\n"
            f"    fd = os.open('/dev/shm/{name}', os.O_RDWR | os.O_CREAT, 0o600)\n"
            "    os.ftruncate(fd, 4096)\n"
            "    m = mmap.mmap(fd, 4096)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        end = time.monotonic() + 10
        while len(tree_pids(proc.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        pids = tree_pids(proc.pid)
        assert len(pids) == 2
        if shm.is_dir():
            assert name in rel.shm_of(pids)
        rel.kill_tree(pids)
        end = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids)  # the unreaped parent is a zombie: gone
        if shm.is_dir():
            live, left = rel.leftovers(pids, rel.shm_of(pids) | {name}, set(), rel.shm_entries())
            assert live == [] and name in left  # a killed process cannot remove its entry
            assert not rel.KillReport(pids=pids, shm_left=left).checks()["kill: no /dev/shm entry of ours left"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(10)
        (shm / name).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- schedule
def test_schedule_soaks_until_its_share_and_always_keeps_the_kill_stage():
    s = rel.Schedule(540.0)
    reserve = s.kill_reserve(90.0)
    assert reserve == 20 + 30 + 90 + 60
    assert s.another_pass(160, 380, [], 90.0)  # early: yes (90 s assumed for a first pass)
    assert not s.another_pass(300, 240, [45.0], 90.0)  # past 55% of the budget
    assert not s.another_pass(200, reserve + 50, [50.0], 90.0)  # 62.5 s more would eat the kill stage
    assert s.another_pass(200, reserve + 70, [50.0], 90.0)
    assert not s.another_pass(100, 200, [], 200.0)  # a slow start: straight to the kill
    assert rel.restart_estimate(180.0, 150.0) == 60.0 and rel.restart_estimate(180.0, None) == 180.0


# ---------------------------------------------------------------------------- table and JSON
def test_table_and_json_of_a_result(tmp_path):
    res = {"layout": "uniform", "load": {"clients": 32}, "faults": rel.DEFAULT_FAULTS, "mode": "default",
           "checks": {"probe before the soak = off": True, "soak: rss_mib flat": False, "kill: GPU memory released": None},
           "samples": _samples(4), "passes": [{"pass": 0, **PASS_OK, "wall_s": 51.2, "metrics": {"external_hits": 1e6}}],
           "faults_seen": {"hook_on": True, "copy_injected_retried": 3, "copy_failed": 0,
                           "disk_tier": {"read_failures": 4, "checksum_failures": 2, "dropped_stores": 5}},
           "kill": {"pids": [1, 2], "wait_s": 0.4, "shm_left": [], "temporaries_after_kill": ["x.tmp.1"]},
           "restart": {"start_s": 80.0, "tier_up_s": 2.0, "probe": {"external_hit_tokens": 4032.0}},
           "probes": {"off": {"label": "off", "text": "w1", "token_ids": [1]},
                      "first": {"label": "ours-disk", "text": "w1", "token_ids": [1], "external_hit_tokens": 0.0},
                      "after_soak": {"label": "ours-disk", "text": "w2", "token_ids": [2]}},
           "cut": [{"stage": "soak"}], "errors": []}
    text = tables.write_part(tmp_path, "reliability", res)
    for word in ("PASS", "FAIL", "n/a", "rss_mib", "hook warning yes", "retried 3", "checksum 2", "into a pass: 2 processes",
                 "restart: up in 80s", "cut:", "| first ", "| after_soak ", "compared with", "restarted"):
        assert word in text, word
    got = json.loads((tmp_path / "reliability.json").read_text())
    assert got["checks"]["soak: rss_mib flat"] is False and got["faults"] == rel.DEFAULT_FAULTS
    assert len(got["samples"]) == 4 and got["table"] == text
    assert (tmp_path / "reliability.txt").read_text().strip() == text.strip()
    assert "(no table" not in tables.write_part(tmp_path, "reliability", {})  # an empty result still has a table


# ---------------------------------------------------------------------------- the whole part against fakes
class _FakeVllm(BaseHTTPRequestHandler):
    """/v1/completions answers the same tokens; /metrics counts prefix and external hits per request."""

    requests = 0

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        json.loads(self.rfile.read(n))
        type(self).requests += 1
        self._send(json.dumps({"choices": [{"text": " w5 w6", "token_ids": [5, 6]}]}), "application/json")

    def do_GET(self):  # noqa: N802
        n = type(self).requests
        # the first request computes from scratch, every later one reuses the probe's whole prefix
        self._send(f"vllm:prefix_cache_hits_total {4032.0 * max(0, n - 1)}\nvllm:external_prefix_cache_hits_total 0\n",
                   "text/plain")

    def _send(self, body: str, kind: str) -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_vllm():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("broken_client", [False, True])
def test_whole_part_against_fakes_runs_every_stage_and_stops_every_server(tmp_path, monkeypatch, fake_vllm,
                                                                          broken_client):
    """A stand-in tree (a sleeping process) is killed for real; the servers are fakes. A client that
    raises is an error of its stage: the kill -9 stage and the restart still run."""
    from benchmarks.gpu_e2e import models
    from benchmarks.multiturn import launcher

    monkeypatch.setattr(serve, "DISK_ROOT", tmp_path / "disk")
    monkeypatch.setattr(rel, "check_disk", lambda *a, **k: None)
    monkeypatch.setattr(models, "build_shape_model", lambda *a, **k: str(tmp_path / "model"))
    monkeypatch.setattr(rel, "KILL_AFTER_S", 0.3)
    monkeypatch.setattr(rel, "SAMPLE_EVERY_S", 0.05)
    monkeypatch.setattr(rel, "QUIET_S", 0.1)

    class TwoPasses(rel.Schedule):
        def another_pass(self, elapsed_s, left_s, walls, restart_s):
            return len(walls) < 2

    monkeypatch.setattr(rel, "Schedule", TwoPasses)
    tree = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    monkeypatch.setattr(rel, "listening_pid", lambda url: tree.pid)
    stopped: list[str] = []

    class Cm:
        def __init__(self, label):
            self.label = label

        def __enter__(self):
            return fake_vllm

        def __exit__(self, *exc):
            stopped.append(self.label)

    def fake_start(make_cm, plans, in_waves, deadline, cms):
        for p in plans:
            cms[p.label] = Cm(p.label)
        return {p.label: fake_vllm for p in plans}, {}

    monkeypatch.setattr(rel, "start_servers", fake_start)

    @contextlib.contextmanager
    def fake_server(model, args, *, env, startup_timeout_s, log_path, label):
        assert rel.FAULTS_VAR not in env  # the restart runs with the hook off
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(log_path).write_text(f"disk tier: {tmp_path}/disk/ours-disk/fp, budget 24.0 GiB (3 keys)\n"
                                  f"disk tier: {TierStats(hits=63).line()}; reads\n")
        try:
            yield fake_vllm
        finally:
            stopped.append("restart")

    monkeypatch.setattr(launcher, "vllm_server", fake_server)

    def fake_run_one(label, url, model, served, wl, load, a, run_dir, seed, timeout):
        if broken_client:
            raise OSError("the client could not start")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "client.log").write_text("".join(f"Client {i} is done (num_successes=5, num_failures=0)\n"
                                                    for i in range(32)))
        time.sleep(0.3)
        return {"summary": {"requests": 160}, "metrics": {"external_hits": 1000.0}, "rows": [[1]], "io": {}}

    monkeypatch.setattr(rel, "run_one", fake_run_one)
    a = device.build_parser().parse_args(["reliability", "--out", str(tmp_path / "out")])
    try:
        res = rel.run_reliability("uniform", CAPACITY, a, tmp_path / "work", tmp_path / "out", serve.Budget(300),
                                  139 * GiB, 128 * GiB)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(tree.pid, 9)
        tree.wait(10)
    c = res["checks"]
    if broken_client:
        assert res["errors"] == ["soak: OSError: the client could not start"] and not res["passes"]
        assert c["soak: no failed requests"] is None and res["ok"] is False
        assert res["kill_pass"] == {"error": "OSError: the client could not start"}
    else:
        assert not res["errors"], res.get("tracebacks")
        assert len(res["passes"]) == 2 and res["passes"][0]["ok"] == 160 and "rows" not in res["passes"][0]
        assert res["samples"] and "rss_mib" in res["samples"][0] and c["soak: no failed requests"] is True
        assert res["kill_pass"]["ok"] == 160
    for k in ("probe before the soak = off", "probe after the soak = off",
              "kill: no process of the tree left", "restart: server up", "restart: disk tier up",
              "restart: the kill's temporary records removed", "restart: probe = off",
              "restart: probe served from disk", "restart: no record failed its checks"):
        assert c[k] is True, (k, c)
    assert c["faults: the hook's warning in the log"] is False  # the fake's log has no hook warning
    assert res["kill"]["pids"] == [tree.pid] and res["restart"]["disk_tier"]["hits"] == 63
    assert sorted(stopped) == ["off", "ours-disk", "restart"]  # every server stopped, the killed one reaped
    got = json.loads((tmp_path / "out" / "reliability.json").read_text())  # written along the way
    assert got["probes"]["off"]["token_ids"] == [5, 6]


def test_part_records_a_failed_start_and_stops_what_started(tmp_path, monkeypatch):
    from benchmarks.gpu_e2e import models

    monkeypatch.setattr(serve, "DISK_ROOT", tmp_path / "disk")
    monkeypatch.setattr(rel, "check_disk", lambda *a, **k: None)
    monkeypatch.setattr(models, "build_shape_model", lambda *a, **k: str(tmp_path / "model"))
    stopped = []

    class Cm:
        def __exit__(self, *exc):
            stopped.append(1)

    def fake_start(make_cm, plans, in_waves, deadline, cms):
        cms["off"] = Cm()
        return {"off": "http://127.0.0.1:9"}, {"ours-disk": "BenchError: vLLM exited with code 1"}

    monkeypatch.setattr(rel, "start_servers", fake_start)
    a = device.build_parser().parse_args(["reliability"])
    res = rel.run_reliability("uniform", CAPACITY, a, tmp_path / "work", tmp_path / "out", serve.Budget(300),
                              139 * GiB, 128 * GiB)
    assert res["checks"]["servers started"] is False and res["ok"] is False and stopped == [1]
    assert any("exited with code 1" in e for e in res["errors"])


def test_the_folder_is_quiet_once_no_record_was_written_for_a_while(tmp_path, monkeypatch):
    """At its budget the folder keeps its record count while writes evict: quiet means no new mtime."""
    monkeypatch.setattr(rel, "QUIET_S", 0.3)
    sub = tmp_path / "ab"
    sub.mkdir()
    since = time.time()

    def writer():
        for i in range(5):
            (sub / f"k{i}.r0").write_bytes(b"x" * 10)
            if i:
                (sub / f"k{i - 1}.r0").unlink()  # evicted: the count stays at one
            time.sleep(0.1)

    th = threading.Thread(target=writer)
    t0 = time.monotonic()
    th.start()
    got = rel._quiet_folder(tmp_path, since)
    th.join()
    assert got == {"ab/k4.r0": 10} and time.monotonic() - t0 >= 0.4 + 0.3
