#!/usr/bin/env python3
"""The engine thread's Python around one natively planned and ordered CUDA staged transfer (issue
#22's whole-transfer target), on this CPU: the library runs against the fake driver
(tests/support/cuda_fake), which copies at call time, so every device step is done when the native
call returns and only the host side is timed.

Per transfer (median us over --reps, after a warm-up), alternating directions:
- ``plan``: ``OffloadWorkerCore.plan`` (split, ids checks, the transfer and its room);
- ``pre_native``: ``TransferEngine.submit`` until the native call starts (engine order, events,
  the request) - with ``plan`` and ``finish`` the Python on a transfer's critical path;
- ``submit_py``: all of ``submit`` less the native call (``pre_native`` + what follows it, which
  overlaps the device's copies on a GPU);
- ``finish``: the ``poll`` that reports the (finished) transfer;
- ``critical`` = plan + pre_native + finish; ``total`` = plan + submit_py + finish.

``--baseline-tree`` (another checkout, e.g. ``git worktree add /tmp/base <commit>``) builds its
library too and runs both packages in turn, one process per round each, for ``--rounds`` rounds:
medians over rounds, and the after/before ratio range over rounds. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("plan", "pre_native", "submit_py", "finish", "critical", "total")

CHILD = r'''
import ctypes, json, os, sys, time
import numpy as np, torch
ctypes.CDLL(os.environ["BENCH_FAKE_DRIVER"], mode=ctypes.RTLD_GLOBAL)
tree = os.environ["BENCH_TREE"]
sys.path.insert(0, tree)
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.device_kv import DeviceKVTensor, GroupRef
from vllm_npu_offload.offload_worker import OffloadWorkerCore
sys.path.insert(1, os.environ["BENCH_FAKE_SUPPORT"])
from fake_platform import FakeCudaOrdered  # driver-handle events, always complete (copies at call time)

tensors, page, blocks, host_blocks, n = (int(os.environ[k]) for k in
                                         ("BENCH_TENSORS", "BENCH_PAGE", "BENCH_BLOCKS", "BENCH_HOST", "BENCH_N"))
reps, warmup = int(os.environ["BENCH_REPS"]), int(os.environ["BENCH_WARMUP"])
kv = [torch.zeros(blocks, page, dtype=torch.uint8) for _ in range(tensors)]
core = OffloadWorkerCore([DeviceKVTensor.from_block_view(t) for t in kv], [[GroupRef(i, page) for i in range(tensors)]],
                         1, host_blocks, FakeCudaOrdered())
assert core.stager is not None and core.stager.plans_natively and core.stager.orders_natively, "not the native path"
lib = core.stager._fused.lib
marks = []
def timing(call):
    def timed(*args):
        t = time.perf_counter()
        r = call(*args)
        marks.append((t, time.perf_counter() - t))
        return r
    return timed
if hasattr(lib, "staged_submitter"):  # the ordered submit calls what this made, not lib.staged_submit
    real = lib.staged_submitter
    def submitter(req):
        call, links, msg = real(req)
        return timing(call), links, msg
    lib.staged_submitter = submitter
else:
    lib.staged_submit = timing(lib.staged_submit)
rng = np.random.default_rng(0)
rows = {k: [] for k in ("plan", "pre_native", "submit_py", "finish")}
evict = np.zeros(int(os.environ["BENCH_EVICT_MB"]) << 20, np.uint8)
for rep in range(warmup + reps):
    d = (Direction.H2D, Direction.D2H)[rep % 2]
    dev = rng.choice(blocks, n, replace=False).astype(np.int64)
    c0 = int(rng.integers(0, host_blocks - n))
    chunks = np.arange(c0, c0 + n, dtype=np.int64)
    marks.clear()
    if evict.size:
        evict += 1  # the caches as a GPU host's leaves them: the model's step, the driver's calls, DMA
    t0 = time.perf_counter()
    t1 = t0  # plan: inside submit, as the connectors call it (``core.submit`` plans inline since 2026-11-27)
    core.submit(rep, d, dev, [n], [0], chunks, staged=True)
    t2 = t2p = time.perf_counter()
    if evict.size:
        evict += 1
        t2p = time.perf_counter()
    res = core.poll()
    t3 = time.perf_counter()
    assert len(res) == 1 and res[0].success, res
    if rep >= warmup:
        (t_native, native), = marks
        for k, v in (("plan", t1 - t0), ("pre_native", t_native - t1), ("submit_py", t2 - t1 - native),
                     ("finish", t3 - t2p)):
            rows[k].append(v)
core.shutdown()
print(json.dumps({k: float(np.median(v)) * 1e6 for k, v in rows.items()}))
'''


def build(tree: Path, out: Path) -> None:
    """The tree's library (its own csrc_cuda, its ABI) into ``out``."""
    r = subprocess.run([sys.executable, str(tree / "csrc_cuda" / "build.py"), "--out", str(out)], cwd=tree,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"building {tree}'s library failed:\n{r.stdout}{r.stderr}")


