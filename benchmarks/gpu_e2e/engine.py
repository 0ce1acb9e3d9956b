"""One vLLM engine in its own process, driven over a pipe.

Why a process per engine: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (needed to read our
transfer totals in-process) deleting an ``LLM`` does not free its GPU memory. Several of these
can stay alive at once and take batches in turn (the interleaved miss-cost runs).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from benchmarks.multiturn import NPU_CONNECTOR  # the connector whose prefetch the tiers use

from . import forward_profile, lmcache_log, ranks, timeline
from .stage import LMCACHE_SITE

SPEC_MODULE = "vllm_npu_offload.integration.spec"
SIMPLE_MODULE = "vllm_npu_offload.integration.simple_connector"
NULL_MODULE = "benchmarks.gpu_e2e.null_spec"
# layerwise: ours loading host hits layer group by layer group inside the step (docs/layerwise.md)
LAYERWISE_EXTRA = {"layerwise_load": True, "layerwise_min_tokens": 256, "layerwise_groups": 4}
# device.py --layerwise-load auto sets it (children inherit it): the layerwise kind in "auto" mode, with
# auto's own min_tokens (layer by layer only while nothing else runs; vllm_npu_offload options.py)
LAYERWISE_MODE_ENV = "GPU_E2E_LAYERWISE_LOAD"


def layerwise_extra() -> dict:
    """The layerwise kind's keys: LAYERWISE_EXTRA, or its "auto" form under LAYERWISE_MODE_ENV=auto."""
    if os.environ.get(LAYERWISE_MODE_ENV) == "auto":
        return {"layerwise_load": "auto", "layerwise_groups": LAYERWISE_EXTRA["layerwise_groups"]}
    return dict(LAYERWISE_EXTRA)


KINDS = ("off", "native", "ours", "layerwise", "simple", "vsimple", "null", "ours-disk", "native-fs", "lmcache",
         "lmcache-disk")
# LMCache (vLLM's LMCacheConnectorV1 running LMCache's own adapter; ``use_native`` unset): its sizes and
# paths are read from its environment (``lmcache_env``), and it is imported from LMCACHE_SITE, which only
# these engines and servers get on their path (after vLLM's site: LMCache's declared dependencies are
# not installed, vLLM's stay)
LMCACHE_KINDS = ("lmcache", "lmcache-disk")
LMCACHE_CHUNK = 256  # tokens per LMCache chunk (its default; stores and hits are whole chunks)
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # NVLink multicast stays off (the GPU machines' rule: it can take a shared host's GPUs out of
    # service): the image sets the first three; set here too, so no engine or server runs without
    # them, and vLLM's symmetric-memory all-reduce (which asks for multicast) is not tried at all.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}
# Compile caches of the default mode (torch.compile, Triton, Inductor) under /tmp: the GPU machine
# keeps /tmp while it stays warm, so a later call reuses what an earlier one compiled.
CACHE_ROOT = "/tmp/gpu_e2e/cache"
CACHE_ENV = {
    "VLLM_CACHE_ROOT": f"{CACHE_ROOT}/vllm",
    "TRITON_CACHE_DIR": f"{CACHE_ROOT}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_ROOT}/inductor",
}


