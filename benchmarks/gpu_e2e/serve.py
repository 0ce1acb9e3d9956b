"""Serving with vLLM's own multi-turn client, as users measure KV offload.

The client is vLLM 0.23.0's ``benchmarks/multi_turn/`` (``benchmark_serving_multi_turn.py``,
``bench_dataset.py``, ``bench_utils.py``), taken out of the sdist by ``stage.py prepare`` (its
sha256 is checked here before each run; vLLM's code is run, not committed). Workloads are in its
``generate_multi_turn.json`` format over a corpus the serving tokenizer knows (models.py), new
texts in every pass.

One call serves one layout (its model) at one or more loads. For each load, the chosen servers
(off, native, ours, layerwise = ours loading layer by layer, simple = our Simple connector, vsimple =
vLLM's SimpleCPUOffloadConnector, upper = offload off with device KV for every conversation, the disk
tiers ours-disk and native-fs, LMCache as lmcache and lmcache-disk, and ``LAYOUT:KIND`` for
native/ours/layerwise through another layout of the same model, e.g. ``perlayer:ours``) start
together with device KV sized in
tokens (``Load``), so that the active conversations do not fit, and stay up; then the passes: every
server takes the same workload in turn, the one going first alternates, each pass with new texts.
Per run: the client's per-request stats and vLLM's /metrics before and after (prefix-cache and
external hits, kv_offload bytes and time per direction, preemptions). Pure Python except the runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.multiturn.procs import io_bytes
from benchmarks.multiturn.resources import record_files
from vllm_npu_offload.tiers.disk_io import TMP_MARK  # in a record's name until its rename

from . import lmcache_log
from .engine import CACHE_ENV, ENV, LMCACHE_KINDS, NPU_CONNECTOR, kv_transfer_config, lmcache_env, lmcache_path
from .kv_layouts import LAYOUTS
from .models import SERVE_VOCAB

ROOT = Path(__file__).resolve().parents[2]
CLIENT_FILES = ("benchmark_serving_multi_turn.py", "bench_dataset.py", "bench_utils.py")
CLIENT_DIR = ROOT / "vllm_multi_turn"  # where prepare puts them (in the device's code copy)
SOURCE_JSON = "SOURCE.json"  # {"sdist": name, "sdist_sha256": ..., "files": {name: sha256}}
GiB = 1 << 30
OFFLOADERS = ("native", "ours", "layerwise", "simple", "vsimple", "null", "ours-disk", "native-fs") + LMCACHE_KINDS
DISK_KINDS = ("ours-disk", "native-fs", "lmcache-disk")
# Disk tiers' folders (a disk-backed path: /dev/shm is memory), emptied before the servers start, and the
# budget of ours and LMCache (all ranks together); native-fs has none, so its folder is emptied before
# every pass too (each pass has new texts: nothing in it could hit again). LMCache's is not emptied under
# it: LMCache indexes its files in memory and its eviction removes them (os.remove, 0.5.3's
# LocalDiskBackend.remove), which raises for a file deleted behind it; its budget bounds it, as ours'.
DISK_ROOT = Path(os.environ.get("GPU_E2E_DISK_ROOT", "/var/tmp/npu_offload_disk"))
DISK_BYTES = int(os.environ.get("GPU_E2E_DISK_BYTES", str(24 << 30)))
DISK_MARGIN = 2 << 30  # left free besides the tiers: compile caches, logs and the client's files share the disk
SERVER_KINDS = ("off", "upper") + OFFLOADERS
# "ours-disk/VARIANT": the disk tier with other kv_connector_extra_config values, beside the default
DISK_VARIANTS: dict[str, dict] = {
    "q0.5": {"disk_read_queue_s": 0.5}, "q2.5": {"disk_read_queue_s": 2.5},  # the cost rule's queue
    "reuse": {"disk_admit": "reuse"},
}
# "ours/allhost": ours with host KV for every conversation of a pass (upper_tokens): the capacity bound
# of the disk tier's load (what a tier below host could at best give back)
HOST_VARIANTS = ("allhost",)
# "ours/VARIANT": ours with run-time variables set (an A/B of one setting beside the default, same call);
# only variables the package reads (vllm_npu_offload/env.py)
VARIANTS: dict[str, dict[str, str]] = {
    "dstore": {"NPU_OFFLOAD_STAGED_STORES": "0"},  # stores direct on the copy engines, no SM gather
    "sstore": {"NPU_OFFLOAD_STAGED_STORES": "1"},  # stores staged from the measured size (CUDA default before 2026-11-26)
    "dload": {"NPU_OFFLOAD_STAGED": "0"},  # loads direct too (batch DMA into the pages, no SM scatter)
}
# Per server besides weights and KV: CUDA context, activations for 8192 batched tokens, CUDA graphs.
GPU_OVERHEAD = 3 * GiB
GPU_HEADROOM = 0.94  # of one GPU's memory that the engines or servers of one call may plan to take


def engine_gpu_bytes(weights: int, kv: int, tp: int = 1) -> int:
    """Planned GPU memory of one engine or server on each of its ``tp`` GPUs: its share of the
    weights and device KV plus the per-process overhead."""
    return (weights + kv) // tp + GPU_OVERHEAD

HOST_PER_SERVER = 6 * GiB  # an API server + engine core process, besides pinned KV
HOST_SHARE = 0.85  # of the machine's memory: processes and pinned KV of one call's servers
# ... of which pinned KV at most: two Gemma-2 servers at 47.5 GiB each on a 126 GiB H200 host did not
# both start (the second's start-up check refused it); the 8B at 32 clients (3 x 24 GiB) stays below
PIN_SHARE = 0.6


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Load:
    """One load: clients, active conversations, and the token budgets that size the servers."""

    clients: int
    active: int  # -k: conversations open at once over all clients
    conversations: int  # per pass (each runs all its turns)
    user_turns: int
    device_tokens: int  # device KV of off and the offload servers
    host_tokens: int  # host KV of the offload servers
    common_prefix: int = 500
    prefix_avg: int = 1000
    prefix_max: int = 3000
    user_tokens: tuple[int, int] = (120, 160)
    answer_tokens: tuple[int, int] = (80, 120)
    capacity: bool = False  # conversations far beyond device KV: running requests need not fit either

    def final_context(self, prefix: int) -> int:
        per_turn = (sum(self.user_tokens) + sum(self.answer_tokens)) / 2
        return int(self.common_prefix + prefix + self.user_turns * per_turn)

    @property
    def active_tokens(self) -> int:
        """KV of the open conversations at their end (average prefix)."""
        return self.active * self.final_context(self.prefix_avg)

    @property
    def upper_tokens(self) -> int:
        """Device KV of the upper bound: every conversation of a pass, with margin."""
        return int(self.conversations * self.final_context(self.prefix_avg) * 1.3) + self.clients * 512

    def check(self) -> None:
        if self.capacity:
            return
        if self.active_tokens <= self.device_tokens:
            raise PlanError(f"load {self.clients}: the {self.active} active conversations ({self.active_tokens} "
                            f"tokens) fit the device KV ({self.device_tokens} tokens): nothing to offload")
        if self.clients * self.final_context(self.prefix_avg) > self.device_tokens:
            raise PlanError(f"load {self.clients}: the running requests alone ({self.clients} x "
                            f"{self.final_context(self.prefix_avg)} tokens) do not fit {self.device_tokens} tokens")


LOADS: dict[int, Load] = {
    8: Load(clients=8, active=24, conversations=24, user_turns=4, device_tokens=32768, host_tokens=98304),
    32: Load(clients=32, active=64, conversations=64, user_turns=4, device_tokens=98304, host_tokens=196608),
}


# Agent-like conversations that outgrow host KV (the disk tiers' case): a 1.5k-token shared prompt,
# 2.5k-token histories, 40 conversations of ~5k tokens (8B shape: ~25 GiB) against 4 GiB of device KV
# and 8 GiB of host KV.
CAPACITY = Load(clients=32, active=40, conversations=40, user_turns=4, device_tokens=32768, host_tokens=65536,
                common_prefix=1500, prefix_avg=2500, prefix_max=5000, capacity=True)


def load_for(clients: int) -> Load:
    """The load for ``clients`` (LOADS, else scaled from the nearest: 2 active per client)."""
    if clients in LOADS:
        return LOADS[clients]
    if clients < 1:
        raise PlanError(f"load {clients}: needs >= 1 client")
    active = max(3 * clients, 8) if clients < 16 else 2 * clients
    base = Load(clients=clients, active=active, conversations=active, user_turns=4, device_tokens=0, host_tokens=0)
    ctx = base.final_context(base.prefix_avg)
    dev = max(int(clients * ctx * 1.3), 8192)
    dev = min(dev, int(base.active_tokens * 0.7))
    return replace(base, device_tokens=(dev + 1023) // 1024 * 1024,
                   host_tokens=(int(base.active_tokens * 1.5) + 1023) // 1024 * 1024)


def parse_loads(text: str) -> list[Load]:
    try:
        out = [CAPACITY if x.strip() == "cap" else load_for(int(x)) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise PlanError(f"--loads {text!r}: expected client counts like 8,32 or cap ({e})") from None
    if not out:
        raise PlanError(f"--loads {text!r}: no load")
    return out


# ---------------------------------------------------------------------------- servers
@dataclass(frozen=True)
class ServerPlan:
    label: str  # "ours", "perlayer:ours", "upper"
    kind: str  # kv_transfer_config kind ("upper" serves as off)
    layout: str
    device_kv_bytes: int
    cpu_bytes: int
    gpu_bytes: int  # planned GPU memory: weights + KV + overhead (per GPU with tensor parallelism)
    env: tuple[tuple[str, str], ...] = ()  # run-time variables of a variant ("ours/dstore")
    tp: int = 1  # tensor_parallel_size: device_kv_bytes and gpu_bytes are per GPU, cpu_bytes all ranks
    extra: tuple[tuple[str, Any], ...] = ()  # kv_connector_extra_config of a variant ("ours-disk/q2.5")
    # lmcache kinds: LMCache's configuration (engine.lmcache_env), set by plan_servers from the final cpu_bytes

    @property
    def disk_dir(self) -> Path | None:
        return DISK_ROOT / self.label.replace(":", "-").replace("/", "-") if self.kind in DISK_KINDS else None

    def kv_config(self, offload_block: int = 64) -> dict | None:
        if self.kind in ("off", "upper"):
            return None
        disk = self.disk_dir
        out = kv_transfer_config(self.kind, self.cpu_bytes, offload_block, LAYOUTS[self.layout].connector,
                                 str(disk) if disk else None, DISK_BYTES)
        if self.extra:
            out["kv_connector_extra_config"].update(dict(self.extra))
        tiered = {"mooncake_master", "disk_path"} & set(out.get("kv_connector_extra_config", {}))
        if tiered and out["kv_connector"] == "OffloadingConnector":
            # lower tiers prefetch a request's records on its arrival through our connector only
            out["kv_connector"], out["kv_connector_module_path"] = NPU_CONNECTOR
        return out


def parse_server(name: str, layout: str) -> tuple[str, str, str]:
    """"ours" -> (layout, ours, ""); "perlayer:ours" -> (perlayer, ours, ""); "ours/dstore" -> (layout,
    ours, dstore): a variant's run-time variables are ``VARIANTS[variant]``."""
    lay, _, kind = name.rpartition(":")
    lay = lay or layout
    kind, _, variant = kind.partition("/")
    if variant and not ((kind == "ours" and (variant in VARIANTS or variant in HOST_VARIANTS))
                        or (kind == "ours-disk" and variant in DISK_VARIANTS)):
        raise PlanError(f"server {name!r}: variants are ours/{{{','.join([*VARIANTS, *HOST_VARIANTS])}}} and "
                        f"ours-disk/{{{','.join(DISK_VARIANTS)}}}")
    if kind not in SERVER_KINDS:
        raise PlanError(f"server {name!r}: kind must be one of {SERVER_KINDS} (optionally LAYOUT:KIND)")
    if lay not in LAYOUTS:
        raise PlanError(f"server {name!r}: unknown layout {lay!r} ({list(LAYOUTS)})")
    if LAYOUTS[lay].shape != LAYOUTS[layout].shape:
        raise PlanError(f"server {name!r}: layout {lay} serves {LAYOUTS[lay].shape}, this run serves "
                        f"{LAYOUTS[layout].shape} ({layout}); one model per run")
    if lay != layout and kind not in ("native", "ours", "layerwise", "null", "ours-disk", "native-fs"):
        raise PlanError(f"server {name!r}: only native/ours/layerwise/null take another layout's connector")
    if kind == "layerwise" and not LAYOUTS[lay].layerwise:
        raise PlanError(f"server {name!r}: layer-wise loads need one KV-cache group; {lay} has "
                        f"{LAYOUTS[lay].kv_groups}")
    return lay, kind, variant


