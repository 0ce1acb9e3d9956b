"""Two vLLM instances behind a round-robin router, with and without a shared lower tier.

Each conversation's turns alternate between the two servers of a pair (``rr_proxy.py``), as behind a
router that does not keep a conversation on one instance. Two pairs (``--pairs``, the second measured
against the first) start together on one GPU, from these kinds:
- ``host``: ours, host tier only: a turn finds its own server's earlier turns, never the other's;
- ``mooncake``: ours + the Mooncake tier, one ``mooncake_master`` on loopback, TCP: a turn finds the
  other server's turn in the pool;
- ``disk``: ours + the disk tier, both servers on one folder of the machine's disk (``DISK_ROOT``):
  a turn finds the other server's turns once a rescan (every 10 s) has listed them.
Every pass gives both pairs the same new texts, the pair going first alternating; then, with a
mooncake pair and when the budget allows, a pass of it with the master killed (SIGKILL) a few seconds
in and started again ``--pair-down-s`` later, and one more pass of it afterwards (the pool comes back
empty: hits return as the pass writes again). Per run: vLLM's multi-turn client's stats, both
servers' /metrics summed, the router's split, the tiers' counters as last logged.

    python -m benchmarks.gpu_e2e.device pair --passes 3 --budget-s 560
    python -m benchmarks.gpu_e2e.device pair --pairs host,disk --pair-load cap --no-pair-outage
"""

from __future__ import annotations

import functools
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.mooncake_master import EVICTION_FLAGS, Master, free_port
from benchmarks.multiturn.report import _fmt, _table

from . import mooncake_stage
from .engine import CACHE_ENV, ENV
from .kv_layouts import LAYOUTS
from .models import SERVE_VOCAB
from .serve import (CAPACITY, DISK_BYTES, DISK_ROOT, GPU_HEADROOM, HOST_PER_SERVER, HOST_SHARE, Budget, Load,
                    PlanError, ServerPlan, _warm, check_disk, client_sources, hash_seed, pass_workload, plan_servers,
                    run_line, run_one, server_args, server_env, server_log_info, start_servers, stop_servers)

GiB = 1 << 30
LAYOUT = "uniform"
# 24 conversations of 6 turns, a 1.5k shared prompt and 1.5k histories (~4.4k tokens at the end; 13 GiB
# of KV at the 8B shape in all): each server's 8 GiB of host KV holds its own turns of most of them.
PAIR_LOAD = Load(clients=16, active=24, conversations=24, user_turns=6, device_tokens=65536, host_tokens=65536,
                 common_prefix=1500, prefix_avg=1500, prefix_max=3000, capacity=True)
# ``--pair-load``: these turns, or the disk tier's capacity load (serve.CAPACITY: 32 clients, 40 conversations
# of ~5k tokens, 4 GiB device and 8 GiB host KV per server: each server's host KV holds a third of them)
PAIR_LOADS = ("turns", "cap")
SEGMENT_BYTES = 12 * GiB  # each mooncake server lends this to the pool: 24 GiB, the whole working set
TENANT = "pair"
PAIRS = ("host", "mooncake")  # the default --pairs
PAIR_KINDS = ("host", "mooncake", "disk")
# vLLM 0.22-0.28 seed block hashes per process unless PYTHONHASHSEED is set: both servers of a pair
# must hash a prefix alike to find each other's records (docs/mooncake_tier.md)
HASH_ENV = {"PYTHONHASHSEED": "0"}


def parse_pairs(text: str) -> tuple[str, str]:
    """``--pairs``: two different kinds of PAIR_KINDS, the second measured against the first."""
    pairs = tuple(x.strip() for x in text.split(",") if x.strip())
    if len(pairs) != 2 or len(set(pairs)) != 2 or any(p not in PAIR_KINDS for p in pairs):
        raise PlanError(f"--pairs {text!r}: two different kinds of {PAIR_KINDS}, e.g. host,disk")
    return pairs  # type: ignore[return-value]


class GPUFitError(PlanError):
    """The servers planned to run at once do not fit the GPU's memory."""


def pair_disk_dir(root: Path | None = None) -> Path:
    """The one folder both servers of the disk pair share (under DISK_ROOT)."""
    return (root or DISK_ROOT) / "pair-disk"