def kv_transfer_config(kind: str, cpu_bytes: int, block_size: int,
                       connector: tuple[str, str] | None = None, disk_dir: str | None = None,
                       disk_bytes: int = 0) -> dict | None:
    """off: None; native: vLLM's CPUOffloadingSpec; ours: NPUOffloadingSpec; layerwise: ours with
    ``LAYERWISE_EXTRA`` in ``NPUOffloadingConnector`` (the only connector that reads it); simple: our
    NPUSimpleCPUOffloadConnector; vsimple: vLLM's own SimpleCPUOffloadConnector; null: vLLM's spec
    without copies (null_spec.py, no-reuse runs only). ``block_size`` is the offloaded block size
    in tokens. ``connector`` (kv_connector, module path) replaces ``OffloadingConnector`` for
    native, ours, layerwise and null (the per-layer layout: perlayer.py, a NPUOffloadingConnector).
    ours-disk: ours with its disk tier in ``disk_dir`` (budget ``disk_bytes``), in
    ``NPUOffloadingConnector`` (which hands a new request's keys to the tier for prefetch); native-fs: vLLM's
    TieringOffloadingSpec with its ``fs`` tier in ``disk_dir`` (which has no budget). lmcache,
    lmcache-disk: ``LMCacheConnectorV1`` alone; LMCache reads its configuration from the
    environment (``lmcache_env``: host bytes, disk folder and budget)."""
    if kind == "off":
        return None
    if kind in LMCACHE_KINDS:
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if kind == "simple":
        return {"kv_connector": "NPUSimpleCPUOffloadConnector", "kv_connector_module_path": SIMPLE_MODULE,
                "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    if kind == "vsimple":
        return {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "block_size": block_size}
    if kind in ("ours", "layerwise", "ours-disk"):
        extra.update(spec_name="NPUOffloadingSpec", spec_module_path=SPEC_MODULE)
        if kind == "ours-disk":
            extra.update(disk_path=disk_dir, disk_bytes_to_use=disk_bytes)
            connector = connector or NPU_CONNECTOR  # its prefetch on a request's arrival
        if kind == "layerwise":
            extra.update(layerwise_extra())
            connector = connector or NPU_CONNECTOR
    elif kind == "native-fs":
        extra.update(spec_name="TieringOffloadingSpec", secondary_tiers=[{"type": "fs", "root_dir": disk_dir}])
    elif kind == "null":
        extra.update(spec_name="NullCopySpec", spec_module_path=NULL_MODULE)
    elif kind != "native":
        raise ValueError(f"engine kind {kind!r}: one of {KINDS}")
    out = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if connector is not None:
        out["kv_connector"], out["kv_connector_module_path"] = connector
    return out


def lmcache_env(cpu_bytes: int, tp: int = 1, disk_dir: str | None = None, disk_bytes: int = 0) -> dict[str, str]:
    """LMCache's configuration for an engine or server: ``cpu_bytes`` of host KV (all ranks together,
    as ``cpu_bytes_to_use``; LMCache's size is per rank, in GiB), 256-token chunks, usage reports off;
    with ``disk_dir``, its local disk tier there with ``disk_bytes`` (all ranks together)."""
    env = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_CHUNK_SIZE": str(LMCACHE_CHUNK), "LMCACHE_LOCAL_CPU": "True",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": _gib(cpu_bytes / tp)}
    if disk_dir:
        env.update(LMCACHE_LOCAL_DISK=f"file://{disk_dir.rstrip('/')}/", LMCACHE_MAX_LOCAL_DISK_SIZE=_gib(disk_bytes / tp))
    return env


def _gib(nbytes: float) -> str:
    """Bytes as LMCache's float GiB, rounded down to 1/1000 GiB (never above the planned bytes)."""
    return f"{int(nbytes / (1 << 30) * 1000) / 1000:.3f}"


def lmcache_path(base: str | None = None, site: str = str(LMCACHE_SITE)) -> str:
    """PYTHONPATH with LMCache's folder after what is there (``base``: the current PYTHONPATH)."""
    base = os.environ.get("PYTHONPATH", "") if base is None else base
    parts = [p for p in base.split(os.pathsep) if p and p != site]
    return os.pathsep.join(parts + [site])


def add_to_sys_path(pythonpath: str, path: list[str] = sys.path) -> None:
    """The entries of ``pythonpath`` this process lacks, where a fresh interpreter would put them: after the
    PYTHONPATH entries it has (before the interpreter's own site-packages), in ``pythonpath``'s order."""
    entries = [p for p in pythonpath.split(os.pathsep) if p]
    at = max((path.index(p) + 1 for p in entries if p in path), default=1)
    for p in entries:
        if p not in path:
            path.insert(at, p)
            at += 1