def fake_driver(out: Path) -> Path:
    inc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'csrc_cuda'); import build; "
                          "print(build.find_cuda_include() or '')"], cwd=ROOT, capture_output=True, text=True)
    so = out / "libcuda.so.1"
    args = [os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", f"-I{ROOT / 'csrc_cuda'}", "-Wl,-soname,libcuda.so.1",
            str(ROOT / "tests" / "support" / "cuda_fake" / "fake_libcuda.c"), "-o", str(so)]
    if inc.stdout.strip():
        args.insert(4, f"-I{inc.stdout.strip()}")
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"compiling the fake driver failed:\n{r.stderr}")
    return so


def one(tree: Path, lib_dir: Path, driver: Path, a) -> dict[str, float]:
    env = dict(os.environ, BENCH_TREE=str(tree), BENCH_FAKE_DRIVER=str(driver), NPU_OFFLOAD_NATIVE_DIR=str(lib_dir),
               BENCH_FAKE_SUPPORT=str(ROOT / "tests" / "support" / "cuda_fake"),
               NPU_OFFLOAD_STAGED="1", NPU_OFFLOAD_CALIBRATE="0", BENCH_TENSORS=str(a.tensors), BENCH_PAGE=str(a.page),
               BENCH_BLOCKS=str(a.device_blocks), BENCH_HOST=str(a.host_blocks), BENCH_N=str(a.blocks),
               BENCH_REPS=str(a.reps), BENCH_WARMUP=str(a.warmup), BENCH_EVICT_MB=str(a.evict_mb), LD_LIBRARY_PATH=str(driver.parent))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"{tree}: {r.stdout}{r.stderr}")
    row = json.loads(r.stdout.strip().splitlines()[-1])
    row["critical"] = row["plan"] + row["pre_native"] + row["finish"]
    row["total"] = row["plan"] + row["submit_py"] + row["finish"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=64, help="KV tensors (one group), e.g. 64: 32 layers' K and V")
    ap.add_argument("--page", type=int, default=4096, help="bytes per tensor per block")
    ap.add_argument("--device-blocks", type=int, default=256)
    ap.add_argument("--host-blocks", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per transfer")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="touch this many MiB before plan and before the poll (16 on this rig's 32 MiB L3 matches "
                         "the pieces' times on an H200 host, where the step and the driver leave the caches cold)")
    ap.add_argument("--baseline-tree", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    trees = {"after": ROOT} | ({"before": Path(a.baseline_tree).resolve()} if a.baseline_tree else {})
    with tempfile.TemporaryDirectory(prefix="bench_front_end_") as tmp:
        tmp = Path(tmp)
        driver = fake_driver(tmp)
        libs = {}
        for name, tree in trees.items():
            libs[name] = tmp / name
            libs[name].mkdir()
            build(tree, libs[name])
        rounds = {name: [] for name in trees}
        for r in range(a.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                rounds[name].append(one(trees[name], libs[name], driver, a))
    res = {"args": vars(a), "rounds": rounds,
           "median": {n: {k: float(np.median([x[k] for x in v])) for k in PARTS} for n, v in rounds.items()}}
    print(f"{a.blocks} blocks x {a.tensors} tensors x {a.page} B per transfer, fake CUDA driver; us, median of "
          f"{a.rounds} rounds x {a.reps} transfers")
    print(f"{'':8s}" + "".join(f"{k:>12s}" for k in PARTS))
    for name in trees:
        print(f"{name:8s}" + "".join(f"{res['median'][name][k]:12.1f}" for k in PARTS))
    if "before" in trees:
        ratios = {k: [x[k] / y[k] if y[k] else float("nan") for x, y in zip(rounds["after"], rounds["before"])]
                  for k in PARTS}
        res["ratio"] = {k: [min(v), float(np.median(v)), max(v)] for k, v in ratios.items()}
        print(f"{'after/before':12s}" + "".join(f"{np.median(v):5.2f} ({min(v):.2f}-{max(v):.2f})".rjust(12)
                                                 for v in ratios.values()))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