def pair_plans(gpu_bytes: int, host_bytes: int, master: dict | None, load: Load = PAIR_LOAD,
               segment_bytes: int = SEGMENT_BYTES, site: Path = mooncake_stage.MOONCAKE_SITE,
               pairs: tuple[str, str] = PAIRS, disk_root: Path | None = None,
               one_at_a_time: bool = False) -> list[ServerPlan]:
    """The four servers: ``<pair>-a`` and ``<pair>-b`` of each pair (ours; mooncake: + the tier of
    ``master``, ``Master.extra()``; disk: + the disk tier, one folder a pair); PlanError when they
    do not fit the GPU or the host together."""
    (one,) = plan_servers(LAYOUT, ["ours"], load, 0, 0)
    run_env = mooncake_stage.runtime_env(site)
    mc_env = {**HASH_ENV, "PYTHONPATH": run_env["PYTHONPATH"], "LD_LIBRARY_PATH": run_env["LD_LIBRARY_PATH"]}
    mc_extra = {**(master or {}), "mooncake_segment_bytes": segment_bytes, "mooncake_tenant": TENANT,
                "mooncake_local_hostname": "127.0.0.1"}
    mc_extra = {k if k.startswith("mooncake_") else f"mooncake_{k}": v for k, v in mc_extra.items()}

    def extra(pair: str) -> dict:
        if pair == "mooncake":
            return mc_extra
        if pair == "disk":
            return {"disk_path": str(pair_disk_dir(disk_root)), "disk_bytes_to_use": DISK_BYTES}
        return {}

    plans = [replace(one, label=f"{pair}-{side}", env=tuple((mc_env if pair == "mooncake" else HASH_ENV).items()),
                     extra=tuple(extra(pair).items()))
             for pair in pairs for side in "ab"]
    at_once = plans[:2] if one_at_a_time else plans  # (both servers of a pair are alike)
    gpu = sum(p.gpu_bytes for p in at_once)
    if gpu_bytes and gpu > GPU_HEADROOM * gpu_bytes:
        raise GPUFitError(f"pair: {len(at_once)} servers need {gpu / GiB:.1f} GiB of GPU memory, over "
                        f"{GPU_HEADROOM:.0%} of {gpu_bytes / GiB:.1f} GiB")
    segments = 2 * segment_bytes if "mooncake" in pairs else 0
    host = sum(p.cpu_bytes for p in at_once) + segments + HOST_PER_SERVER * len(at_once)
    if host_bytes and host > HOST_SHARE * host_bytes:
        raise PlanError(f"pair: host KV, pool segments and processes need {host / GiB:.1f} GiB, over "
                        f"{HOST_SHARE:.0%} of {host_bytes / GiB:.1f} GiB")
    return plans


class Router:
    """``rr_proxy.py`` in a process of its own in front of ``servers``."""

    def __init__(self, servers: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "benchmarks.gpu_e2e.rr_proxy", "--port", str(self.port)]
        for s in servers:
            cmd += ["--server", s]
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=str(Path(__file__).parents[2]))
        self._wait()

    def _wait(self, timeout_s: float = 30.0) -> None:
        import urllib.request

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.url}/router_stats", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"router did not answer within {timeout_s:.0f} s")

    def counts(self) -> list[int]:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/router_stats", timeout=5) as r:
                return json.loads(r.read())["requests"]
        except (OSError, ValueError, KeyError):
            return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def master_outage(master: Master, after_s: float, down_s: float, events: list[dict], t0: float,
                  done: threading.Event) -> None:
    """Kill the master ``after_s`` into a run and start it again ``down_s`` later (same ports)."""
    if done.wait(after_s):
        return
    master.signal(signal.SIGKILL)
    master.proc.wait(10)
    events.append({"t_s": round(time.monotonic() - t0, 1), "event": "master killed (SIGKILL)"})
    done.wait(down_s)
    try:
        master.start()
        events.append({"t_s": round(time.monotonic() - t0, 1), "event": "master started again"})
    except RuntimeError as e:
        events.append({"t_s": round(time.monotonic() - t0, 1), "event": f"master did not start again: {e}"})