@dataclass
class EngineSpec:
    label: str
    kind: str
    model: str
    dtype: str = "bfloat16"
    load_format: str = "auto"
    max_model_len: int = 4096
    kv_cache_bytes: int = 1 << 30  # device KV, fixed (no memory profiling: engines may share the GPU)
    gpu_util: float = 0.1  # only vLLM's start-up check "free >= util x total"
    cpu_bytes: int = 1 << 30
    offload_block: int = 64
    block_size: int = 16
    max_num_seqs: int = 64
    env: dict = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # CPU affinity of the engine's process (empty: the parent's)
    eager: bool = False  # False: vLLM's default mode (torch.compile + CUDA graphs); True: enforce_eager
    attention_backend: str = "TRITON_ATTN"
    connector: tuple[str, str] | None = None  # replaces OffloadingConnector (kv_transfer_config)
    tp: int = 1  # tensor_parallel_size (> 1: one worker process per GPU; ranks.py reaches them)
    disk_dir: str | None = None  # ours-disk: its tier's folder
    disk_bytes: int = 0  # ours-disk: its tier's budget

    def child_env(self) -> dict[str, str]:
        """The engine process's variables besides ENV: ``env``, and for LMCache its configuration and
        its folder on the path (read by ``_child`` before the engine exists)."""
        if self.kind not in LMCACHE_KINDS:
            return dict(self.env)
        return {**lmcache_env(self.cpu_bytes, self.tp), "PYTHONPATH": lmcache_path(), **self.env}

    def llm_kwargs(self) -> dict:
        kw = dict(model=self.model, dtype=self.dtype, load_format=self.load_format, max_model_len=self.max_model_len,
                  kv_cache_memory_bytes=self.kv_cache_bytes, gpu_memory_utilization=self.gpu_util,
                  block_size=self.block_size, max_num_seqs=self.max_num_seqs, enforce_eager=self.eager,
                  attention_backend=self.attention_backend, enable_prefix_caching=True, seed=0)
        if self.tp > 1:
            kw.update(tensor_parallel_size=self.tp, distributed_executor_backend="mp")
        kt = kv_transfer_config(self.kind, self.cpu_bytes, self.offload_block, self.connector, self.disk_dir,
                                self.disk_bytes)
        if kt is not None:
            kw["kv_transfer_config"] = kt
        return kw