def plan_servers(layout: str, names: list[str], load: Load, gpu_bytes: int, host_bytes: int,
                 headroom: float = GPU_HEADROOM, layers: int | None = None, tp: int = 1) -> list[ServerPlan]:
    """The servers of one (layout, load) with their memory; PlanError when they do not fit together.
    ``layers``: the model's layer count when it runs with fewer (smoke). ``tp``: every server spans
    ``tp`` GPUs, each holding 1/tp of the weights and KV (``gpu_bytes``: one GPU's memory); the host
    KV (``cpu_bytes_to_use``) stays the total over ranks, as vLLM reads it."""
    if tp < 1:
        raise PlanError(f"--tp {tp}: needs >= 1")
    shape = LAYOUTS[layout].model
    per_tok = shape.kv_bytes_per_token(layers=layers)
    weights = shape.weight_bytes(SERVE_VOCAB, layers=layers)
    plans, seen = [], set()
    for name in names:
        lay, kind, variant = parse_server(name, layout)
        label = (kind if lay == layout else f"{lay}:{kind}") + (f"/{variant}" if variant else "")
        # (a LAYOUT: prefix is refused for lmcache kinds by parse_server: LMCache brings its own connector)
        if label in seen:
            raise PlanError(f"server {label!r} given twice")
        seen.add(label)
        tokens = load.upper_tokens if kind == "upper" else load.device_tokens
        kv = tokens * per_tok
        host_tokens = load.upper_tokens if variant in HOST_VARIANTS else load.host_tokens
        cpu = host_tokens * per_tok if kind in OFFLOADERS else 0
        env = VARIANTS.get(variant, {}) if kind == "ours" else {}
        extra = DISK_VARIANTS.get(variant, {}) if kind == "ours-disk" else {}
        plans.append(ServerPlan(label, kind, lay, kv // tp, cpu, engine_gpu_bytes(weights, kv, tp),
                                tuple(env.items()), tp, tuple(extra.items())))
    offloaders = [p for p in plans if p.cpu_bytes]
    if host_bytes and offloaders:
        # host KV is capped at an equal share of what the machine can pin (LRU evicts beyond it, as it
        # would for a user); a share below half the active conversations' KV would say little
        budget = min(HOST_SHARE * host_bytes - HOST_PER_SERVER * len(plans), PIN_SHARE * host_bytes)
        share = budget / len(offloaders)
        floor = load.active_tokens * per_tok / 2
        if share < floor:
            raise PlanError(
                f"{layout} at {load.clients} clients: {len(offloaders)} offload servers get {max(share, 0) / GiB:.1f} "
                f"GiB of host KV each, under half the active conversations' {2 * floor / GiB:.1f} GiB: fewer offload "
                f"servers per call")
        cap = int(share) // (64 * per_tok) * (64 * per_tok)  # whole offloaded blocks
        if sum(p.cpu_bytes for p in offloaders) > budget:  # equal shares, each capped
            bound = [p for p in offloaders if parse_server(p.label, layout)[2] in HOST_VARIANTS and p.cpu_bytes > cap]
            if bound:  # a bound with less than every conversation in host would not be one
                raise PlanError(f"{bound[0].label} needs {bound[0].cpu_bytes / GiB:.1f} GiB of host KV, over the "
                                f"{cap / GiB:.1f} GiB each of {len(offloaders)} offload servers may pin: fewer "
                                "offload servers in its call")
            plans = [replace(p, cpu_bytes=min(p.cpu_bytes, cap)) if p.cpu_bytes else p for p in plans]
    # LMCache reads its sizes from its environment: the host bytes as capped, the disk budget of ours-disk
    plans = [replace(p, env=tuple(lmcache_env(p.cpu_bytes, p.tp, str(p.disk_dir) if p.disk_dir else None,
                                              DISK_BYTES).items())) if p.kind in LMCACHE_KINDS else p for p in plans]
    gpu = sum(p.gpu_bytes for p in plans)
    if gpu_bytes and gpu > headroom * gpu_bytes:
        raise PlanError(
            f"{layout} at {load.clients} clients: {len(plans)} servers need {gpu / GiB:.1f} GiB of GPU memory "
            f"({', '.join(f'{p.label} {p.gpu_bytes / GiB:.1f}' for p in plans)}), over {headroom:.0%} of "
            f"{gpu_bytes / GiB:.1f} GiB: split --servers over two calls (keep off and native in both)")
    return plans


