"""KV transfer benchmark: every copy path against one contiguous copy of the same bytes.

Why: a transfer's speed is judged as a fraction of the link's contiguous bandwidth (one
contiguous copy of the same bytes) for real model page sizes with scattered blocks; this reproduces exactly that
setup (per-layer K and V tensors, bf16, 16-token blocks, random block ids, descriptors
from ``CopyPlanner``) and times wall clock including synchronisation. On a CPU-only
machine it measures the host path only, so it can be smoke-tested anywhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from vllm_npu_offload.copy.backend import NPUDmaCopyBackend, path_factories
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.plan import BlockLayout, CopyPlanner, DescriptorPool, TensorPair
from vllm_npu_offload.platform import Platform, get_platform
from .gemm_load import GemmLoad

BLOCK_TOKENS = 16
DTYPE_BYTES = 2  # bf16


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    blocks: int  # blocks per transfer

    @property
    def page_bytes(self) -> int:
        return BLOCK_TOKENS * self.kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def tensors(self) -> int:
        return 2 * self.layers  # separate K and V per layer


CONFIGS = {
    c.name: c
    for c in (
        ModelConfig("llama-8b", 32, 8, 128, 64),
        ModelConfig("llama-70b", 80, 8, 128, 64),
        ModelConfig("llama-70b-tp4", 80, 2, 128, 32),
        ModelConfig("qwen2.5-0.5b", 24, 2, 64, 128),
        ModelConfig("qwen2.5-1.5b", 28, 2, 128, 64),
        ModelConfig("qwen2.5-3b", 36, 2, 128, 64),
        ModelConfig("phi-3-mini", 32, 8, 96, 64),
    )
}

ACCEL_PATHS = ("dma_loop", "dma", "sm")


class KVRig:
    """Device KV tensors and host blocks for one config, carved from two flat buffers."""

    def __init__(self, platform: Platform, cfg: ModelConfig, num_blocks: int):
        self.platform, self.cfg, self.num_blocks = platform, cfg, num_blocks
        page, t = cfg.page_bytes, cfg.tensors
        span = t * num_blocks * page
        self.dev = torch.empty(span, dtype=torch.uint8, device=platform.device)
        self.host = torch.empty(span, dtype=torch.uint8)
        self._registered = platform.pin(self.host)  # exact-size pinning (cudaHostRegister)
        if not self._registered and platform.pin_memory_available:
            self.host = platform.empty_pinned(span, torch.uint8)
        dev_l = [BlockLayout(self.dev.data_ptr() + i * num_blocks * page, page, num_blocks) for i in range(t)]
        host_l = [BlockLayout(self.host.data_ptr() + i * num_blocks * page, page, num_blocks) for i in range(t)]
        self.planners = {
            Direction.H2D: CopyPlanner([TensorPair(h, d, page) for h, d in zip(host_l, dev_l)]),
            Direction.D2H: CopyPlanner([TensorPair(d, h, page) for d, h in zip(dev_l, host_l)]),
        }
        self.pool = DescriptorPool(platform)
        self.page_sizes = [page] * t

    def descriptors(self, direction: Direction, blocks: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        a = rng.choice(self.num_blocks, blocks, replace=False)
        b = rng.choice(self.num_blocks, blocks, replace=False)
        return self.planners[direction].plan(a, b, self.pool)

    def close(self) -> None:
        if self._registered:
            self.platform.unpin(self.host)
        self.dev = self.host = None


def median_seconds(fn, finish, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of ``fn(); finish()`` (``finish`` waits for the work, e.g. a stream sync)."""
    for _ in range(warmup):
        fn()
        finish()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        finish()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def contiguous_copy_fn(platform: Platform, dev: torch.Tensor, host: torch.Tensor, direction: Direction, stream):
    """One contiguous copy between ``dev`` and ``host`` on ``stream``: the link's limit."""
    if platform.kind == "cpu":
        return lambda: stream.submit(lambda: (dev.copy_(host) if direction.is_load else host.copy_(dev)))

    def run():
        with platform.stream_context(stream):
            (dev.copy_(host, non_blocking=True) if direction.is_load else host.copy_(dev, non_blocking=True))

    return run