# ------------------------------------------------------------------ child side
class _Engine:
    def __init__(self, spec: EngineSpec):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw = spec.llm_kwargs()
        if "kv_transfer_config" in kw:
            kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        self.start_s = time.perf_counter() - t0
        self.tp = spec.tp
        timeline.install(self.llm, gpu_events=spec.tp == 1)
        self._profiling = forward_profile.install(self.llm)
        self._flush_seq = 0
        # LMCache in this process (tensor_parallel_size 1): the tokens it logs as retrieved, per generate
        self._lmc = lmcache_log.RetrieveCounter.attach() if spec.kind in LMCACHE_KINDS and spec.tp == 1 else None

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, steps: bool = False,
                 profile: bool = False, profile_skip: int = 0, profile_top: int = 12,
                 profile_steps: int = 1) -> dict:
        """Run ``prompts``; the wall time, tokens, transfer totals and, with ``steps``, the
        step timeline of this call (``timeline.breakdown`` plus the raw events); with
        ``profile``, a profile of its first forward that runs tokens, or of the one after
        ``profile_skip`` more, over ``profile_steps`` engine steps (``forward_profile``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t0_totals = self._totals()
        if profile and self._profiling:
            forward_profile.arm(profile_skip, profile_top, profile_steps)
        m = timeline.mark()
        cpu0 = timeline.thread_cpu() if steps else None
        lmc0 = self._lmc.tokens if self._lmc is not None else None
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        events = timeline.since(m, t0) if steps else None
        threads = timeline.thread_cpu_delta(cpu0, timeline.thread_cpu(), threading.get_native_id()) if steps else None
        t1_totals = self._totals()
        load0, store0, load1, store1 = t0_totals["load"], t0_totals["store"], t1_totals["load"], t1_totals["store"]
        rows = []
        for o in outs:
            m = getattr(o, "metrics", None)
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            rows.append({"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
                         "ttft_s": float(ttft) if ttft is not None else None})
        d = lambda a, b, k: b.get(k, 0) - a.get(k, 0)  # noqa: E731
        return {"wall_s": wall, "rows": rows,
                "load_bytes": d(load0, load1, "bytes"), "load_s": d(load0, load1, "seconds"),
                "load_wall_s": d(load0, load1, "wall_seconds"),
                "load_jobs": d(load0, load1, "jobs"), "load_failed": d(load0, load1, "failed"),
                "store_bytes": d(store0, store1, "bytes"), "store_s": d(store0, store1, "seconds"),
                "store_failed": d(store0, store1, "failed"),
                **({"lmcache_retrieved": self._lmc.tokens - lmc0} if lmc0 is not None else {}),
                **({"profile": forward_profile.take()} if profile else {}),
                **({"events": events, "breakdown": timeline.breakdown(events, wall * 1e3), "threads": threads,
                    "totals": timeline.totals(events), "step_rows": timeline.step_rows(events)} if steps else {})}

    def flush_reset(self, reset: bool = True, tries: int = 60) -> dict:
        """Step the engine until pending stores are done, then reset the device prefix cache.

        In-process, nothing steps the engine between ``generate`` calls, so a store still in
        flight keeps its blocks (and reset_prefix_cache() returns False): short 1-token requests
        (8 tokens, no full offloaded block, so nothing new is stored) drive the steps."""
        for i in range(tries):
            if reset and self.llm.reset_prefix_cache():
                return {"ok": True, "tries": i}
            self._flush_seq += 1
            self.generate([[5 + (self._flush_seq * 7 + k) % 900 for k in range(8)]], 1)
            if not reset and i >= 2:
                return {"ok": True, "tries": i}
        return {"ok": False, "tries": tries}

    def _totals(self) -> dict:
        """Our transfer totals, summed over the tensor-parallel ranks."""
        return ranks.sum_totals(ranks.on_ranks(self.llm, self.tp, ranks.totals))

    def corrupt_page(self, seed: int = 0) -> dict:
        """The negative control (``ranks.corrupt_page``) on every rank; ok only if every rank did it."""
        per = ranks.on_ranks(self.llm, self.tp, ranks.corrupt_page, seed=seed)
        return {"ok": all(r["ok"] for r in per), "ranks": per, **(per[0] if len(per) == 1 else {})}

    def worker_info(self) -> dict:
        """How our worker cores move KV, one entry per core of every rank (``ranks.worker_info``), and the
        layer-wise counters summed over the ranks (None where the mode is off)."""
        per = ranks.on_ranks(self.llm, self.tp, ranks.worker_info)
        return {"cores": [c for r in per for c in r["cores"]], "layerwise": ranks.sum_counters(r["layerwise"] for r in per)}

    def scrub_device_kv(self, seed: int = 0) -> list[dict]:
        """Random values over every rank's device KV cache (``ranks.scrub_device_kv``): after it, a
        prefix hit can only come back right if the connector really loaded it."""
        if self.tp > 1:
            return ranks.on_ranks(self.llm, self.tp, ranks.scrub_device_kv, seed=seed)
        return [ranks.scrub_device_kv(timeline.engine_core(self.llm).model_executor.driver_worker.worker, seed=seed)]

    def kv_info(self) -> dict:
        """What ran: the compilation and CUDA-graph mode, the attention backend, the KV-cache groups,
        and whether vLLM allocated cross-layer blocks (read from the in-process engine; with tensor
        parallelism, from rank 0's worker)."""
        out = engine_kv_info(self.llm)
        if self.tp > 1:
            out.update(ranks.on_ranks(self.llm, self.tp, ranks.runner_info)[0])
        return out

    def bandwidth(self, nbytes: int = 1 << 30, reps: int = 5) -> dict:
        """One contiguous pinned host <-> device copy of ``nbytes``, median GB/s of ``reps``."""
        import torch

        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        h.random_(0, 256)
        d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        out = {}
        for name, dst, src in (("h2d_gbps", d, h), ("d2h_gbps", h, d)):
            ts = []
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            out[name] = nbytes / statistics.median(ts[1:]) / 1e9
        del h, d
        torch.cuda.empty_cache()
        return out


def engine_kv_info(llm) -> dict:
    """``kv_info`` of an ``LLM`` (each field where this vLLM has it; unit-tested with fakes)."""
    out: dict[str, Any] = {}
    vc = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    cc = getattr(vc, "compilation_config", None)
    if cc is not None:
        out["compilation_mode"] = str(getattr(cc, "mode", getattr(cc, "level", None)))
        out["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", None))
    mc = getattr(vc, "model_config", None)
    if mc is not None:
        out["enforce_eager"] = bool(getattr(mc, "enforce_eager", False))
        out["dtype"] = str(getattr(mc, "dtype", ""))
        out["use_mla"] = bool(getattr(mc, "use_mla", False))
    ac = getattr(vc, "attention_config", None)
    if ac is not None:
        out["attention_backend"] = str(getattr(ac, "backend", None))
    try:
        core = timeline.engine_core(llm)
        out.update(ranks.runner_info(core.model_executor.driver_worker.worker))
    except AttributeError:  # tensor parallel: the runners live in the workers (``_Engine.kv_info``)
        pass
    return out