def disk_need(plans: list[ServerPlan], load: Load, per_tok: int) -> dict[str, int]:
    """Bytes each disk tier may hold at once: the budget of ours-disk and lmcache-disk (both fill it by the
    second pass: ours-disk 24.0 GiB, lmcache-disk 24.0 GiB on 2026-11-28), one pass's stores for native-fs
    (no budget; emptied before every pass): every conversation's KV at its end."""
    out = {}
    for p in plans:
        if p.kind in ("ours-disk", "lmcache-disk"):
            out[p.label] = DISK_BYTES
        elif p.kind == "native-fs":
            out[p.label] = load.conversations * load.final_context(load.prefix_avg) * per_tok
    return out


def check_disk(need: dict[str, int], free: int, root: Path = DISK_ROOT) -> None:
    """PlanError before any server starts when the disk tiers together (``disk_need``) could fill the
    disk that holds ``root`` (``free`` bytes, DISK_MARGIN kept): ENOSPC in a pass fails every server."""
    if need and sum(need.values()) > free - DISK_MARGIN:
        each = ", ".join(f"{k} {v / GiB:.1f}" for k, v in need.items())
        raise PlanError(
            f"disk tiers need up to {sum(need.values()) / GiB:.1f} GiB ({each}) in {root}, which has "
            f"{free / GiB:.1f} GiB free ({DISK_MARGIN / GiB:.0f} GiB kept): fewer disk servers per call, or a "
            f"smaller budget (GPU_E2E_DISK_BYTES, bytes; now {DISK_BYTES / GiB:.1f} GiB)")


