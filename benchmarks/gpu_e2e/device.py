"""Device-side entry point: run the selected parts in real vLLM 0.23 on the GPU.

  python -m benchmarks.gpu_e2e.device smoke --layouts all --out $OUT
  python -m benchmarks.gpu_e2e.device correctness --layouts all
  python -m benchmarks.gpu_e2e.device ttft miss --layouts uniform
  python -m benchmarks.gpu_e2e.device serve --layouts uniform --loads 8 --servers off,native,ours,upper
  python -m benchmarks.gpu_e2e.device reliability --layouts uniform

Every part runs in vLLM's default execution mode (torch.compile + CUDA graphs) unless ``--eager``,
for each layout of ``--layouts`` (kv_layouts.py). Each part writes ``<part>.json`` and
``<part>.txt`` into ``--out`` (serve also after every run, so a call cut off by its time limit
still returns what it did) and prints its table. ``--budget-s`` is the call's wall-clock budget:
long steps that would not end inside it are skipped and reported. Engines run one per subprocess
(engine.py); servers are ``vllm serve`` processes driven by vLLM's own multi-turn client (serve.py).
Exit 0, or 1 when a check failed or a part could not run. See docs/gpu_e2e.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .engine import CACHE_ENV, ENV, LAYERWISE_MODE_ENV, EngineError, EngineSpec, start_all
from .gpu_clocks import ClockSampler
from .kv_layouts import LAYOUTS, parse_layouts
from .models import SHAPES, build_shape_model, build_tiny
from .serve import (DISK_BYTES, DISK_ROOT, GPU_HEADROOM, LOADS, Budget, Load, PlanError, engine_gpu_bytes, parse_loads,
                    run_serve)
from .tables import parse_parts, spread, unique_prompts, write_part
from . import reliability

os.environ.update(ENV)

GiB = 1 << 30
# Servers of the serve part when --servers is not given: what fits one H200 at 32 clients.
DEFAULT_SERVERS = {"uniform": "off,native,ours,upper", "perlayer": "off,native,ours,uniform:native",
                   "multigroup": "off,native,ours", "mla": "off,native,ours"}
SMOKE_KINDS = {"uniform": ("off", "native", "ours", "simple", "vsimple"), "perlayer": ("native", "ours"),
               "multigroup": ("off", "native", "ours"), "mla": ("off", "native", "ours")}
SMOKE_SERVERS = "off,native,ours,simple,vsimple,upper,perlayer:native,perlayer:ours"
SMOKE_LOAD = Load(clients=4, active=8, conversations=8, user_turns=2, device_tokens=8192, host_tokens=65536,
                  prefix_avg=600, prefix_max=1200)


def _close(procs) -> None:
    for p in procs.values():
        p.close()


def grow_host(nbytes: int, chunk: int = 1 << 30) -> str:
    """Touch ``nbytes`` of host memory a GiB at a time, then free it. Some GPU machines (the H200 x2)
    start with ~31 GiB of MemTotal and add memory as it is used (KINDS.md): the serving plan and our
    start-up check read what the kernel reports, so the memory is grown first."""
    import numpy as np

    def total() -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    before, t0, held = total(), time.perf_counter(), []
    for _ in range(nbytes // chunk):
        held.append(np.ones(chunk, dtype=np.uint8))
    del held
    return f"MemTotal {before / GiB:.0f} -> {total() / GiB:.0f} GiB after touching {nbytes / GiB:.0f} GiB " \
           f"({time.perf_counter() - t0:.0f}s)"


def gpu_meta(a) -> dict:
    """Device, date, vLLM version and mode: the header of every table."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "mode": ("eager (enforce_eager)" if a.eager else "default (torch.compile + CUDA graphs)"),
            "attention_backend": a.attention_backend, "command": " ".join(sys.argv),
            "layerwise_load": a.layerwise_load}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        name, mem, drv = [x.strip() for x in q.stdout.strip().splitlines()[0].split(",")]
        meta.update(device=f"{name} ({mem}, driver {drv})", gpu_bytes=int(mem.split()[0]) * (1 << 20))
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        meta["device"] = "unknown (no nvidia-smi)"
    try:
        from importlib.metadata import version

        meta["vllm"] = version("vllm")
    except Exception:  # noqa: BLE001
        meta["vllm"] = "?"
    try:
        meta["host_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        meta["host_bytes"] = 0
    return meta


def layout_meta(name: str, a) -> dict:
    lay = LAYOUTS[name]
    return {"name": name, "blocks": lay.blocks, "model": lay.model.what,
            "attention_backend": lay.backend(a.attention_backend)}


def _kind_connector(layout: str, kind: str):
    return LAYOUTS[layout].connector if kind in ("native", "ours", "layerwise", "null") else None


# ---------------------------------------------------------------------------- smoke
def part_smoke(work: Path, a, budget: Budget, meta: dict) -> dict:
    """Each layout's engines (fewer layers, small KV) start and generate, store, reset and reload a
    few tokens (part smoke-serve: the servers)."""
    specs = []
    for name in a.layouts:
        lay = LAYOUTS[name]
        model = build_shape_model(work / f"{lay.shape}-smoke{a.smoke_layers}", lay.shape, None, a.smoke_layers)
        runs = [(kind, lay.backend(a.attention_backend)) for kind in SMOKE_KINDS[name]]
        if name == "uniform" and a.attention_backend != "FLASH_ATTN":
            runs.append(("ours", "FLASH_ATTN"))  # vLLM's default on Hopper: FA3 is staged (for MLA) anyway
        for kind, backend in runs:
            label = f"{name}/{kind}" + ("" if backend == lay.backend(a.attention_backend) else f"@{backend}")
            specs.append(EngineSpec(label, kind, model, dtype="bfloat16", load_format="dummy",
                                    max_model_len=4096, kv_cache_bytes=GiB, gpu_util=0.03, cpu_bytes=GiB, max_num_seqs=8,
                                    eager=a.eager, attention_backend=backend, connector=_kind_connector(name, kind)))
    t0 = time.perf_counter()
    procs = start_all(specs, timeout=max(60.0, min(480.0, budget.left() - 150)), in_waves=a.start_waves)
    res: dict = {"layers": a.smoke_layers, "engines": {}, "start_wall_s": time.perf_counter() - t0, "ok": True}
    print(f"[smoke] {len(specs)} engines in {res['start_wall_s']:.0f}s", flush=True)
    prompts = unique_prompts(2, 700, seed=77)
    try:
        for label, p in procs.items():
            row: dict = {"start_s": p.start_s}
            res["engines"][label] = row
            if p.error:
                row["error"], row["ok"] = p.error, False
                res["ok"] = False
                continue
            try:
                r1 = p.call("generate", prompts=prompts, max_tokens=4)
                fr = p.call("flush_reset")
                r2 = p.call("generate", prompts=prompts, max_tokens=4)
                row.update(tokens=r1["rows"][0]["tokens"], tokens_after_reset=r2["rows"][0]["tokens"],
                           host_tokens=sum(x["cached"] for x in r2["rows"]), reset=fr, load_bytes=r2["load_bytes"],
                           kv=p.call("kv_info"))
                if p.spec.kind == "ours":
                    row["worker"] = p.call("worker_info")
                offloads = p.spec.kind != "off"
                row["ok"] = bool(row["tokens"]) and fr["ok"] and (row["host_tokens"] > 0 or not offloads)
                if not row["ok"]:
                    row["why"] = "no tokens" if not row["tokens"] else (
                        "reset failed" if not fr["ok"] else "no host hits after reset")
            except EngineError as e:
                row["error"], row["ok"] = str(e), False
            res["ok"] &= row["ok"]
            print(f"[smoke] {label}: {json.dumps({k: v for k, v in row.items() if k not in ('worker', 'reset')})}",
                  flush=True)
    finally:
        _close(procs)
    return res


def part_smoke_serve(work: Path, a, budget: Budget, meta: dict) -> dict:
    """One tiny serving pass (fewer layers, SMOKE_LOAD) with vLLM's client against every server config:
    each server starts, streams tokens, and its /metrics are read. On uniform (or perlayer): off, native,
    ours, simple, vsimple, upper and native/ours through the per-layer connector."""
    layout = next((n for n in a.layouts if n in ("uniform", "perlayer")), a.layouts[0])
    names = (a.servers or (SMOKE_SERVERS if layout in ("uniform", "perlayer") else "off,native,ours")).split(",")
    if layout == "perlayer":
        names = [n.replace("perlayer:", "uniform:") if n.startswith("perlayer:") else n for n in names]
    sa = copy.copy(a)
    sa.passes, sa.smoke = 1, True
    srv = run_serve(layout, SMOKE_LOAD, names, sa, work, Path(a.out), budget, meta.get("gpu_bytes", 0),
                    meta.get("host_bytes", 0))
    got = {r["label"] for r in srv["runs"] if r.get("summary", {}).get("requests") and not r.get("error")
           and not r["summary"].get("empty_outputs")}
    ok = got == {s["label"] for s in srv.get("servers", [])} and bool(got)
    return {"runs": [srv], "ok": ok, "layers": a.smoke_layers}


# ---------------------------------------------------------------------------- correctness
WHEN = {"r1": "first run", "r2": "after reset", "r3": "corrupted host page, after reset",
        "w1": "a 1,024-token prompt, first run", "w2": "the 1,024-token prompt alone, after reset, device KV scrubbed"}
WHOLE_TOKENS = 1024  # whole LMCache chunks (256) and vLLM blocks (16): a hit of all of it leaves 1 token to compute


def correctness_plan(layouts: list[str], lmcache: bool = False) -> list[tuple[str, str, str, str]]:
    """(label, layout, kind, dtype) of the correctness engines: float32 where the layout's kernels
    take it (off, native, ours, and the Simple connectors on the uniform model), bfloat16 native and
    ours everywhere (MLA: bfloat16 only, with off). perlayer shares uniform's off-fp32 engine (same
    tiny model) when both run. ``ours-staged`` is ours with every transfer staged
    (``STAGED_ENV``): the tiny models' transfers are below the calibrated threshold, so without it
    the staged gather/scatter and group-major host records never meet real vLLM here. ``layerwise``
    (ours loading layer by layer inside the step) runs where the layout has one KV-cache group.
    ``lmcache`` (``--lmcache``): LMCache's connector on the uniform model in float32, checked against
    off like the others (its own connector: the layouts' connectors do not apply), and in bfloat16
    against native."""
    out = []
    for name in layouts:
        lay = LAYOUTS[name]
        lw = ["layerwise"] if lay.layerwise else []
        kinds32 = ["off", "native", "ours", "ours-staged"] + lw + (["simple", "vsimple"] if name == "uniform" else [])
        if name == "perlayer" and "uniform" in layouts:
            kinds32.remove("off")
        if lay.fp32:
            out += [(f"{name}/{k}-fp32", name, k, "float32") for k in kinds32]
        out += [(f"{name}/{k}-bf16", name, k, "bfloat16") for k in (["native", "ours"] + lw if lay.fp32 else
                                                                     ["off", "native", "ours", "ours-staged"] + lw)]
        if lmcache and name == "uniform":
            out += [("uniform/lmcache-fp32", name, "lmcache", "float32"), ("uniform/lmcache-bf16", name, "lmcache",
                                                                           "bfloat16")]
    return out


def whole_hits(name: str, labels) -> tuple[str, ...]:
    """The engines of a layout that run the whole-prompt check (w1, w2): on the uniform model in
    float32, offload off (the reference) and each of native, ours and LMCache that runs. A prompt
    held whole is loaded with one token left to compute, and the device KV is scrubbed before the
    reload, so tokens equal to off's prove the connector loaded it (LMCache with vLLM 0.23.0 logged
    such hits and no retrieve in the reload TTFT part)."""
    if name != "uniform":
        return ()
    return tuple(f"uniform/{k}-fp32" for k in ("off", "native", "ours", "lmcache") if f"uniform/{k}-fp32" in labels)


def negatives(name: str) -> tuple[str, ...]:
    """The engines of a layout whose host page is corrupted for a third run (r3)."""
    dtype = "fp32" if LAYOUTS[name].fp32 else "bf16"
    return (f"{name}/ours-{dtype}",) + ((f"{name}/layerwise-{dtype}",) if LAYOUTS[name].layerwise else ())


STAGED_ENV = {"NPU_OFFLOAD_STAGED": "1"}


def engine_kind(kind: str) -> tuple[str, dict]:
    """A correctness kind's engine kind and run-time variables ("ours-staged" -> ours, STAGED_ENV)."""
    return ("ours", dict(STAGED_ENV)) if kind == "ours-staged" else (kind, {})


def correctness_checks(name: str, runs: dict, layouts: list[str]) -> list[dict]:
    """The checks of one layout over its engines' runs (label -> {"r1", "r2", ["r3"]} or {"error"})."""
    lay = LAYOUTS[name]
    off32 = "uniform/off-fp32" if name == "perlayer" and "uniform" in layouts else f"{name}/off-fp32"
    checks: list[dict] = []
    toks = lambda r: [row["tokens"] for row in r["rows"]]  # noqa: E731
    host = lambda r: sum(row["cached"] for row in r["rows"])  # noqa: E731

    def check(dtype, engine, key, ref_label, ref_key, expect_equal: bool | None = True, need_host=True):
        """expect_equal None: the equality is recorded, not judged (the check still needs its hits)."""
        run, ref = runs.get(engine, {}), runs.get(ref_label, {})
        c = {"dtype": dtype, "engine": f"{engine} ({WHEN[key]})", "against": f"{ref_label} ({WHEN[ref_key]})",
             "expect_equal": expect_equal}
        err = run.get("error") or ref.get("error") or (None if key in run and ref_key in ref else "not run")
        if err:
            c.update(error=err, not_run=True, equal=False, **{"pass": False})
            return checks.append(c)
        eq = toks(run[key]) == toks(ref[ref_key])
        c["host_tokens"] = host(run[key])
        c.update(equal=eq, **{"pass": (expect_equal is None or eq == expect_equal)
                                         and (not need_host or c["host_tokens"] > 0)})
        if "ours-staged" in engine:  # the engine must really have staged every transfer
            cores = run.get("worker", {}).get("cores", [])
            c["staged"] = bool(cores) and all(w["staged_from_blocks"] == {"H2D": "1", "D2H": "1"} for w in cores)
            if not c["staged"]:
                c.update(error=f"not every transfer staged: {[w.get('staged_from_blocks') for w in cores]}",
                         **{"pass": False})
        if "lmcache" in engine and key == "r2" and not c["host_tokens"]:  # LMCache falls back to recompute silently
            c.update(error="LMCache served no hit after the reset (degraded mode, or it stored nothing): recomputed, "
                           "not loaded", **{"pass": False})
        if key == "w2":  # the reload ran over scrubbed device KV, and LMCache retrieved what it reported
            scrub = run.get("scrub") or []
            if not scrub or not all(x.get("ok") for x in scrub):
                c.update(error=f"device KV not scrubbed: {scrub}", **{"pass": False})
            elif "lmcache" in engine and run[key].get("lmcache_retrieved") == 0:
                c.update(error=f"LMCache reported {c['host_tokens']} hit tokens and logged no retrieve", **{"pass": False})
        if "layerwise" in engine and key == "r2":  # its reloads must really have gone layer by layer
            lw = run.get("worker", {}).get("layerwise") or {}
            c["layerwise"] = lw
            if not lw.get("loads") or lw.get("failed_loads"):
                c.update(error=f"layer-wise path not taken cleanly: {lw or 'no layer-wise counters'}",
                         **{"pass": False})
        checks.append(c)

    lw = ["layerwise"] if lay.layerwise else []
    if lay.fp32:
        if off32.startswith(name):
            check("float32", off32, "r2", off32, "r1", need_host=False)
        for k in ["native", "ours", "ours-staged"] + lw + (["simple", "vsimple"] if name == "uniform" else []):
            check("float32", f"{name}/{k}-fp32", "r1", off32, "r1", need_host=False)
            check("float32", f"{name}/{k}-fp32", "r2", off32, "r1")
        for k in ["ours"] + lw:
            check("float32", f"{name}/{k}-fp32", "r3", off32, "r1", expect_equal=False)
        if lw:  # the same tokens as the asynchronous path
            check("float32", f"{name}/layerwise-fp32", "r2", f"{name}/ours-fp32", "r2")
        if f"{name}/lmcache-fp32" in runs:  # --lmcache: equal to off, first run and after reset (with hits)
            check("float32", f"{name}/lmcache-fp32", "r1", off32, "r1", need_host=False)
            check("float32", f"{name}/lmcache-fp32", "r2", off32, "r1")
    else:
        for k in ["native", "ours", "ours-staged"] + lw:  # no hit in the first run: the same computation as off
            check("bfloat16", f"{name}/{k}-bf16", "r1", f"{name}/off-bf16", "r1", need_host=False)
        for k in ["ours"] + lw:
            check("bfloat16", f"{name}/{k}-bf16", "r3", f"{name}/native-bf16", "r2", expect_equal=False)
        check("bfloat16", f"{name}/ours-staged-bf16", "r2", f"{name}/native-bf16", "r2")
    for engine in whole_hits(name, runs)[1:]:
        check("float32", engine, "w2", off32, "w1")
    check("bfloat16", f"{name}/ours-bf16", "r1", f"{name}/native-bf16", "r1", need_host=False)
    check("bfloat16", f"{name}/ours-bf16", "r2", f"{name}/native-bf16", "r2")
    if f"{name}/lmcache-bf16" in runs:  # no hit: native's computation; after the reset LMCache loads whole
        # chunks of 256 tokens and native 64-token blocks, so each computes a different remainder of the
        # prompt, which in bfloat16 may round differently: recorded, not judged (float32 judges it)
        check("bfloat16", f"{name}/lmcache-bf16", "r1", f"{name}/native-bf16", "r1", need_host=False)
        check("bfloat16", f"{name}/lmcache-bf16", "r2", f"{name}/native-bf16", "r2", expect_equal=None)
    if lw:  # bf16 layer-wise: the asynchronous path's tokens (the same KV, the same remainder computed)
        check("bfloat16", f"{name}/layerwise-bf16", "r2", f"{name}/ours-bf16", "r2")
    return checks


def _gpu_node(numa_info: str) -> int | None:
    """The GPU's NUMA node in ``info``'s numa line ("2 nodes; device on node 1 (sysfs, ...)"), None
    on a single-node machine or when unknown."""
    m = re.search(r"on node (\d+)", numa_info or "")
    return int(m.group(1)) if m else None


def rank_rows(runs: dict, tp: int, cpu_bytes: int) -> list[dict]:
    """One row per worker core of every engine that reported its cores (ours, simple): its rank, host
    bytes against its share of ``cpu_bytes`` (the total over ranks: must be within 1%), and the NUMA
    node of its host pages against its GPU's (must match where the machine has several nodes). An
    engine that did not report every rank 0..tp-1 gets a failing row."""
    rows: list[dict] = []
    share = cpu_bytes / tp
    for label, run in runs.items():
        cores = run.get("worker", {}).get("cores") if isinstance(run.get("worker"), dict) else None
        if cores is None:
            continue
        for c in cores:
            nodes = {int(k): v for k, v in (c.get("host_page_nodes") or {}).items()}
            host_node = max((n for n in nodes if n >= 0), key=nodes.get, default=None)
            gpu_node = _gpu_node(c.get("numa_info", ""))
            ok_bytes = abs(c["host_bytes"] - share) <= 0.01 * share
            ok_numa = gpu_node is None or host_node == gpu_node
            rows.append({"engine": label, "rank": c.get("rank", 0), "host_bytes": c["host_bytes"], "share": int(share),
                         "gpu_node": gpu_node, "host_node": host_node, "host_page_nodes": nodes,
                         "numa": c.get("numa", ""), "numa_info": c.get("numa_info", ""),
                         "pass": ok_bytes and ok_numa})
        seen = sorted(c.get("rank", 0) for c in cores)
        if seen != list(range(tp)):
            rows.append({"engine": label, "rank": f"expected ranks 0..{tp - 1}, got {seen}", "host_bytes": 0,
                         "share": int(share), "gpu_node": None, "host_node": None, "host_page_nodes": {},
                         "numa": "", "numa_info": "", "pass": False})
    return rows


def generate_prompts(p, prompts: list[list[int]], max_tokens: int, one_by_one: bool) -> dict:
    """``generate`` of all prompts in one batch, or one prompt per call (rows in prompt order, totals
    summed). One by one for bfloat16: in a batch, when each request's load lands decides which
    requests share a step, and bf16 results depend on the batch (the MLA decode split), so native
    and ours could differ by timing alone (seen twice at token 8 of one prompt); alone, a request's
    tokens depend only on its prompt and the KV it got back."""
    if not one_by_one:
        return p.call("generate", prompts=prompts, max_tokens=max_tokens)
    outs = [p.call("generate", prompts=[q], max_tokens=max_tokens) for q in prompts]
    merged = {"rows": [row for o in outs for row in o["rows"]]}
    for k, v in outs[0].items():
        if k != "rows" and isinstance(v, (int, float)):
            merged[k] = sum(o.get(k, 0) for o in outs)
    return merged


def part_correctness(work: Path, a, budget: Budget) -> dict:
    """Per layout, tiny random-weight models of its architecture: a first run, then (stores flushed,
    device prefix cache reset) a run served from host; float32 tokens must equal offload off, bfloat16
    ours must equal native; a prompt held whole, reloaded over scrubbed device KV, must equal off's
    (``whole_hits``); one host page of ours corrupted must change the tokens."""
    prompts = [unique_prompts(1, 1000 + 100 * i, seed=11 + i)[0] for i in range(4)]  # 1000..1300 tokens
    whole = unique_prompts(1, WHOLE_TOKENS, seed=31)
    plan = correctness_plan(a.layouts, getattr(a, "lmcache", False))
    labels = [label for label, _, _, _ in plan]
    models = {name: build_tiny(work / f"tiny-{LAYOUTS[name].shape}", LAYOUTS[name].shape) for name in a.layouts}
    cpu_bytes = GiB  # host KV of every offloading engine, all ranks together (the per-rank check's total)
    specs = []
    for label, name, kind, dtype in plan:
        ekind, env = engine_kind(kind)
        specs.append(EngineSpec(label, ekind, models[name], dtype=dtype, max_model_len=2048, kv_cache_bytes=GiB,
                                gpu_util=0.03, cpu_bytes=cpu_bytes, max_num_seqs=8, eager=a.eager,
                                attention_backend=LAYOUTS[name].backend(a.attention_backend),
                                connector=_kind_connector(name, ekind), env=env, tp=a.tp))
    one_by_one = {label for label, _, _, dtype in plan if dtype == "bfloat16"}
    t0 = time.perf_counter()
    procs = start_all(specs, timeout=max(60.0, min(480.0, budget.left() - 60)), in_waves=a.start_waves)
    res: dict = {"layouts": {}, "prompt_tokens": [len(p) for p in prompts], "max_tokens": a.max_tokens,
                 "start_wall_s": time.perf_counter() - t0}
    runs: dict[str, dict] = {}
    kv: dict[str, dict] = {}
    try:
        for label, p in procs.items():
            if p.error:
                runs[label] = {"error": p.error}
                continue
            if not budget.allows(30):
                runs[label] = {"error": "cut by the call's time budget"}
                continue
            try:
                gen = lambda: generate_prompts(p, prompts, a.max_tokens, label in one_by_one)  # noqa: E731
                r1 = gen()
                fr = p.call("flush_reset")
                r2 = gen()
                run = {"r1": r1, "reset": fr, "r2": r2, "start_s": p.start_s, "one_by_one": label in one_by_one}
                kv[label] = p.call("kv_info")
                if p.spec.kind in ("ours", "layerwise", "simple"):
                    run["worker"] = p.call("worker_info")
                if label in whole_hits(label.split("/")[0], labels):  # before r3: its corrupted page stays out
                    run["w1"] = generate_prompts(p, whole, a.max_tokens, True)
                    if p.spec.kind != "off":
                        run["reset_w"] = p.call("flush_reset")
                        run["scrub"] = p.call("scrub_device_kv", seed=7)
                        run["w2"] = generate_prompts(p, whole, a.max_tokens, True)
                if label in negatives(label.split("/")[0]):
                    run["corrupt"] = p.call("corrupt_page")
                    run["reset3"] = p.call("flush_reset")
                    run["r3"] = gen()
                runs[label] = run
            except EngineError as e:
                runs[label] = {"error": str(e)}
    finally:
        _close(procs)
    ok = True
    for name in a.layouts:
        mine = {k: v for k, v in runs.items() if k.startswith(name + "/") or (name == "perlayer" and k == "uniform/off-fp32")}
        checks = correctness_checks(name, runs, a.layouts)
        ranks = rank_rows({k: v for k, v in mine.items() if k.startswith(name + "/")}, a.tp, cpu_bytes)
        good = all(c["pass"] for c in checks) and all(r["pass"] for r in ranks)
        ok &= good
        res["layouts"][name] = {"layout": layout_meta(name, a), "model": f"tiny random {LAYOUTS[name].model.arch} "
                                f"({SHAPES[LAYOUTS[name].shape].tiny})", "runs": mine, "checks": checks,
                                "ranks": ranks, "tp": a.tp,
                                "kv_info": {k: v for k, v in kv.items() if k.startswith(name + "/")}, "ok": good}
    res["ok"] = ok
    return res


# ---------------------------------------------------------------------------- pools (ttft, miss)
def pool_sizes(name: str, a, parts: list[str]) -> tuple[int, int]:
    """(device KV bytes, host KV bytes) per engine of a layout's pool: --kv-gib/--cpu-gib, else enough
    for the longest TTFT prompt (and the miss batch when miss runs)."""
    per_tok = LAYOUTS[name].model.kv_bytes_per_token()
    need = (max(a.ttft_lengths) + a.ttft_suffix + 2048) * per_tok * 1.15
    if "miss" in parts:
        need = max(need, a.miss_batch * (a.miss_tokens + a.miss_out) * per_tok * 1.5)
    kv = a.kv_gib * GiB if a.kv_gib else int(math.ceil(need / GiB) + 1) * GiB
    cpu = a.cpu_gib * GiB if a.cpu_gib else max(8, int(math.ceil(max(a.ttft_lengths) * per_tok * 1.5 / GiB))) * GiB
    return kv, cpu


def pool_labels(a, name: str) -> list[tuple[str, str, dict]]:
    """(label, kind, env) of a layout's pool: off, native and ours (plus --null, --layerwise, --lmcache,
    --disk, --variant; less --no-off, --no-native)."""
    base = ([] if a.no_off else ["off"]) + (["ours"] if a.no_native else ["native", "ours"]) \
        + (["null"] if a.null else [])
    base += ["layerwise"] if a.layerwise and LAYOUTS[name].layerwise else []
    base += ["lmcache"] if getattr(a, "lmcache", False) else []
    base += ["ours-disk"] if getattr(a, "disk", False) else []
    return [(k, k, {}) for k in base] + [(label, "ours", env) for label, env in a.variant]


def pool_disk(kind: str, label: str) -> tuple[str | None, int]:
    """(folder, budget) of a pool engine's disk tier: ours-disk's own folder under DISK_ROOT, emptied
    (records of an earlier call's prompts say nothing), DISK_BYTES; (None, 0) for the other kinds."""
    if kind != "ours-disk":
        return None, 0
    d = DISK_ROOT / f"pool-{label}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    return str(d), DISK_BYTES


def check_pool_fits(name: str, a, parts: list[str], gpu_bytes: int, headroom: float = GPU_HEADROOM) -> None:
    """PlanError before any engine starts when the pool's engines (weights + device KV + overhead each,
    1/tp per GPU) do not fit one GPU: a ttft + miss pool of five 8B engines ran out of memory at start."""
    if not gpu_bytes:
        return
    kv, _ = pool_sizes(name, a, parts)
    each = engine_gpu_bytes(LAYOUTS[name].model.weight_bytes(), kv, a.tp)
    labels = [label for label, _, _ in pool_labels(a, name)]
    if len(labels) * each > headroom * gpu_bytes:
        raise PlanError(
            f"{name} pool for {'+'.join(parts)}: {len(labels)} engines ({', '.join(labels)}) x {each / GiB:.1f} GiB "
            f"({kv / GiB:.0f} GiB device KV each) need {len(labels) * each / GiB:.1f} GiB, over {headroom:.0%} of "
            f"{gpu_bytes / GiB:.1f} GiB: run ttft and miss in separate calls, or fewer engines "
            f"(--no-off for ttft, --no-native, fewer --variant)")


def start_pool(work: Path, a, name: str, parts: list[str], budget: Budget | None = None) -> dict:
    """The pool's engines (``pool_labels``) of one layout's real shape, dummy weights."""
    lay = LAYOUTS[name]
    model = build_shape_model(work / lay.shape, lay.shape)
    kv, cpu = pool_sizes(name, a, parts)
    mk = lambda kind, label=None, env=None: EngineSpec(  # noqa: E731
        label or kind, kind, model, dtype="bfloat16", load_format="dummy",
        max_model_len=max(a.ttft_lengths) + a.ttft_suffix + 64,
        kv_cache_bytes=kv // a.tp, gpu_util=0.05, cpu_bytes=cpu, max_num_seqs=64, env=env or {}, cpus=tuple(a.cpus),
        eager=a.eager, attention_backend=lay.backend(a.attention_backend), connector=_kind_connector(name, kind),
        tp=a.tp, **dict(zip(("disk_dir", "disk_bytes"), pool_disk(kind, label or kind))))
    # variants: more engines of our spec, each with its own environment (an A/B in one run)
    specs = [mk(kind, label, env) for label, kind, env in pool_labels(a, name)]
    t0 = time.perf_counter()
    timeout = 480.0 if budget is None else max(60.0, min(480.0, budget.left() - 120))
    procs = start_all(specs, timeout=timeout, in_waves=a.start_waves)
    errs = {k: p.error for k, p in procs.items() if p.error}
    print(f"[{name}] engines up in {time.perf_counter() - t0:.0f}s ({kv / GiB:.0f} GiB device KV, {cpu / GiB:.0f} GiB "
          f"host KV each): " + ", ".join(f"{k} {p.start_s or 0:.0f}s" for k, p in procs.items())
          + (f"; errors {list(errs)}" if errs else ""), flush=True)
    return procs


def pool_kv_info(procs: dict) -> dict:
    out = {}
    for k, p in procs.items():
        if not p.error:
            try:
                out[k] = p.call("kv_info")
            except EngineError as e:
                out[k] = {"error": str(e)[:300]}
    return out


# ---------------------------------------------------------------------------- ttft, miss
def _reload(e, prompt, profile: bool = False) -> dict:
    """One timed reload: wait for stores, reset the device prefix cache, generate again."""
    fr = e.call("flush_reset")
    if not fr["ok"]:
        raise EngineError(f"reset_prefix_cache() kept failing ({fr})")
    return e.call("generate", prompts=prompt, max_tokens=1, steps=True, profile=profile)


def _keep_events(runs: list[dict]) -> dict:
    """The raw step timelines of the fastest, median and slowest rep (the rest: breakdowns)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["wall_s"])
    pick = {"fastest": order[0], "median": order[len(order) // 2], "slowest": order[-1]} if order else {}
    return {k: {"rep": i, "events": runs[i].get("events", [])} for k, i in pick.items()}



def with_suffix(prompts: list[list[int]], n: int, seed: int) -> list[list[int]]:
    """Each prompt followed by ``n`` new token ids (none cached anywhere: a seed of their own)."""
    return [p + unique_prompts(1, n, seed=seed)[0] for p in prompts] if n else prompts


def part_ttft(procs: dict, a, name: str = "uniform", budget: Budget | None = None) -> dict:
    """Reload TTFT: off (cold, device hit), then native and ours (and layerwise, with --layerwise)
    taking turns rep by rep (the one going first alternates), each rep with its step timeline
    (timeline.py). ``--ttft-suffix N``: each timed request is the stored prompt plus N new tokens
    (a later turn: the hit loads while the new tokens must be computed; the device hit likewise)."""
    reps = a.reps
    per_tok = LAYOUTS[name].model.kv_bytes_per_token()
    res: dict = {"model": f"{LAYOUTS[name].model.what}, dummy weights, bf16", "reps": reps, "rows": [],
                 "kv_bytes_per_token": per_tok, "errors": {}, "tp": getattr(a, "tp", 1)}
    ours = procs["ours"]
    res["hit_engine"] = hit_kind = "off" if "off" in procs else "ours"  # --no-off: ours' engine
    hit_eng = procs[hit_kind]
    try:
        res["bandwidth"] = ours.call("bandwidth", nbytes=GiB)
    except EngineError as e:
        res["errors"]["bandwidth"] = str(e)
    # --variant engines (ours with other settings) reload in turn with the rest, each compared with ours
    variants = tuple(label for label, _ in a.variant if label in procs)
    res["variants"] = {label: env for label, env in a.variant if label in variants}
    lmc = ("lmcache",) if "lmcache" in procs else ()  # --lmcache: LMCache reloads in turn with the others
    kinds = ("native", "ours") + (("layerwise",) if "layerwise" in procs else ()) + lmc + variants
    for L in a.ttft_lengths:
        if budget is not None and not budget.allows(60 + L / 1000 * 4):
            res["errors"][f"cut-{L}"] = f"not run: {budget.left():.0f}s left in the call's time budget"
            continue
        row: dict = {"prompt_tokens": L, "suffix_tokens": a.ttft_suffix}
        seed = 1000 + L
        # offload off: cold prefill of a new prompt, then the same prompt again (device prefix hit)
        # (--no-off: on ours' engine, its stores of the cold prompt flushed before the device hit)
        cold, hit = [], []
        for r in range(min(reps, a.off_reps) + 1):
            p = unique_prompts(1, L, seed=seed + 100 + r)
            c = hit_eng.call("generate", prompts=p, max_tokens=1)["wall_s"]
            if hit_kind != "off":
                hit_eng.call("flush_reset", reset=False)
            h = hit_eng.call("generate", prompts=with_suffix(p, a.ttft_suffix, seed + 700 + r),
                             max_tokens=1)["wall_s"]
            if r:
                cold.append(c)
                hit.append(h)
        row["cold_s"], row["device_hit_s"] = spread(cold), spread(hit)
        prompt = unique_prompts(1, L, seed=seed)
        live, runs = [], {k: [] for k in kinds}
        for kind in kinds:  # first run stores the prompt; one reload warms up
            try:
                row[f"{kind}_first_s"] = procs[kind].call("generate", prompts=prompt, max_tokens=1)["wall_s"]
                _reload(procs[kind], with_suffix(prompt, a.ttft_suffix, seed + 900))
                live.append(kind)
            except EngineError as e:
                res["errors"][f"{kind}-{L}"] = str(e)
        for r in range(reps):
            timed = with_suffix(prompt, a.ttft_suffix, seed + 1000 + r)  # the same request for every kind
            for kind in (live[:] if r % 2 == 0 else live[::-1]):  # a copy: a failing engine leaves ``live``
                try:
                    runs[kind].append(_reload(procs[kind], timed))
                except EngineError as e:
                    res["errors"][f"{kind}-{L}"] = str(e)
                    live.remove(kind)
        for r in range(a.profile_reps):  # after the timed reps: the profiler slows what it records
            for kind in (live[:] if r % 2 == 0 else live[::-1]):
                try:
                    row.setdefault(f"{kind}_profiles", []).append(_reload(procs[kind], prompt, profile=True)["profile"])
                except EngineError as e:
                    res["errors"][f"{kind}-{L}-profile"] = str(e)
        for kind in kinds:
            xs = runs[kind]
            row[f"{kind}_s"] = spread([g["wall_s"] for g in xs]) if xs else {"n": 0}
            row[f"{kind}_host_tokens"] = [g["rows"][0]["cached"] for g in xs]
            if kind == "lmcache":  # what LMCache's log says it retrieved (tensor_parallel_size 1)
                row["lmcache_retrieved"] = [g.get("lmcache_retrieved") for g in xs]
            row[f"{kind}_steps"] = [g["breakdown"] for g in xs]
            row[f"{kind}_step_events"] = _keep_events(xs)
        if runs["ours"]:
            xs = runs["ours"]
            row["ours_load_s"] = statistics.median(g["load_s"] for g in xs)
            row["ours_load_seen_s"] = statistics.median(g.get("load_wall_s", 0.0) for g in xs)  # submit -> poll saw it
            row["host_tokens"] = statistics.median(g["rows"][0]["cached"] for g in xs)
            row["ours_load_bytes"] = statistics.median(g["load_bytes"] for g in xs)
        for kind in ("layerwise",) + variants:
            if runs.get(kind):
                row[f"{kind}_load_s"] = statistics.median(g["load_s"] for g in runs[kind])
        if lmc:  # a reload in which LMCache served no hit recomputed the prompt: its TTFT is then no number
            row["lmcache_failed"] = lmcache_ttft_failure(row.get("lmcache_host_tokens") or [],
                                                         res["errors"].get(f"lmcache-{L}"), row.get("lmcache_retrieved"))
        bw = res.get("bandwidth", {}).get("h2d_gbps")
        if bw and row.get("host_tokens"):
            # the bytes that must cross the link: what ours loaded (a sliding-window group loads only its
            # window), else the host-hit tokens' KV over all layers; with tensor parallelism each rank
            # moves its share over its own GPU's link at the same time
            moved = row.get("ours_load_bytes") or row["host_tokens"] * per_tok
            row["ideal_s"] = moved / res["tp"] / (bw * 1e9) + row["device_hit_s"]["median"]
        res["rows"].append(row)
        print(f"[ttft] {L}: {json.dumps({k: v for k, v in row.items() if k.endswith('_s')}, default=str)}", flush=True)
    try:  # which copy paths and staging our worker used (after its calibration ran)
        res["worker"] = ours.call("worker_info")
        print(f"[ttft] our worker: {json.dumps(res['worker'])}", flush=True)
        if "layerwise" in kinds:  # how its reloads went: loads, FULL-graph steps, failures
            res["layerwise"] = procs["layerwise"].call("worker_info").get("layerwise")
            print(f"[ttft] layer-wise: {json.dumps(res['layerwise'])}", flush=True)
    except EngineError as e:
        res["errors"]["worker_info"] = str(e)
    return res



def lmcache_ttft_failure(host_tokens: list[int], error: str | None = None,
                         retrieved: list[int | None] | None = None) -> str | None:
    """Why LMCache's reload TTFT at one length is no number: an error, no timed reload, reloads in which
    LMCache served no token (degraded mode or nothing stored: it recomputed), or reloads whose hit it
    logged no retrieve for (``retrieved``: its tokens per reload, None where not counted: nothing was
    loaded, so the time is no reload's); None when every reload hit and was retrieved."""
    if error:
        return f"error: {error.splitlines()[0][:200]}"
    if not host_tokens:
        return "no timed reload"
    miss = sum(1 for t in host_tokens if not t)
    if miss:
        return f"LMCache served no hit in {miss} of {len(host_tokens)} reloads"
    dry = [t for t, r in zip(host_tokens, retrieved or []) if r == 0]
    if dry:
        return (f"LMCache reported a hit of {max(dry):,} tokens and logged no retrieve in {len(dry)} of "
                f"{len(host_tokens)} reloads: nothing was loaded")
    return None


def rotated(kinds: list[str], r: int) -> list[str]:
    """``kinds`` starting at round ``r``'s turn: each engine goes first in turn."""
    i = r % len(kinds)
    return kinds[i:] + kinds[:i]


def part_miss(procs: dict, a, name: str = "uniform", budget: Budget | None = None) -> dict:
    res: dict = {"model": f"{LAYOUTS[name].model.what}, dummy weights, bf16", "batch": a.miss_batch,
                 "prompt_tokens": a.miss_tokens, "max_tokens": a.miss_out, "runs": {k: [] for k in procs},
                 "store_gbps": [], "errors": {}, "variants": {label: env for label, env in a.variant}}
    kinds = [k for k in procs if not procs[k].error]
    walls: list[float] = []
    for r in range(a.miss_reps + 1):
        t_round = time.perf_counter()
        if budget is not None and walls and not budget.allows(1.3 * max(walls) + 20):
            res["cut_rounds"] = a.miss_reps + 1 - r
            print(f"[miss] {res['cut_rounds']} round(s) cut: {budget.left():.0f}s left in the call's budget", flush=True)
            break
        prompts = unique_prompts(a.miss_batch, a.miss_tokens, seed=50_000 + r)
        got = {}
        for k in rotated(kinds, r):  # who goes first changes every round
            try:
                with ClockSampler() as clocks:
                    got[k] = procs[k].call("generate", prompts=prompts, max_tokens=a.miss_out, timeout=240,
                                           steps=True)
                got[k]["clocks"] = clocks.summary(tail_s=MISS_DECODE_TAIL_S)
            except EngineError as e:
                res["errors"][f"{k}-{r}"] = str(e)
        if r and len(got) < len(kinds):  # a round some engine failed in pairs nothing: drop it for all
            res.setdefault("dropped_rounds", []).append(r)
        elif r:
            for k in kinds:
                g = got[k]
                res["runs"][k].append(g["wall_s"])
                res.setdefault("step_totals", {}).setdefault(k, []).append(g["totals"])
                res.setdefault("step_rows", {}).setdefault(k, []).append(g.get("step_rows", []))
                if g.get("threads"):
                    res.setdefault("threads", {}).setdefault(k, []).append(g["threads"])
                if g["clocks"]["samples"]:
                    res.setdefault("clocks", {}).setdefault(k, []).append(g["clocks"])
                if k == "ours" and g["store_s"] > 0:
                    res["store_gbps"].append(g["store_bytes"] / g["store_s"] / 1e9)
        print(f"[miss] round {r}: " + ", ".join(f"{k} {got[k]['wall_s']:.3f}s" for k in kinds if r and k in got),
              flush=True)
        walls.append(time.perf_counter() - t_round)
    if a.miss_profile_step and (budget is None or budget.allows(2 * max(walls, default=10) + 20)):
        _miss_profiles(procs, kinds, a, res)
    for k in procs:
        if procs[k].error:
            res["errors"][k] = procs[k].error
        elif procs[k].spec.kind == "ours":  # which paths and staging thresholds it ran with
            try:
                res.setdefault("worker", {})[k] = procs[k].call("worker_info")
            except EngineError as e:
                res["errors"][f"worker_info-{k}"] = str(e)
    return res



PROFILE_STEPS = 4  # engine steps in one miss profile: the device's idle gaps between steps show
MISS_DECODE_TAIL_S = 0.4  # the last part of a miss round: its decode steps (~0.55 s of 3.4 s on an H200)


def _miss_profiles(procs: dict, kinds: list[str], a, res: dict, rounds: int = 2) -> None:
    """After the timed rounds: ``rounds`` more, each engine profiling ``PROFILE_STEPS`` engine steps
    from step ``--miss-profile-step`` on (torch.profiler; kernels by device time, device busy time
    against its span). Why: ours' steady decode steps, long after the stores, ran ~1.6% longer on
    the device than off's, native's and the direct-store variant's (docs/benchmarks.md), while
    one profiled forward alone showed the same kernels and busy time: the gaps between them count."""
    for r in range(rounds):
        prompts = unique_prompts(a.miss_batch, a.miss_tokens, seed=60_000 + r)
        for k in rotated(kinds, r):
            try:
                g = procs[k].call("generate", prompts=prompts, max_tokens=a.miss_out, timeout=240,
                                  profile=True, profile_skip=a.miss_profile_step, profile_top=30,
                                  profile_steps=PROFILE_STEPS)
            except EngineError as e:
                res["errors"][f"{k}-profile-{r}"] = str(e)
                continue
            if g.get("profile"):
                res.setdefault("profiles", {}).setdefault(k, []).append(g["profile"])
    print(f"[miss] profiled step {a.miss_profile_step}: "
          + ", ".join(f"{k} {len(v)}" for k, v in (res.get("profiles") or {}).items()), flush=True)


# ---------------------------------------------------------------------------- multi-turn (the project's own client)
def _mt_conversations(a, seed: int) -> tuple[dict, list]:
    """The multi-turn workload; each ``seed`` gives new texts, so a later pass finds none of an
    earlier pass's prefixes cached."""
    from benchmarks.multiturn.generate import Conversation, generate

    cfg = {"filetype": "generate_conversations", "num_conversations": a.mt_conversations, "text_files": [],
           "seed": seed, "num_system_prompts": 1, "max_context_tokens": 7000,
           "prompt_input": {"num_turns": {"distribution": "constant", "value": 2 * a.mt_turns},
                            "common_prefix_num_tokens": {"distribution": "constant", "value": 500},
                            "prefix_num_tokens": {"distribution": "uniform", "min": 1000, "max": 2000},
                            "num_tokens": {"distribution": "constant", "value": 100}},
           "prompt_output": {"num_tokens": {"distribution": "constant", "value": 32}}}
    return cfg, [Conversation(c["id"], c["messages"]) for c in generate(cfg)["conversations"]]


def part_multiturn(work: Path, a, out: Path) -> dict:
    """Multi-turn serving, one ``vllm serve`` per spec. With ``--mt-reps 1`` each server is started,
    run and stopped in turn; with more, all servers stay up and take turns pass by pass (the one
    going first alternates; every pass has new texts), so passes pair up like miss rounds."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace
    from functools import partial

    from benchmarks.multiturn.compare import run_one
    from benchmarks.multiturn.driver import DriverConfig
    from benchmarks.multiturn.launcher import PLAIN_CHAT_TEMPLATE, vllm_server
    from benchmarks.multiturn.report import format_compare, run_payload, write_json
    from .engine import kv_transfer_config

    model = build_shape_model(work / "llama8b-v1000", "llama8b", 1000)  # server detokenizes: vocab = tokenizer's
    tmpl = work / "plain_chat_template.jinja"
    tmpl.write_text(PLAIN_CHAT_TEMPLATE)
    args = ["--dtype", "bfloat16", "--load-format", "dummy"] + (["--enforce-eager"] if a.eager else []) + [
            "--attention-backend", a.attention_backend,
            "--block-size", "16", "--max-model-len", "8192", "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(int(a.mt_device_kv_gib * GiB)), "--enable-prefix-caching",
            "--chat-template", str(tmpl), "--served-model-name", "llama8b", "--max-num-seqs", "32", "--seed", "0"]
    cfg, convs = _mt_conversations(a, 0)
    dcfg = DriverConfig(url="http://127.0.0.1", model=None, clients=a.mt_clients, max_active=a.mt_conversations,
                        warmup=2, timeout_s=120, temperature=0.0, ignore_eos=True, max_requests=None, progress=False)
    env = {**ENV, **CACHE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # a normal server: engine core in its own process
    logs = work / "mt_logs"
    res: dict = {"workload": cfg, "server_args": args, "cpu_bytes": (a.cpu_gib or 8) * GiB, "summaries": [], "errors": [],
                 "reps": a.mt_reps}
    payload = {}
    labels = ["off", "native", "ours"] + (["null"] if a.null else [])

    def server(label: str):
        extra = []
        if label in ("native", "null"):
            extra = ["--kv-transfer-config", json.dumps(kv_transfer_config(label, (a.cpu_gib or 8) * GiB, 64))]
        return partial(vllm_server, model, args + extra, offload=label == "ours", cpu_bytes=(a.cpu_gib or 8) * GiB,
                       block_size=64, env=env, startup_timeout_s=300, log_path=logs / f"server-{label}.log",
                       label=label, cpus=a.cpus)

    def one(label: str, conv_list: list, url: str | None, rep: int) -> None:
        t0 = time.perf_counter()
        try:
            run, s = run_one(conv_list, replace(dcfg, url=url) if url else dcfg, label, None if url else server(label))
        except Exception as e:  # noqa: BLE001 - record and go on with the next server
            res["errors"].append({"label": label, "rep": rep, "error": f"{type(e).__name__}: {e}"[-3000:]})
            return
        s["wall_with_start_s"], s["rep"] = time.perf_counter() - t0, rep
        res["summaries"].append(s)
        payload[label if a.mt_reps <= 1 else f"{label}#{rep}"] = run_payload(run, s)
        print(f"[multiturn] {label} pass {rep}: {s['requests_per_s']:.2f} req/s, TTFT p50 "
              f"{s['ttft_ms'].get('p50', 0):.0f} ms, TPOT p50 {s['tpot_ms'].get('p50', 0):.1f} ms, "
              f"{s['wall_with_start_s']:.0f}s", flush=True)

    if a.mt_reps <= 1:
        for label in labels:
            one(label, convs, None, 0)
    else:
        with contextlib.ExitStack() as stack:
            urls, cms = {}, {label: server(label)() for label in labels}
            with ThreadPoolExecutor(len(cms)) as pool:  # start together: each start takes about a minute
                futs = {label: pool.submit(cm.__enter__) for label, cm in cms.items()}
            for label, fut in futs.items():
                try:
                    urls[label] = fut.result()
                    stack.push(cms[label].__exit__)
                except Exception as e:  # noqa: BLE001
                    res["errors"].append({"label": label, "rep": -1, "error": f"{type(e).__name__}: {e}"[-3000:]})
            live = [k for k in labels if k in urls]
            for r in range(a.mt_reps):
                conv_r = convs if r == 0 else _mt_conversations(a, r)[1]
                for label in (live if r % 2 == 0 else live[::-1]):
                    one(label, conv_r, urls[label], r)
    by = {s["label"]: s for s in res["summaries"] if s["rep"] == 0}
    for k in labels[1:]:
        if "off" in by and k in by:
            res[f"compare_off_{k}"] = format_compare(by["off"], by[k])
    write_json(out / "multiturn_requests.json", payload)
    return res



# ---------------------------------------------------------------------------- main
def _variant(text: str) -> tuple[str, dict[str, str]]:
    label, _, rest = text.partition(":")
    pairs = [p.partition("=") for p in rest.split(",") if p]
    if not label or label in ("off", "native", "ours", "null") or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NEWLABEL:VAR=VAL[,VAR=VAL] "
                                         f"(a label other than off/native/ours/null)")
    return label, {k: v for k, _, v in pairs}


def _cpus(text: str) -> list[int]:
    """"4-7" or "4,5,8-9" -> [4, 5, 6, 7] / [4, 5, 8, 9]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if b < a:
                raise ValueError(part)
            out += range(a, b + 1)
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"--cpus {text!r}: expected CPU numbers like 4-7 or 4,5,8-9")
    return sorted(set(out))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpu_e2e.device", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", help="smoke smoke-serve correctness ttft miss serve multiturn reliability, or all "
                                             "(= correctness ttft miss serve; the default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_e2e_out"))
    ap.add_argument("--work", default="/tmp/gpu_e2e/work")
    ap.add_argument("--layouts", type=_layouts, default=["uniform"],
                    help=f"KV layouts to run, comma-separated: {', '.join(LAYOUTS)} or all (kv_layouts.py)")
    ap.add_argument("--eager", action="store_true",
                    help="enforce_eager (diagnosis); default: vLLM's default mode, torch.compile + CUDA graphs")
    ap.add_argument("--attention-backend", default="TRITON_ATTN",
                    help="attention backend of the non-MLA layouts (MLA: TRITON_MLA)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock budget of this call: steps that would end after it are skipped (reported)")
    ap.add_argument("--no-start-waves", dest="start_waves", action="store_false",
                    help="start every engine/server at once (default: those sharing a compile key start after the "
                         "first of them, which then loads its compiled graphs from the cache)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (>= 5)")
    ap.add_argument("--cpus", type=_cpus, default=[],
                    help="run every engine (ttft/miss) or server (multiturn) on these CPUs (e.g. 4-7). They take "
                         "turns, so sharing costs nothing, and a slow spell of a core then hits native and ours alike")
    ap.add_argument("--profile-reps", type=int, default=0,
                    help="ttft: reloads per spec and length whose first forward is profiled (torch.profiler), after the timed reps")
    ap.add_argument("--off-reps", type=int, default=5,
                    help="ttft: offload-off reps (cold prefill + device hit; a 32k cold prefill takes seconds)")
    ap.add_argument("--miss-reps", type=int, default=12,
                    help="timed miss rounds after one warm-up (engines take turns going first)")
    ap.add_argument("--miss-profile-step", type=int, default=0,
                    help="miss: after the timed rounds, two more in which each engine profiles the forward of "
                         "this step and the 3 after it (counted from the round's first; e.g. 40: steady decode steps)")
    ap.add_argument("--max-tokens", type=int, default=16, help="correctness: generated tokens per prompt")
    ap.add_argument("--grow-host-gib", type=int, default=0,
                    help="touch this much host memory (then free it) before planning: machines whose memory "
                         "grows as it is used (H200 x2) report too little at start")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor_parallel_size of every engine and server (correctness, ttft, miss, serve): "
                         "device KV per GPU is 1/tp of the single-GPU plan, host KV the same total; correctness "
                         "adds a per-rank table (host bytes = the rank's share, NUMA of host KV and GPU)")
    ap.add_argument("--ttft-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192, 32768])
    ap.add_argument("--ttft-suffix", type=int, default=0,
                    help="ttft: new tokens after the stored prompt in every timed request (a later turn: the "
                         "forward that layer-wise loads can overlap); 0: the stored prompt alone")
    ap.add_argument("--variant", action="append", default=[], type=_variant, metavar="LABEL:VAR=VAL[,VAR=VAL]",
                    help="one more engine of our spec in the pool, with these environment variables; the "
                         "miss part runs it beside the others (repeatable)")
    ap.add_argument("--layerwise", action="store_true",
                    help="add ours with layer-wise loads (engine.LAYERWISE_EXTRA, docs/layerwise.md) to the pool "
                         "(ttft, miss) of layouts with one KV-cache group; correctness always runs it there")
    ap.add_argument("--layerwise-load", choices=("true", "auto"), default="true",
                    help="the layerwise engines' and servers' layerwise_load: true (every qualifying hit) or auto "
                         "(only while no other request runs, hits of >= 4096 tokens with >= 512 tokens left "
                         "to compute)")
    ap.add_argument("--no-native", action="store_true",
                    help="pool without vLLM's native spec (room for one more variant; ttft needs native)")
    ap.add_argument("--no-off", action="store_true",
                    help="ttft: pool without offload off; cold and device-hit TTFT come from ours' engine (its "
                         "stores flushed first): room for --layerwise beside native and ours on an 80 GB card")
    ap.add_argument("--null", action="store_true",
                    help="add vLLM's spec without copies (null_spec.py) to the pool: the miss part then splits "
                         "the cost into vLLM's connector (null vs off) and the copies (native/ours vs null); "
                         "not with ttft (a reload would stop it). With multiturn: a "
                         "fourth server, for workloads with no offload hits only (its first load stops it)")
    ap.add_argument("--lmcache", action="store_true",
                    help="add LMCache (LMCacheConnectorV1, its host KV the same bytes as native's and ours') to "
                         "correctness (uniform, float32: equal to off, with LMCache hits after the reset) and to the "
                         "ttft/miss pool (reloads in turn with native and ours); needs LMCache staged")
    ap.add_argument("--disk", action="store_true",
                    help="add ours with its disk tier (ours-disk: NPUOffloadingConnector, GPU_E2E_DISK_BYTES in "
                         "GPU_E2E_DISK_ROOT, emptied first) to the ttft/miss pool: what the tier costs when nothing "
                         "is reused, paired with ours host-only")
    ap.add_argument("--kv-gib", type=int, default=0,
                    help="device KV per pool engine (GiB); 0: enough for the longest TTFT prompt and the miss batch")
    ap.add_argument("--cpu-gib", type=int, default=0,
                    help="host KV per offload engine of the pool (GiB); 0: 8, or 1.5x the longest prompt's KV")
    ap.add_argument("--miss-batch", type=int, default=48)
    ap.add_argument("--miss-tokens", type=int, default=2000)
    ap.add_argument("--miss-out", type=int, default=64)
    # serve (vLLM's client)
    ap.add_argument("--loads", default="8,32",
                    help=f"serve: client counts, comma-separated (sizes in serve.LOADS: {sorted(LOADS)}; others scaled)")
    ap.add_argument("--servers", default="",
                    help="serve: servers, comma-separated, of off native ours layerwise simple vsimple upper null, "
                         "the disk tiers ours-disk native-fs, LMCache's lmcache lmcache-disk (when staged), "
                         "or LAYOUT:KIND for native/ours/layerwise through another layout of the same model, or "
                         "ours/VARIANT (ours with run-time variables: serve.VARIANTS), ours-disk/VARIANT "
                         "(serve.DISK_VARIANTS); default per layout: "
                         + "; ".join(f"{k}: {v}" for k, v in DEFAULT_SERVERS.items()))
    ap.add_argument("--passes", type=int, default=3, help="serve, pair: passes (servers take turns, new texts each)")
    ap.add_argument("--pair-kill-at-s", type=float, default=8.0,
                    help="pair: seconds into the outage pass when mooncake_master is killed")
    ap.add_argument("--pair-down-s", type=float, default=12.0, help="pair: seconds the master stays down")
    ap.add_argument("--pairs", default="host,mooncake",
                    help="pair: the two pairs, the second measured against the first: two of host, mooncake, disk "
                         "(both servers on one disk folder)")
    ap.add_argument("--pair-load", choices=("turns", "cap"), default="turns",
                    help="pair: 24 conversations of 6 turns (turns) or the disk tier's capacity load (cap)")
    ap.add_argument("--no-pair-outage", dest="pair_outage", action="store_false",
                    help="pair: no pass with the master killed (nor the pass after it)")
    ap.add_argument("--seed", type=int, default=0, help="serve: seed of the corpora (new texts per pass)")
    ap.add_argument("--client-dir", default=str(Path(__file__).resolve().parents[2] / "vllm_multi_turn"),
                    help="serve: vLLM's benchmarks/multi_turn files (put there by `gpu_e2e.sh prepare`)")
    ap.add_argument("--faults", type=reliability.faults_arg, default=reliability.DEFAULT_FAULTS,
                    help="reliability: NPU_OFFLOAD_FAULTS of the ours-disk server (KIND=P,...; none: the hook off)")
    ap.add_argument("--smoke-layers", type=int, default=4, help="smoke: layers of each model (same per-layer shapes)")
    # the project's own multi-turn client (part multiturn)
    ap.add_argument("--mt-conversations", type=int, default=32)
    ap.add_argument("--mt-turns", type=int, default=4)
    ap.add_argument("--mt-reps", type=int, default=1,
                    help="multiturn passes; above 1 all servers stay up and take turns pass by pass, with new texts")
    ap.add_argument("--mt-clients", type=int, default=8)
    ap.add_argument("--mt-device-kv-gib", type=float, default=4.0, help="multiturn: device KV per server (GiB)")
    ap.set_defaults(smoke=False)
    return ap


def _layouts(text: str) -> list[str]:
    try:
        return parse_layouts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def part_serve(work: Path, a, out: Path, budget: Budget, meta: dict) -> dict:
    """vLLM's multi-turn client against the servers of each layout, at each load (serve.py)."""
    res: dict = {"meta": meta, "runs": []}
    loads = parse_loads(a.loads)
    for name in a.layouts:
        names = (a.servers or DEFAULT_SERVERS[name]).split(",")
        for load in loads:
            if not budget.allows(150):
                res.setdefault("cut", []).append({"layout": name, "clients": load.clients, "left_s": budget.left()})
                continue
            write = lambda r, done=list(res["runs"]): write_part(out, "serve", {**res, "runs": done + [r]})  # noqa: E731
            res["runs"].append(run_serve(name, load, names, a, work, out, budget, meta.get("gpu_bytes", 0),
                                         meta.get("host_bytes", 0), write=write))
    # an LMCache pass that ran degraded or without hits is failed (lmcache_log.failure)
    res["ok"] = bool(res["runs"]) and all(not r["errors"] and r["runs"] and not any(x.get("failed") for x in r["runs"])
                                          for r in res["runs"])
    return res


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.layerwise_load == "auto":  # read by engine.layerwise_extra, here and in every child process
        os.environ[LAYERWISE_MODE_ENV] = "auto"
    budget = Budget(a.budget_s)
    try:
        parts = parse_parts(a.parts)
        if "serve" in parts:
            parse_loads(a.loads)
    except (ValueError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.null and "ttft" in parts:
        print("error: --null engines store no bytes and stop at a reload; run ttft without it", file=sys.stderr)
        return 2
    if a.no_native and "ttft" in parts:
        print("error: --no-native leaves ttft nothing to compare with; run ttft without it", file=sys.stderr)
        return 2
    if a.no_off and ({"miss", "correctness", "smoke"} & set(parts)):
        print("error: --no-off is for ttft only (miss and correctness compare with offload off)", file=sys.stderr)
        return 2
    if a.lmcache:
        from .stage import LMCACHE_SITE, lmcache_status, lmcache_ready

        if not lmcache_ready(LMCACHE_SITE):
            print(f"error: --lmcache: {lmcache_status(LMCACHE_SITE)}", file=sys.stderr)
            return 2
    if a.cpus and a.mt_reps > 1 and "multiturn" in parts:
        print("error: --cpus with --mt-reps > 1 puts every server, up at once, on the same CPUs; idle vLLM servers "
              "still use CPU there (TPOT doubled in the one run that tried it): leave --cpus out", file=sys.stderr)
        return 2
    bad = sorted(set(a.cpus) - os.sched_getaffinity(0))
    if bad:
        print(f"error: --cpus {bad} not available here (allowed: {sorted(os.sched_getaffinity(0))})", file=sys.stderr)
        return 2
    os.environ.update(CACHE_ENV)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if a.grow_host_gib:
        print(f"[host] {grow_host(a.grow_host_gib << 30)}", flush=True)
    meta = gpu_meta(a)
    print(f"[meta] {json.dumps(meta)}", flush=True)
    rc, tables = 0, {}
    pool_parts = [p for p in parts if p in ("ttft", "miss")]
    for part in parts:
        t0 = time.perf_counter()
        if part in pool_parts:
            if part != pool_parts[0]:
                continue  # ran in the same pools
            results = run_pools(work, a, pool_parts, budget, meta)
        else:
            try:
                if part == "smoke":
                    res = part_smoke(work, a, budget, meta)
                elif part == "smoke-serve":
                    res = part_smoke_serve(work, a, budget, meta)
                elif part == "correctness":
                    res = part_correctness(work, a, budget)
                elif part == "serve":
                    res = part_serve(work, a, out, budget, meta)
                elif part == "pair":
                    from .pair import part_pair

                    res = part_pair(work, a, out, budget, meta, write=lambda r: write_part(out, "pair", r))
                elif part == "reliability":
                    res = reliability.part(work, a, out, budget, meta)
                else:
                    res = part_multiturn(work, a, out)
            except Exception as e:  # noqa: BLE001 - the other parts still run
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-6000:], "ok": False}
                print(res["traceback"], file=sys.stderr)
            results = {part: res}
        for name, res in results.items():
            rc |= 0 if res.get("ok", "error" not in res) else 1
            res["meta"], res["part_wall_s"] = meta, time.perf_counter() - t0
            tables[name] = write_part(out, name, res)
            print(f"\n== {name} ({res['part_wall_s']:.0f}s) ==\n{tables[name]}\n", flush=True)
    print("\n".join(f"\n== {k} ==\n{v}" for k, v in tables.items()))
    print(f"[budget] {budget.left():.0f}s of {a.budget_s:.0f}s left", flush=True)
    return rc