def _child(conn, spec: EngineSpec) -> None:
    os.environ.update(ENV)
    os.environ.update(CACHE_ENV)
    env = spec.child_env()
    os.environ.update(env)
    if spec.kind in LMCACHE_KINDS:  # importable here (and in vLLM's worker processes, through PYTHONPATH)
        add_to_sys_path(env["PYTHONPATH"])
    try:
        if spec.cpus:  # before the engine exists: its threads inherit the mask
            os.sched_setaffinity(0, spec.cpus)
        eng = _Engine(spec)
        conn.send(("ready", {"start_s": eng.start_s}))
    except BaseException as e:  # noqa: BLE001 - report any start failure to the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"))
        return
    while True:
        op, kw = conn.recv()
        if op == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(eng, op)(**kw)))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"))


# ------------------------------------------------------------------ parent side
class EngineError(RuntimeError):
    pass


class EngineProc:
    """Parent handle: ``start()`` spawns, ``wait_ready()`` blocks until the LLM exists,
    ``call(op, **kw)`` runs a method of the child's engine, ``close()`` ends the process."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.error: str | None = None
        self.start_s: float | None = None
        self._conn = self._proc = None

    def start(self) -> "EngineProc":
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, self.spec), name=f"engine-{self.spec.label}")
        self._proc.start()
        return self

    def _recv(self, timeout: float):
        if not self._conn.poll(timeout):
            raise EngineError(f"[{self.spec.label}] no answer in {timeout:.0f}s")
        try:
            return self._conn.recv()
        except EOFError:
            raise EngineError(f"[{self.spec.label}] engine process died (exit {self._proc.exitcode})") from None

    def wait_ready(self, timeout: float = 400) -> bool:
        try:
            status, val = self._recv(timeout)
        except EngineError as e:
            status, val = "error", str(e)
        if status != "ready":
            self.error = val
            return False
        self.start_s = val["start_s"]
        return True

    def call(self, op: str, timeout: float = 300, **kw):
        if self.error:
            raise EngineError(f"[{self.spec.label}] not running: {self.error.splitlines()[0]}")
        self._conn.send((op, kw))
        status, val = self._recv(timeout)
        if status != "ok":
            raise EngineError(f"[{self.spec.label}] {op}: {val}")
        return val

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive() and not self.error:
            try:
                self._conn.send(("quit", {}))
                self._conn.poll(20)
            except (OSError, EOFError):
                pass
        # an engine that failed (or never came up: still compiling) gets no grace period
        self._proc.join(1 if self.error else 20)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)


def compile_key(s: EngineSpec) -> tuple:
    """What vLLM's compile cache keys on, as far as these engines differ (VllmConfig.compute_hash):
    the model, dtype, cache and scheduler sizes, the mode, and whether a KV connector is configured
    (its config itself hashes to nothing)."""
    return (s.model, s.dtype, s.load_format, s.max_model_len, s.kv_cache_bytes, s.max_num_seqs, s.block_size,
            s.eager, s.attention_backend, s.kind == "off")


def waves(items: list, key) -> list[list]:
    """Two start waves: the first item of every compile key, then the rest (they load what the
    first wave compiled instead of compiling the same graphs at the same time). One wave when
    every key is distinct."""
    first, rest, seen = [], [], set()
    for it in items:
        k = key(it)
        (rest if k in seen else first).append(it)
        seen.add(k)
    return [w for w in (first, rest) if w]


def start_all(specs: list[EngineSpec], timeout: float = 400, in_waves: bool = False) -> dict[str, EngineProc]:
    """Spawn the engines (fixed device KV makes several on one GPU safe) and wait for all; with
    ``in_waves``, engines that share a compile key start after the first of them is up. ``timeout``
    bounds the whole start, all waves together: an engine not up by then is an error."""
    deadline = time.monotonic() + timeout
    procs: dict[str, EngineProc] = {}
    for wave in (waves(specs, compile_key) if in_waves else [specs]):
        started = [EngineProc(s).start() for s in wave]
        for p in started:
            p.wait_ready(max(1.0, deadline - time.monotonic()))
            procs[p.spec.label] = p
    return {s.label: procs[s.label] for s in specs}