def server_args(plan: ServerPlan, load: Load, *, eager: bool, attention_backend: str, chat_template: str,
                served_name: str, max_model_len: int = 8192, offload_block: int = 64) -> list[str]:
    args = ["--dtype", "bfloat16", "--load-format", "dummy", "--attention-backend", attention_backend,
            "--block-size", "16", "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.05",
            "--kv-cache-memory-bytes", str(plan.device_kv_bytes), "--enable-prefix-caching",
            "--chat-template", chat_template, "--served-model-name", served_name,
            "--max-num-seqs", str(max(64, 2 * load.clients)), "--seed", "0"]
    if eager:
        args.append("--enforce-eager")
    if plan.tp > 1:
        args += ["--tensor-parallel-size", str(plan.tp)]
    kt = plan.kv_config(offload_block)
    if kt is not None:
        args += ["--kv-transfer-config", json.dumps(kt)]
    return args


def server_env(p: ServerPlan, base: dict[str, str]) -> dict[str, str]:
    """A server's variables over the launcher's (``os.environ``): ``base``, the plan's own (a variant's,
    LMCache's configuration), and for LMCache servers PYTHONPATH with LMCache's folder after vLLM's site
    (the launcher puts the checkout first)."""
    env = {**base, **dict(p.env)}
    if p.kind in LMCACHE_KINDS:
        env["PYTHONPATH"] = lmcache_path(os.environ.get("PYTHONPATH", ""))
    return env


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def server_log_info(text: str) -> dict:
    """What a server's log says it ran: cross-layer KV, KV tokens, compile and graph-capture time."""
    out: dict = {"cross_layer_blocks": "Allocating a cross layer KV cache" in text}
    for key, pat, conv in (("kv_tokens", r"GPU KV cache size: ([\d,]+) tokens", lambda s: int(s.replace(",", ""))),
                           ("compile_s", r"torch\.compile took ([\d.]+) s in total", float),
                           ("graph_capture_s", r"Graph capturing finished in ([\d.]+) secs", float),
                           ("graph_gib", r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB", float)):
        m = re.findall(pat, text)
        if m:
            out[key] = conv(m[-1])
    out["hma_off"] = "Turning off hybrid kv cache manager" in text
    for name in ("disk", "mooncake"):
        tier = re.findall(rf"{name} tier: (hits \d+ .*)", text)
        if tier:
            out[f"{name}_tier"] = tier[-1].strip()  # the counters over every pass, as last logged
    if "LMCache" in text:
        out["lmcache"] = lmcache_log.log_info(text)  # every lookup so far (warm-up included); degraded
    return out


# ---------------------------------------------------------------------------- the client
def client_sources(client_dir: Path = CLIENT_DIR) -> dict:
    """The client's files and their sha256, checked against SOURCE.json (written by prepare)."""
    client_dir = Path(client_dir)
    src = client_dir / SOURCE_JSON
    if not src.exists():
        raise FileNotFoundError(f"{src}: vLLM's multi-turn client is not there; run `scripts/dev/gpu_e2e.sh prepare`")
    man = json.loads(src.read_text())
    for name in CLIENT_FILES:
        digest = hashlib.sha256((client_dir / name).read_bytes()).hexdigest()
        if digest != man["files"].get(name):
            raise ValueError(f"{client_dir / name}: sha256 {digest} differs from {SOURCE_JSON} "
                             f"({man['files'].get(name)})")
    return man


def workload(load: Load, text_file: str) -> dict:
    """vLLM's generate_multi_turn.json format (``num_turns`` counts user and assistant messages)."""
    return {
        "filetype": "generate_conversations",
        "num_conversations": load.conversations,
        "text_files": [text_file],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 2 * load.user_turns},
            "common_prefix_num_tokens": {"distribution": "constant", "value": load.common_prefix},
            "prefix_num_tokens": {"distribution": "lognormal", "average": load.prefix_avg, "max": load.prefix_max},
            "num_tokens": {"distribution": "uniform", "min": load.user_tokens[0], "max": load.user_tokens[1]},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": load.answer_tokens[0],
                                         "max": load.answer_tokens[1]}},
    }