def run_pools(work: Path, a, pool_parts: list[str], budget: Budget, meta: dict) -> dict[str, dict]:
    """ttft and/or miss for every layout, one pool per layout: {part: {"layouts": {name: result}}}."""
    out: dict[str, dict] = {p: {"layouts": {}} for p in pool_parts}
    for name in a.layouts:
        lm = layout_meta(name, a)
        if not budget.allows(180):
            for p in pool_parts:
                out[p]["layouts"][name] = {"layout": lm, "error": f"cut: {budget.left():.0f}s left in the call's budget"}
            continue
        try:
            check_pool_fits(name, a, pool_parts, meta.get("gpu_bytes") or 0)
            got = run_pool_parts(work, a, name, pool_parts, budget)
            for p in pool_parts:
                out[p]["layouts"][name] = {**got[p], "layout": lm, "kv_info": got["kv_info"]}
        except Exception as e:  # noqa: BLE001 - the next layout still runs
            print(traceback.format_exc()[-6000:], file=sys.stderr)
            for p in pool_parts:
                out[p]["layouts"][name] = {"layout": lm, "error": f"{type(e).__name__}: {e}"}
                out[p]["ok"] = False
    return out


def run_pool_parts(work: Path, a, name: str, parts: list[str], budget: Budget) -> dict:
    """Start one layout's pool, run ttft and/or miss in it, stop it."""
    procs = start_pool(work, a, name, parts, budget)
    res: dict = {"kv_info": pool_kv_info(procs)}
    try:
        for part in parts:
            t0 = time.perf_counter()
            r = part_ttft(procs, a, name, budget) if part == "ttft" else part_miss(procs, a, name, budget)
            r["engine_start_s"] = {k: p.start_s for k, p in procs.items()}
            r["engine_errors"] = {k: p.error for k, p in procs.items() if p.error}
            r["part_wall_s"] = time.perf_counter() - t0
            res[part] = r
    finally:
        _close(procs)
    return res


if __name__ == "__main__":
    sys.exit(main())