def part_pair(work: Path, a, out: Path, budget: Budget, meta: dict, write=None) -> dict:
    """The pair part (module docstring). ``write(res)`` after every run (partial results survive a cut)."""
    from benchmarks.multiturn.launcher import PLAIN_CHAT_TEMPLATE, vllm_server

    from .models import build_shape_model

    load, lay = (CAPACITY if getattr(a, "pair_load", "turns") == "cap" else PAIR_LOAD), LAYOUTS[LAYOUT]
    res: dict = {"layout": LAYOUT, "model": lay.model.what, "load": asdict(load), "segment_bytes": SEGMENT_BYTES,
                 "passes": a.passes, "runs": [], "errors": [], "pairs": []}
    try:
        pairs = parse_pairs(getattr(a, "pairs", ",".join(PAIRS)))
    except PlanError as e:
        res["errors"].append({"label": "-", "error": str(e)})
        res["ok"] = False
        return res
    res["pairs"] = list(pairs)
    if "mooncake" in pairs:
        res["mooncake"] = mooncake_stage.ready()
        if res["mooncake"] is None:
            res["errors"].append({"label": "-", "error": mooncake_stage.status()})
            res["ok"] = False
            return res
    work.mkdir(parents=True, exist_ok=True)
    master = Master(str(mooncake_stage.master_binary()), work / "mooncake_master.log", *EVICTION_FLAGS,
                    env=mooncake_stage.runtime_env()) if "mooncake" in pairs else None
    cms: dict = {}
    urls: dict[str, str] = {}
    routers: dict[str, Router] = {}
    try:
        src = client_sources(Path(a.client_dir))
        res["client"] = {"sdist": src.get("sdist"), "files": src["files"]}
        if "disk" in pairs:  # a fresh tier: records of an earlier call's texts say nothing
            d = pair_disk_dir()
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True, exist_ok=True)
            check_disk({d.name: DISK_BYTES}, shutil.disk_usage(DISK_ROOT).free, DISK_ROOT)
        if master is not None:
            master.start()
        plan = functools.partial(pair_plans, meta.get("gpu_bytes", 0), meta.get("host_bytes", 0),
                                 master.extra() if master is not None else None, load, pairs=pairs)
        try:
            plans = plan()
        except GPUFitError as e:
            plans = plan(one_at_a_time=True)  # raises again if one pair alone does not fit
            res["one_pair_at_a_time"] = True
            print(f"[pair] {e}: one pair after the other", flush=True)
        res["servers"] = [asdict(p) for p in plans]
        model = build_shape_model(work / f"{lay.shape}-serve", lay.shape, SERVE_VOCAB)
        tmpl = work / "plain_chat_template.jinja"
        tmpl.write_text(PLAIN_CHAT_TEMPLATE)
        env = {**ENV, **CACHE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        logs = work / "pair_logs"
        logs.mkdir(parents=True, exist_ok=True)

        def make_cm(p: ServerPlan, timeout_s: float):
            return vllm_server(model, server_args(p, load, eager=a.eager, attention_backend=lay.backend(a.attention_backend),
                                                  chat_template=str(tmpl), served_name=lay.shape),
                               env=server_env(p, env), startup_timeout_s=timeout_s, log_path=logs / f"{p.label}.log",
                               label=p.label)

        walls: list[float] = []

        def one(pair: str, r: int, kind: str = "pass") -> dict | None:
            est = 1.25 * max(walls) if walls else 90.0
            if not budget.allows(est + 30):
                res.setdefault("cut", []).append({"pass": r, "pair": pair, "kind": kind, "left_s": budget.left()})
                return None
            wl = pass_workload(work, f"pair-{r}", load, hash_seed("pair", load.clients, r, a.seed))
            before = routers[pair].counts()
            done, events, t1 = threading.Event(), [], time.monotonic()
            killer = None
            if kind == "outage":
                killer = threading.Thread(target=master_outage, args=(master, a.pair_kill_at_s, a.pair_down_s, events,
                                                                      t1, done), daemon=True)
                killer.start()
            run = run_one(pair, routers[pair].url, model, lay.shape, wl, load, a, work / "client" / f"pair-{pair}-{r}-{kind}",
                          seed=r, timeout=max(30.0, budget.left() - 30), servers=[urls[f"{pair}-a"], urls[f"{pair}-b"]])
            done.set()
            if killer is not None:
                killer.join(60)
            after = routers[pair].counts()
            run.update(pair=pair, pass_=r, kind=kind, wall_s=time.monotonic() - t1, events=events,
                       routed=[x - y for x, y in zip(after, before)] if before and after else [],
                       planned=load.conversations * load.user_turns)
            res["runs"].append(run)
            walls.append(run["wall_s"])
            s = run.get("summary", {})
            print(f"[pair] {kind} {r} {pair}: {run_line(s)}, {s.get('requests', 0)}/{run['planned']} requests, connector tok "
                  f"{run.get('metrics', {}).get('external_hits', 0):.0f}, routed {run['routed']}, {run['wall_s']:.0f}s"
                  + (f", events {events}" if events else "") + (f" ERROR {run['error'][:300]}" if run.get("error") else ""),
                  flush=True)
            if write:
                write(res)
            return run

        # both pairs at once, the pair going first alternating; where four servers do not fit the GPU,
        # one pair after the other (the same texts pass by pass)
        groups = [pairs] if not res.get("one_pair_at_a_time") else [(pairs[0],), (pairs[1],)]
        for group in groups:
            mine = [p for p in plans if p.label.rsplit("-", 1)[0] in group]
            t0 = time.perf_counter()
            deadline = time.monotonic() + max(60.0, min(600.0, budget.left() - 150))
            up, errors = start_servers(make_cm, mine, getattr(a, "start_waves", True), deadline, cms)
            urls.update(up)
            res.setdefault("start_wall_s_by_group", []).append(time.perf_counter() - t0)
            res["start_wall_s"] = sum(res["start_wall_s_by_group"])
            res["errors"] += [{"label": k, "error": v} for k, v in errors.items()]
            if errors:
                return res
            for p in mine:
                res.setdefault("warm_s", {})[p.label] = _warm(urls[p.label], lay.shape, load.device_tokens)
            for pair in group:
                routers[pair] = Router([urls[f"{pair}-a"], urls[f"{pair}-b"]], logs / f"router-{pair}.log")
            print(f"[pair] {len(mine)} servers up in {res['start_wall_s_by_group'][-1]:.0f}s; routers "
                  f"{[routers[g].url for g in group]}", flush=True)
            for r in range(a.passes):
                for pair in (group if r % 2 == 0 else group[::-1]):
                    one(pair, r)
            if a.pair_outage and master is not None and "mooncake" in group:
                one("mooncake", a.passes, "outage")
                one("mooncake", a.passes + 1, "after")
            for p in mine:
                log = logs / f"{p.label}.log"
                if log.exists():
                    res.setdefault("server_logs", {})[p.label] = server_log_info(log.read_text(errors="replace"))
            res.setdefault("alive_after", {}).update({p.label: _healthy(urls[p.label]) for p in mine})
            if len(groups) > 1:  # the next pair needs the GPU memory
                for pair in group:
                    routers.pop(pair).stop()
                stop_servers(cms, [p.label for p in mine])
                for p in mine:
                    urls.pop(p.label)
    except (PlanError, OSError, RuntimeError, ValueError) as e:
        res["errors"].append({"label": "-", "error": f"{type(e).__name__}: {e}"})
    finally:
        for r in routers.values():
            r.stop()
        stop_servers(cms, list(urls))
        if master is not None:
            master.kill()
            res["master_log_tail"] = _tail(work / "mooncake_master.log")
    res["checks"] = pair_checks(res)
    res["ok"] = not res["errors"] and bool(res["runs"]) and all(res["checks"].values())
    return res


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def pair_checks(res: dict) -> dict[str, bool]:
    """Every run answered every request without a client error, the outage's included; the router
    alternated (both servers of a pair took requests)."""
    runs = res.get("runs") or []
    out = {"every request answered": bool(runs) and all(
        not r.get("error") and r.get("summary", {}).get("requests", 0) == r.get("planned") for r in runs)}
    out["both servers of a pair served"] = bool(runs) and all(len(r.get("routed") or []) == 2 and min(r["routed"]) > 0
                                                              for r in runs)
    if res.get("alive_after"):
        out["every server alive after the passes"] = all(res["alive_after"].values())
    outage = [r for r in runs if r.get("kind") == "outage"]
    if outage:
        out["master killed and restarted inside the outage pass"] = all(
            len(r.get("events") or []) == 2 and "again" in r["events"][1]["event"] for r in outage)
    return out


# ------------------------------------------------------------------------ the table
def pair_rows(res: dict) -> list[dict]:
    rows = []
    for r in res.get("runs") or []:
        s, m = r.get("summary") or {}, r.get("metrics") or {}
        rows.append({"pass": r.get("pass_"), "kind": r.get("kind"), "pair": r.get("pair"),
                     "req/s": s.get("requests_per_s"), "later TTFT p50": (s.get("ttft_later_ms") or {}).get("p50"),
                     "later TTFT p99": (s.get("ttft_later_ms") or {}).get("p99"),
                     "TPOT p99": (s.get("tpot_ms") or {}).get("p99"),
                     "answered": f"{s.get('requests', 0)}/{r.get('planned')}",
                     "connector tok": m.get("prompt_external_kv_transfer", m.get("external_hits")),
                     "computed tok": m.get("prompt_local_compute"), "routed": "/".join(map(str, r.get("routed") or []))})
    return rows


def pair_ratios(res: dict) -> dict[str, list[float]]:
    """Per pass where both pairs ran: the second pair against the first (mooncake against host by
    default), req/s and later-turn TTFT p50/p99."""
    base, other = res.get("pairs") or PAIRS
    by = {(r.get("pass_"), r.get("pair")): r.get("summary") or {} for r in res.get("runs") or []
          if r.get("kind") == "pass" and not r.get("error")}
    out: dict[str, list[float]] = {"req/s": [], "later TTFT p50": [], "later TTFT p99": []}
    for (p, pair), s in by.items():
        h = by.get((p, base))
        if pair != other or not h:
            continue
        if h.get("requests_per_s"):
            out["req/s"].append(s.get("requests_per_s", 0) / h["requests_per_s"])
        for q, key in (("p50", "later TTFT p50"), ("p99", "later TTFT p99")):
            hv, mv = (h.get("ttft_later_ms") or {}).get(q), (s.get("ttft_later_ms") or {}).get(q)
            if hv and mv is not None:
                out[key].append(mv / hv)
    return out


def pair_table(res: dict) -> str:
    cols = ["pass", "kind", "pair", "req/s", "later TTFT p50", "later TTFT p99", "TPOT p99", "answered",
            "connector tok", "computed tok", "routed"]
    rows = pair_rows(res)
    text = _table(cols, [[_fmt(r[c]) if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]) \
        if rows else "(no runs)"
    ratios = pair_ratios(res)
    base, other = res.get("pairs") or PAIRS
    order = " (one pair after the other: four servers did not fit the GPU)" if res.get("one_pair_at_a_time") else ""
    lines = [text, "", f"{other} / {base}{order}, per pass: " + "; ".join(
        f"{k} {', '.join(f'{x:.2f}' for x in v) or '-'}" for k, v in ratios.items())]
    for label, info in (res.get("server_logs") or {}).items():
        for tier in ("mooncake_tier", "disk_tier"):
            if info.get(tier):
                lines.append(f"{label} {tier.replace('_', ' ')}: {info[tier]}")
    for r in res.get("runs") or []:
        for e in r.get("events") or []:
            lines.append(f"{r.get('kind')} pass: t={e['t_s']}s {e['event']}")
    lines += [f"{'PASS' if v else 'FAIL'}  {k}" for k, v in (res.get("checks") or {}).items()]
    lines += [f"error {e.get('label')}: {e.get('error')}" for e in res.get("errors") or []]
    return "\n".join(lines)


__all__ = ["GPUFitError", "PAIR_KINDS", "PAIR_LOAD", "Router", "pair_checks", "pair_disk_dir", "pair_plans",
           "pair_ratios", "pair_table", "parse_pairs", "part_pair"]