def pass_workload(work: Path, name: str, load: Load, corpus_seed: int) -> Path:
    """One pass's workload for vLLM's client over a new corpus (``corpus_seed``): ``work/corpus/NAME.txt``
    and ``work/workloads/NAME.json``; returns the latter."""
    from .models import write_corpus

    corpus = write_corpus(work / "corpus" / f"{name}.txt", corpus_words_needed(load), seed=corpus_seed)
    wl = work / "workloads" / f"{name}.json"
    wl.parent.mkdir(parents=True, exist_ok=True)
    wl.write_text(json.dumps(workload(load, str(corpus)), indent=1))
    return wl


def corpus_words_needed(load: Load) -> int:
    """Words the client's generator reads from the corpus (bench_dataset.generate_conversations)."""
    turns = 2 * load.user_turns
    return (load.common_prefix + load.conversations * (load.prefix_max + turns)
            + turns * load.user_tokens[1] + 10_000)


def client_command(client_dir: Path, workload_path: Path, model_dir: str, served_name: str, url: str, load: Load,
                   seed: int, stats_path: Path, python: str = sys.executable) -> list[str]:
    return [python, str(client_dir / "benchmark_serving_multi_turn.py"), "--input-file", str(workload_path),
            "--model", model_dir, "--served-model-name", served_name, "--url", url,
            "--num-clients", str(load.clients), "--max-active-conversations", str(load.active),
            "--seed", str(seed), "--no-early-stop", "--request-timeout-sec", "300",
            "--stats-json-output", str(stats_path)]


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's and pandas' default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(rows: list[dict]) -> dict:
    """A run from the client's per-request stats: req/s as the client computes it (requests / from the
    first start to the end of the last-started request), TTFT of later turns (a history to reuse),
    TPOT, and the output-token counts (a dummy model must still stream every token)."""
    if not rows:
        return {"requests": 0}
    rows = sorted(rows, key=lambda r: r["start_time_ms"])
    runtime_s = (rows[-1]["start_time_ms"] + rows[-1]["latency_ms"] - rows[0]["start_time_ms"]) / 1e3
    later = [r["ttft_ms"] for r in rows if r["input_num_turns"] > 1]
    first = [r["ttft_ms"] for r in rows if r["input_num_turns"] <= 1]
    tpot = [r["tpot_ms"] for r in rows if r["tpot_ms"] > 0]
    p = lambda xs, q: percentile(xs, q)  # noqa: E731
    return {
        "requests": len(rows), "runtime_s": runtime_s, "requests_per_s": len(rows) / runtime_s if runtime_s > 0 else 0.0,
        "ttft_later_ms": {"n": len(later), "p50": p(later, 0.5), "p90": p(later, 0.9), "p99": p(later, 0.99)},
        "ttft_first_ms": {"n": len(first), "p50": p(first, 0.5)},
        "tpot_ms": {"n": len(tpot), "p50": p(tpot, 0.5), "p99": p(tpot, 0.99)},
        "output_tokens": sum(r["output_num_tokens"] for r in rows),
        "input_tokens": sum(r["input_num_tokens"] for r in rows),
        "empty_outputs": sum(1 for r in rows if r["output_num_tokens"] == 0),
    }


# ---------------------------------------------------------------------------- /metrics
PROM = {
    "vllm:prefix_cache_queries": "prefix_queries", "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:external_prefix_cache_queries": "external_queries", "vllm:external_prefix_cache_hits": "external_hits",
    "vllm:num_preemptions": "preemptions", "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:request_success": "requests_finished",  # summed over finished_reason
    # 0.32 names: bytes and seconds per direction
    "vllm:kv_offload_load_bytes": "load_bytes", "vllm:kv_offload_store_bytes": "store_bytes",
    "vllm:kv_offload_load_time": "load_s", "vllm:kv_offload_store_time": "store_s",
}
# 0.23 names: one counter per kind, labelled transfer_type="CPU_to_GPU" (load) or "GPU_to_CPU" (store)
PROM_LABELLED = {"vllm:kv_offload_total_bytes": "bytes", "vllm:kv_offload_total_time": "s"}
DIRECTION = {"CPU_to_GPU": "load", "GPU_to_CPU": "store"}
_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|\+Inf|-Inf)')