def planning_us_per_10k(rig: KVRig, blocks: int, reps: int = 50) -> float:
    """CPU time to turn block ids into descriptors, per 10,000 descriptors."""
    planner = rig.planners[Direction.D2H]
    rng = np.random.default_rng(1)
    ids = [(rng.choice(rig.num_blocks, blocks, replace=False), rng.choice(rig.num_blocks, blocks, replace=False))
           for _ in range(8)]
    n = planner.count(*ids[0])
    out = [np.empty(n, np.int64) for _ in range(3)]
    times = []
    for r in range(reps):
        a, b = ids[r % len(ids)]
        t0 = time.perf_counter()
        planner.plan_into(a, b, *out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / n * 1e4 * 1e6


def bench_config(platform: Platform, cfg: ModelConfig, blocks: int | None = None, reps: int = 20,
                 rig: KVRig | None = None, paths: tuple[str, ...] | None = None) -> dict[str, Any]:
    """GB/s of every path and of one contiguous copy, per direction, for one config."""
    blocks = blocks or cfg.blocks
    own = rig is None
    rig = rig or KVRig(platform, cfg, max(256, 4 * blocks))
    stream = platform.new_stream()
    backend = NPUDmaCopyBackend(platform, rig.page_sizes)
    if paths is None:
        paths = tuple(p for p in ACCEL_PATHS if p in path_factories(platform.kind)) if platform.kind != "cpu" else ("host",)
    out: dict[str, Any] = {"config": asdict(cfg), "blocks": blocks, "page_bytes": cfg.page_bytes,
                           "choice": {"load": backend.choice.load, "store": backend.choice.store}, "directions": {}}
    for d in Direction:
        desc = rig.descriptors(d, blocks)
        nbytes = int(desc.sizes.sum())
        row: dict[str, Any] = {"descriptors": len(desc), "bytes": nbytes, "gbps": {}, "errors": {}}
        for name in paths:
            try:
                path = path_factories(platform.kind)[name](platform, rig.page_sizes)
                sec = median_seconds(lambda: path.copy(desc.src, desc.dst, desc.sizes, d, stream, desc.buffers),
                                      stream.synchronize, reps)
                row["gbps"][name] = nbytes / sec / 1e9
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking the rest
                row["errors"][name] = f"{type(e).__name__}: {e}"
        sec = median_seconds(lambda: backend.copy(desc.src, desc.dst, desc.sizes, d, stream, desc.buffers),
                             stream.synchronize, reps)
        row["gbps"]["chosen"] = nbytes / sec / 1e9
        row["chosen"] = backend.path(d).name
        sec = median_seconds(contiguous_copy_fn(platform, rig.dev[:nbytes], rig.host[:nbytes], d, stream),
                             stream.synchronize, reps)
        row["gbps"]["contiguous"] = nbytes / sec / 1e9
        row["pct_of_limit"] = {k: 100.0 * v / row["gbps"]["contiguous"] for k, v in row["gbps"].items()}
        rig.pool.release([desc.buffers])
        out["directions"][d.name] = row
    out["plan_us_per_10k"] = planning_us_per_10k(rig, blocks)
    if own:
        rig.close()
    return out


def interference(platform: Platform, cfg: ModelConfig, gemm_n: int = 8192, gemms: int = 30,
                 paths: tuple[str, ...] = ACCEL_PATHS) -> dict[str, Any]:
    """Slowdown of a bf16 GEMM loop on one stream while each path copies on another."""
    rig = KVRig(platform, cfg, max(256, 4 * cfg.blocks))
    load = GemmLoad(platform, gemm_n, gemms)
    xs = platform.new_stream()
    alone = load.alone_ms(1)
    res: dict[str, Any] = {"config": cfg.name, "gemm_n": gemm_n, "gemm_ms_alone": alone, "paths": {}}
    for name in paths:
        if name not in path_factories(platform.kind):
            continue
        entry: dict[str, Any] = {}
        for d in Direction:
            desc = rig.descriptors(d, cfg.blocks)
            try:
                path = path_factories(platform.kind)[name](platform, rig.page_sizes)
                def copy_once():
                    path.copy(desc.src, desc.dst, desc.sizes, d, xs, desc.buffers)
                    xs.synchronize()

                copy_once()  # warm-up
                with_copy, copies, wall = load.while_running(copy_once)
                entry[d.name] = {"gemm_ms": with_copy, "slowdown_pct": 100.0 * (with_copy / alone - 1.0),
                                 "copies": copies, "copy_gbps": copies * int(desc.sizes.sum()) / wall / 1e9}
            except Exception as e:  # noqa: BLE001
                entry[d.name] = {"error": f"{type(e).__name__}: {e}"}
            rig.pool.release([desc.buffers])
        res["paths"][name] = entry
    rig.close()
    return res


def sm_variants(platform: Platform, cfg: ModelConfig, programs=(4, 8, 12, 16), tiles=(16384, 32768, 65536),
                reps: int = 10) -> list[dict[str, Any]]:
    """GB/s of the SM path over grid sizes and tile bytes (for tuning the defaults)."""
    from vllm_npu_offload.copy.sm_triton import SmCopyPath

    rig = KVRig(platform, cfg, max(256, 4 * cfg.blocks))
    stream = platform.new_stream()
    rows = []
    for d in Direction:
        desc = rig.descriptors(d, cfg.blocks)
        nbytes = int(desc.sizes.sum())
        for p in programs:
            for t in tiles:
                path = SmCopyPath(platform, rig.page_sizes, programs=p, tile_bytes=t)
                sec = median_seconds(lambda: path.copy(desc.src, desc.dst, desc.sizes, d, stream, desc.buffers),
                                      stream.synchronize, reps)
                rows.append({"config": cfg.name, "dir": d.name, "programs": p, "tile_bytes": t,
                             "gbps": nbytes / sec / 1e9})
        rig.pool.release([desc.buffers])
    rig.close()
    return rows


# -- reporting ---------------------------------------------------------------------------
def format_config(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [f"{cfg['name']}: {2 * cfg['layers']} tensors x {res['page_bytes'] // 1024} KiB x {res['blocks']} blocks"
             f"  (plan {res['plan_us_per_10k']:.1f} us/10k desc)"]
    for dname, row in res["directions"].items():
        lim = row["gbps"]["contiguous"]
        cells = [f"{k} {v:6.2f} GB/s {row['pct_of_limit'][k]:5.1f}%" for k, v in row["gbps"].items()
                 if k != "contiguous"]
        lines.append(f"  {dname} [{row['descriptors']} desc, chosen={row['chosen']}]  limit {lim:6.2f} GB/s | "
                     + " | ".join(cells))
        for k, e in row["errors"].items():
            lines.append(f"    {k}: ERROR {e}")
    return "\n".join(lines)


def format_interference(res: dict[str, Any]) -> str:
    lines = [f"interference ({res['config']}, bf16 GEMM {res['gemm_n']}^3, alone {res['gemm_ms_alone']:.1f} ms)"]
    for name, entry in res["paths"].items():
        cells = []
        for d, r in entry.items():
            cells.append(f"{d} " + (f"GEMM +{r['slowdown_pct']:5.1f}% while copying {r['copy_gbps']:5.1f} GB/s"
                                    if "error" not in r else f"ERROR {r['error']}"))
        lines.append(f"  {name:9s} " + " | ".join(cells))
    return "\n".join(lines)


def run(kind: str | None = None, configs: list[str] | None = None, reps: int = 20, sweep: list[int] | None = None,
        sweep_configs: list[str] | None = None, do_interference: bool = False, do_sm_variants: bool = False,
        json_path: str | None = None, printer=print, table: bool = True) -> dict[str, Any]:
    """Benchmark ``configs`` (None = all) and write the report to ``json_path``; returns it."""
    platform = get_platform(kind)
    names = list(CONFIGS) if configs is None else configs
    for n in names + (sweep_configs or []):
        if n not in CONFIGS:
            raise ValueError(f"unknown config {n!r}; allowed: {sorted(CONFIGS)}")
    if platform.kind == "cpu":  # host path only, small and quick
        reps = min(reps, 5)
    report: dict[str, Any] = {"device": platform.device_name(), "kind": platform.kind,
                              "torch": torch.__version__, "configs": [], "sweep": [], "interference": [],
                              "sm_variants": []}
    try:
        from vllm_npu_offload._native.cuda import load_library

        report["native"] = load_library().describe()
    except Exception as e:  # noqa: BLE001
        report["native"] = {"error": str(e)}
    printer(f"device: {report['device']} ({platform.kind}); native: {report['native']}")
    for n in names if table else []:
        res = bench_config(platform, CONFIGS[n], reps=reps)
        report["configs"].append(res)
        printer(format_config(res))
    for n in (sweep_configs or []) if sweep else []:
        cfg = CONFIGS[n]
        rig = KVRig(platform, cfg, max(256, 2 * max(sweep)))
        for blocks in sweep:
            res = bench_config(platform, cfg, blocks=blocks, reps=reps, rig=rig)
            report["sweep"].append(res)
            printer(format_config(res))
        rig.close()
    if do_interference and platform.kind != "cpu":
        for n in names:
            res = interference(platform, CONFIGS[n])
            report["interference"].append(res)
            printer(format_interference(res))
    if do_sm_variants and platform.kind != "cpu":
        for n in names:
            rows = sm_variants(platform, CONFIGS[n])
            report["sm_variants"].extend(rows)
            for r in rows:
                printer(f"  sm {r['config']} {r['dir']} programs={r['programs']:2d} tile={r['tile_bytes']:6d}: "
                        f"{r['gbps']:6.2f} GB/s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report