def parse_metrics(text: str) -> dict[str, float]:
    """The counters above from a Prometheus text page, summed over engines."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", m.group(3)
        base = name[:-6] if name.endswith("_total") else name
        try:
            v = float(val)
        except ValueError:
            continue
        if base in PROM:
            key = PROM[base]
        elif base == "vllm:prompt_tokens_by_source":  # computed / device prefix cache / from a connector
            src = re.search(r'source="([^"]+)"', labels)
            if src is None:
                continue
            key = f"prompt_{src.group(1)}"
        elif base in PROM_LABELLED:
            t = re.search(r'transfer_type="([^"]+)"', labels)
            direction = DIRECTION.get(t.group(1)) if t else None
            if direction is None:
                continue
            key = f"{direction}_{PROM_LABELLED[base]}"
        else:
            continue
        out[key] = out.get(key, 0.0) + v
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            return parse_metrics(r.read().decode(errors="replace"))
    except OSError:
        return {}


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# ---------------------------------------------------------------------------- the part
def complete(url: str, name: str, prompt: str, max_tokens: int, timeout: float = 120.0, **extra) -> dict:
    """One greedy completion (``extra``: more request fields); the server's JSON answer."""
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       **extra}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _warm(url: str, name: str, device_tokens: int = 0, words: int = 600, chunk: int = 4000) -> float:
    """Before the passes: one completion (prefill, decode, a store); for an offload server then
    enough other prompts to push it out of the device KV (``device_tokens``) and the first prompt
    again, so that the first load from host (and any kernel it compiles on first use) happens here,
    not in pass 0."""
    import random

    t0 = time.perf_counter()
    first = " ".join(f"w{i % 700}" for i in range(words))
    complete(url, name, first, 8)
    if device_tokens:
        rng = random.Random(device_tokens)
        for _ in range(device_tokens // chunk + 2):
            complete(url, name, " ".join(f"w{rng.randrange(700)}" for _ in range(chunk)), 1)
        complete(url, name, first, 8)
    return time.perf_counter() - t0


class Budget:
    """Wall-clock budget of one device call: parts ask before they start something long."""

    def __init__(self, seconds: float, t0: float | None = None):
        self.seconds, self.t0 = seconds, time.monotonic() if t0 is None else t0

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def allows(self, need_s: float) -> bool:
        return self.left() >= need_s


def run_serve(layout: str, load: Load, names: list[str], a, work: Path, out: Path, budget: Budget,
              gpu_bytes: int, host_bytes: int, write=None) -> dict:
    """Start the servers of one (layout, load), run the passes, stop them. ``write(res)`` is called
    after every run (partial results survive a call cut off by its time limit)."""
    from benchmarks.multiturn.launcher import PLAIN_CHAT_TEMPLATE, vllm_server

    from .models import build_shape_model

    lay = LAYOUTS[layout]
    backend = lay.backend(a.attention_backend)
    res: dict = {"layout": layout, "blocks": lay.blocks, "model": lay.model.what, "load": asdict(load),
                 "servers": [], "runs": [], "errors": [], "passes": a.passes, "mode": "eager" if a.eager else "default",
                 "attention_backend": backend, "offload_block": 64}
    try:
        src = client_sources(Path(a.client_dir))
        res["client"] = {"sdist": src.get("sdist"), "sdist_sha256": src.get("sdist_sha256"), "files": src["files"]}
        load.check()
        layers = a.smoke_layers if a.smoke else None
        plans = plan_servers(layout, names, load, gpu_bytes, host_bytes, layers=layers, tp=getattr(a, "tp", 1))
    except (PlanError, OSError, ValueError) as e:
        res["errors"].append({"label": "-", "pass": -1, "error": f"{type(e).__name__}: {e}"})
        return res
    res["servers"] = [asdict(p) for p in plans]
    model = build_shape_model(work / f"{lay.shape}-serve{layers or ''}", lay.shape, SERVE_VOCAB, layers)
    tmpl = work / "plain_chat_template.jinja"
    tmpl.write_text(PLAIN_CHAT_TEMPLATE)
    served = lay.shape
    env = {**ENV, **CACHE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    logs = work / "serve_logs"
    tag = f"{layout}-{load.clients}"
    def log_of(p: ServerPlan) -> Path:
        return logs / f"{tag}-{p.label.replace(':', '-').replace('/', '-')}.log"

    def make_cm(p: ServerPlan, timeout_s: float):
        return vllm_server(model, server_args(p, load, eager=a.eager, attention_backend=backend,
                                              chat_template=str(tmpl), served_name=served),
                           env=server_env(p, env), startup_timeout_s=timeout_s,
                           log_path=log_of(p), label=p.label)

    from .stage import LMCACHE_SITE, lmcache_ready

    if any(p.kind in LMCACHE_KINDS for p in plans) and not lmcache_ready(LMCACHE_SITE):
        res["errors"] += [{"label": p.label, "pass": -1, "error": f"LMCache is not installed in {LMCACHE_SITE}: "
                           "stage it (prepare with .cache/lmcache, then install)"} for p in plans
                          if p.kind in LMCACHE_KINDS]
        plans = [p for p in plans if p.kind not in LMCACHE_KINDS]
        res["servers"] = [asdict(p) for p in plans]
    for p in plans:
        if p.disk_dir is not None:  # a fresh tier: records of an earlier call's texts say nothing
            shutil.rmtree(p.disk_dir, ignore_errors=True)
            p.disk_dir.mkdir(parents=True, exist_ok=True)
    need = disk_need(plans, load, lay.model.kv_bytes_per_token(layers=layers))
    if need:
        try:
            check_disk(need, shutil.disk_usage(DISK_ROOT).free)
        except PlanError as e:
            res["errors"].append({"label": "-", "pass": -1, "error": f"PlanError: {e}"})
            return res
        res["disk_need"] = need
    t0 = time.perf_counter()
    # all start waves end by this: the passes need at least one run's time after it
    deadline = time.monotonic() + max(60.0, min(600.0, budget.left() - 120))
    cms: dict = {}
    urls, errors = start_servers(make_cm, plans, getattr(a, "start_waves", True), deadline, cms)
    try:
        res["errors"] += [{"label": k, "pass": -1, "error": v} for k, v in errors.items()]
        res["start_wall_s"] = time.perf_counter() - t0
        res["server_logs"] = {}
        for p in plans:
            log = log_of(p)
            res["server_logs"][p.label] = server_log_info(log.read_text(errors="replace")) if log.exists() else {}
        live = [p.label for p in plans if p.label in urls]
        plan_by = {p.label: p for p in plans}
        for label in list(live):
            p = plan_by[label]
            evict = load.device_tokens if p.cpu_bytes else 0  # offloaders: make the first reload happen here
            try:
                res.setdefault("warm_s", {})[label] = _warm(urls[label], served, evict)
            except OSError as e:
                res["errors"].append({"label": label, "pass": -1, "error": f"warm-up: {e}"})
                live.remove(label)
        print(f"[serve] {tag}: {len(live)}/{len(plans)} servers up in {res['start_wall_s']:.0f}s: "
              + json.dumps(res["server_logs"]), flush=True)
        walls: list[float] = []  # the next run is expected to take the longest so far x 1.25 (90 s before any)
        for r in range(a.passes):
            wl = pass_workload(work, f"{tag}-pass{r}", load, hash_seed(layout, load.clients, r, a.seed))
            order = live if r % 2 == 0 else live[::-1]
            for label in live:
                if plan_by[label].kind == "native-fs" and r > 0:
                    _empty(plan_by[label].disk_dir)
            for label in order:
                est = 1.25 * max(walls) if walls else 90.0
                if not budget.allows(est + 45):
                    res.setdefault("cut", []).append({"pass": r, "label": label, "left_s": budget.left()})
                    continue
                t1 = time.perf_counter()
                lmc = plan_by[label].kind in LMCACHE_KINDS
                offset = _size(log_of(plan_by[label])) if lmc else 0
                run = run_one(label, urls[label], model, served, wl, load, a, work / "client" / f"{tag}-{label}-{r}",
                              seed=r, timeout=max(30.0, budget.left() - 40))
                run.update(label=label, pass_=r, wall_s=time.perf_counter() - t1,
                           disk_bytes_now=_du(plan_by[label].disk_dir))
                if plan_by[label].kind == "ours-disk":  # each rank's records (TP: every rank its own share)
                    run["disk_ranks_now"] = disk_ranks(plan_by[label].disk_dir)
                if lmc:  # LMCache's own word on this pass: a degraded or hitless pass is failed, not a number
                    run["lmcache"], _ = lmcache_log.read_pass(log_of(plan_by[label]), offset)
                    why = lmcache_log.failure(run["lmcache"])
                    if why:
                        run["failed"] = why
                res["runs"].append(run)
                walls.append(run["wall_s"])
                s = run.get("summary", {})
                print(f"[serve] {tag} pass {r} {label}: {run_line(s)}, TPOT p50 {_f(s.get('tpot_ms', {}).get('p50'))}"
                      f" ms, host-hit tok {run.get('metrics', {}).get('external_hits', 0):.0f}, "
                      f"io r/w {run['io']['read_bytes'] / 1e9:.1f}/{run['io']['write_bytes'] / 1e9:.1f} GB, "
                      f"{s.get('requests', 0)} requests, "
                      f"{run['wall_s']:.0f}s{' ERROR ' + run['error'][:200] if run.get('error') else ''}"
                      + (f", LMCache hit/to load/retrieved tok {run['lmcache']['hit_tokens']}/{run['lmcache']['loaded_tokens']}"
                         f"/{run['lmcache'].get('retrieved_tokens', 0)}"
                         if "lmcache" in run else "")
                      + ("".join(f", disk r{k} {v['files']} files {v['bytes'] / 1e9:.1f} GB"
                                 for k, v in run["disk_ranks_now"].items()) if len(run.get("disk_ranks_now") or {}) > 1
                         else "")
                      + (f" FAILED: {run['failed']}" if run.get("failed") else ""), flush=True)
                if write:
                    write(res)
        for p in plans:  # the logs after the passes: the tiers' counters as last logged, LMCache's lookups
            log = log_of(p)
            if log.exists():
                res["server_logs"][p.label] = server_log_info(log.read_text(errors="replace"))
    finally:
        t2 = time.perf_counter()
        stop_servers(cms, list(urls))
        res["stop_wall_s"] = time.perf_counter() - t2
    return res


def _empty(d: Path) -> None:
    for child in d.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


def server_compile_key(p: ServerPlan) -> tuple:
    """Servers whose compiled graphs are the same (VllmConfig.compute_hash): KV bytes and whether a
    connector is configured; the connector's own config hashes to nothing."""
    return (p.kind in ("off", "upper"), p.device_kv_bytes)


def start_servers(make_cm, plans: list[ServerPlan], in_waves: bool, deadline: float,
                  cms: dict) -> tuple[dict[str, str], dict[str, str]]:
    """Start the servers in parallel, in start waves (the first server of each compile key, then
    the rest, which load its graphs from the cache), every wave bounded by ``deadline``
    (``time.monotonic()``): urls and errors by label. ``make_cm(plan, timeout_s)`` gives a server's
    context manager (``vllm_server``); the entered ones are put in ``cms`` (for ``stop_servers``)."""
    from concurrent.futures import ThreadPoolExecutor

    from .engine import waves

    urls, errors = {}, {}
    for wave in (waves(plans, server_compile_key) if in_waves else [plans]):
        left = deadline - time.monotonic()
        if left < 20:
            errors.update({p.label: f"not started: the call's time budget ran out ({left:.0f}s left)" for p in wave})
            continue
        for p in wave:
            cms[p.label] = make_cm(p, left)
        with ThreadPoolExecutor(len(wave)) as pool:
            futs = {p.label: pool.submit(cms[p.label].__enter__) for p in wave}
        for label, fut in futs.items():
            try:
                urls[label] = fut.result()
            except Exception as e:  # noqa: BLE001 - the others still run
                errors[label] = f"{type(e).__name__}: {e}"[-3000:]
    return urls, errors


def stop_servers(cms: dict, labels: list[str]) -> None:
    """Stop the started servers together (each waits up to its grace period)."""
    from concurrent.futures import ThreadPoolExecutor

    if labels:
        with ThreadPoolExecutor(len(labels)) as pool:
            list(pool.map(lambda k: cms[k].__exit__(None, None, None), labels))


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def run_line(s: dict) -> str:
    """A run's summary (``summarize``) for the progress lines: req/s, later-turn TTFT p50 and p99."""
    t = s.get("ttft_later_ms", {})
    return f"{s.get('requests_per_s', 0):.2f} req/s, later-turn TTFT p50 {_f(t.get('p50'))} p99 {_f(t.get('p99'))} ms"


def hash_seed(layout: str, clients: int, r: int, seed: int) -> int:
    """A corpus seed per (layout, load, pass): new texts in every pass, the same for every server."""
    return int(hashlib.sha256(f"{layout}/{clients}/{r}/{seed}".encode()).hexdigest()[:8], 16)


def _server_pids(url: str) -> list[int]:
    from benchmarks.multiturn.procs import listening_pid, tree_pids

    try:
        return tree_pids(listening_pid(url))
    except (RuntimeError, OSError, ValueError):
        return []


_RANK_SUFFIX = re.compile(r"\.r(\d+)$")


def disk_ranks(d: Path | None) -> dict[int, dict[str, int]]:
    """Our disk tier's records in ``d`` by rank (``<key>.r<rank>``, disk_io.py; temporaries left out):
    files and bytes each, the tensor-parallel check that every rank writes its own share."""
    out: dict[int, dict[str, int]] = {}
    for f, st in record_files(d) if d is not None else ():
        m = _RANK_SUFFIX.search(f.name)
        if m is None or TMP_MARK in f.name:
            continue
        acc = out.setdefault(int(m.group(1)), {"files": 0, "bytes": 0})
        acc["files"] += 1
        acc["bytes"] += st.st_size
    return dict(sorted(out.items()))


def _du(d: Path | None) -> int:
    if d is None or not d.is_dir():
        return 0
    total = 0
    for f in d.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            continue
    return total


def scrape_all(urls: list[str]) -> dict[str, float]:
    """``scrape`` of several servers, summed."""
    out: dict[str, float] = {}
    for u in urls:
        for k, v in scrape(u).items():
            out[k] = out.get(k, 0.0) + v
    return out


def run_one(label: str, url: str, model: str, served: str, wl: Path, load: Load, a, run_dir: Path, seed: int,
            timeout: float, servers: list[str] | None = None) -> dict:
    """One client run against ``url``: its stats, summary and /metrics delta. ``servers``: the servers
    behind ``url`` when it is a router (their /metrics and processes summed; default ``[url]``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stats = run_dir / "stats.json"
    cmd = client_command(Path(a.client_dir), wl, model, served, url, load, seed, stats)
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    servers = servers or [url]
    before = scrape_all(servers)
    pids = [p for u in servers for p in _server_pids(u)]
    io0 = io_bytes(pids)
    out: dict = {}
    try:
        p = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=timeout)
        (run_dir / "client.log").write_text(p.stdout + p.stderr)
        m = re.findall(r"requests_per_sec = ([\d.]+)", p.stdout + p.stderr)
        if m:
            out["client_requests_per_s"] = float(m[-1])
        if p.returncode != 0:
            out["error"] = f"client exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}"
    except subprocess.TimeoutExpired as e:
        out["error"] = f"client timed out after {timeout:.0f}s"
        (run_dir / "client.log").write_text(str(e.stdout or "") + str(e.stderr or ""))
    after = scrape_all(servers)
    io1 = io_bytes(pids)
    out["io"] = {k: io1[k] - io0[k] for k in io0}  # the server's processes' storage reads and writes
    out["metrics"] = metrics_delta(before, after)
    rows = json.loads(stats.read_text()) if stats.exists() else []
    out["summary"] = summarize(rows)
    out["rows"] = [[r["input_num_turns"], r["input_num_tokens"], r["output_num_tokens"], round(r["ttft_ms"], 2),
                    round(r["tpot_ms"], 3), round(r["latency_ms"], 1)] for r in rows]
    return out


__all__ = ["Budget", "LOADS", "Load", "PlanError", "ServerPlan", "client_command", "client_sources",
           "load_for", "metrics_delta", "parse_loads", "parse_metrics", "percentile", "plan_servers", "run_serve",
           "server_args", "server_log_info", "summarize", "workload", "complete"]
