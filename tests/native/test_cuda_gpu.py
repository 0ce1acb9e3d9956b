"""GPU tests of every CUDA copy path: byte-exact round trips against poisoned
destinations, odd sizes and offsets, 1 and 100k descriptors, errors, and the
TransferEngine end to end. Marked ``gpu``; skipped without a CUDA device.

Runs without pytest too (``python tests/native/test_cuda_gpu.py``) for machines that lack it.
Set ``NPU_OFFLOAD_REQUIRE_NATIVE=1`` to fail, not skip, when the library is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

try:
    import pytest
except ImportError:  # the no-pytest runner at the bottom
    pytest = None

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NPU_OFFLOAD_CACHE_DIR", tempfile.mkdtemp(prefix="npo_cal_"))

from vllm_npu_offload.copy.backend import NPUDmaCopyBackend, path_factories  # noqa: E402
from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.errors import CopyError  # noqa: E402
from vllm_npu_offload.plan import BlockLayout, CopyPlanner, DescriptorBuffers, TensorPair  # noqa: E402
from vllm_npu_offload.transfer import DirectTransfer  # noqa: E402

HAS_GPU = torch.cuda.is_available()
PATHS = ("dma", "dma_loop", "sm", "gather_native", "chosen")
DIRS = (Direction.H2D, Direction.D2H)
POISON = 0xA5


class Skip(Exception):
    pass


def _skip(msg: str):
    if pytest:
        pytest.skip(msg)
    raise Skip(msg)


def _param(names, values):
    return pytest.mark.parametrize(names, values) if pytest else (lambda f: f)


if pytest:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]


def _platform():
    from vllm_npu_offload.platform import get_platform

    p = get_platform("cuda")
    return p


def make_path(name: str, pages: list[int]):
    p = _platform()
    if name == "chosen":
        return NPUDmaCopyBackend(p, pages)
    try:
        return path_factories(p.kind)[name](p, pages)
    except ImportError as e:
        if os.environ.get("NPU_OFFLOAD_REQUIRE_NATIVE") == "1":
            raise
        _skip(f"{name} unavailable: {e}")


def roundtrip(name, direction, sizes, src_off, dst_off, with_buffers=False):
    """Copy with ``name``; every destination byte must equal the reference (poison outside)."""
    p = _platform()
    sizes = np.asarray(sizes, np.int64)
    span = int(max(src_off.max(), dst_off.max()) + sizes.max() + 4096)
    g = torch.Generator().manual_seed(len(sizes))
    src_np = torch.randint(0, 256, (span,), dtype=torch.uint8, generator=g).numpy()
    host = p.empty_pinned(span, torch.uint8)
    dev = torch.empty(span, dtype=torch.uint8, device=p.device)
    if direction is Direction.H2D:
        host.numpy()[:] = src_np
        dev.fill_(POISON)
        src_t, dst_t = host, dev
    else:
        dev.copy_(torch.from_numpy(src_np))
        host.numpy()[:] = POISON
        src_t, dst_t = dev, host
    p.synchronize()
    s = src_t.data_ptr() + np.asarray(src_off, np.int64)
    d = dst_t.data_ptr() + np.asarray(dst_off, np.int64)
    bufs = None
    if with_buffers:
        n = len(sizes)
        bufs = DescriptorBuffers(p, n)
        bufs.src_np[:], bufs.dst_np[:], bufs.sizes_np[:] = s, d, sizes
        s, d, sizes = bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n]
    stream = p.new_stream()
    make_path(name, [int(sizes.max())]).copy(s, d, sizes, direction, stream, bufs)
    stream.synchronize()
    expect = np.full(span, POISON, np.uint8)
    for so, do, z in zip(src_off, dst_off, sizes):
        expect[do:do + z] = src_np[so:so + z]
    got = dst_t.cpu().numpy()
    bad = np.flatnonzero(got != expect)
    assert len(bad) == 0, f"{name} {direction.name}: {len(bad)} wrong bytes, first at offset {bad[:5]}"


ODD = np.array([1, 3, 17, 4095, 4097, 16, 4096, 32768, 7, 8, 24, 48], np.int64)


@_param("name", PATHS)
@_param("direction", DIRS)
def test_odd_sizes_and_offsets(name, direction):
    gap = 40000
    k = np.arange(len(ODD), dtype=np.int64)
    src_off = k * gap + np.array([0, 1, 0, 3, 0, 0, 16, 0, 5, 8, 0, 16])
    dst_off = k[::-1] * gap + np.array([0, 2, 0, 0, 16, 32, 1, 0, 0, 0, 8, 0])
    roundtrip(name, direction, ODD, src_off, dst_off)


@_param("name", PATHS)
@_param("direction", DIRS)
def test_single_descriptor(name, direction):
    roundtrip(name, direction, [4097], np.array([16]), np.array([32]))


@_param("name", PATHS)
@_param("direction", DIRS)
def test_100k_descriptors(name, direction):
    n = 100_000
    rng = np.random.default_rng(7)
    sizes = rng.choice([48, 64, 80], n).astype(np.int64)
    roundtrip(name, direction, sizes, rng.permutation(n).astype(np.int64) * 128,
              rng.permutation(n).astype(np.int64) * 128, with_buffers=True)


@_param("name", ("dma", "dma_loop", "sm", "gather_native"))
def test_null_address_raises_copy_error(name):
    p = _platform()
    path = make_path(name, [64])
    dev = torch.empty(4096, dtype=torch.uint8, device=p.device)
    host = p.empty_pinned(4096, torch.uint8)
    src = np.array([host.data_ptr(), 0, host.data_ptr()], np.int64)
    dst = np.array([dev.data_ptr(), dev.data_ptr() + 64, dev.data_ptr() + 128], np.int64)
    try:
        path.copy(src, dst, np.array([64, 64, 64]), Direction.H2D, p.new_stream())
    except CopyError as e:
        assert e.index == 1 and "descriptor 1" in str(e), e
    else:
        raise AssertionError(f"{name} accepted a null address")


BAD_ADDRESS = """
import sys, numpy as np, torch
from vllm_npu_offload.copy.backend import path_factories
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.errors import CopyError
from vllm_npu_offload.platform import get_platform
name = sys.argv[1]
p = get_platform("cuda")
path = path_factories(p.kind)[name](p, [4096])
dev = torch.empty(1 << 20, dtype=torch.uint8, device=p.device)
host = p.empty_pinned(64 << 20, torch.uint8)
p.synchronize()
if name in ("sm", "gather_native"):  # an unmapped, non-null address
    src, size = 0x10, 4096
else:  # a device pointer whose range runs 64 MiB past its allocation
    src, size = dev.data_ptr() + (1 << 20) - 4096, 64 << 20
s = p.new_stream()
try:
    path.copy(np.array([src], np.int64), np.array([host.data_ptr()], np.int64), np.array([size], np.int64),
              Direction.D2H, s)
except CopyError as e:
    print("COPYERROR", str(e).replace("\\n", " | ")); sys.exit(0)
try:
    s.synchronize()
except Exception as e:
    print("SYNCERROR", type(e).__name__, str(e).replace("\\n", " | ")); sys.exit(0)
print("NOERROR")
"""


@_param("name", ("dma", "dma_loop", "sm", "gather_native"))
def test_invalid_address_fails_cleanly(name):
    """In a subprocess: a sticky CUDA error must not poison the other tests."""
    make_path(name, [4096])  # skip when the path is unavailable
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run([sys.executable, "-c", BAD_ADDRESS, name], capture_output=True, text=True, env=env,
                           timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name}: copy from an invalid address hung") from None
    assert r.returncode == 0, f"{name}: process died (rc={r.returncode}):\n{r.stdout}{r.stderr[-2000:]}"
    marks = [ln for ln in r.stdout.splitlines() if ln.startswith(("COPYERROR", "SYNCERROR", "NOERROR"))]
    out = marks[-1] if marks else r.stdout
    print(f"{name}: {out}")
    # The copy engines validate at submit (CopyError); a kernel can only fault later.
    allowed = ("SYNCERROR",) if name in ("sm", "gather_native") else ("COPYERROR",)
    assert out.startswith(allowed), f"{name}: expected {allowed}, got {out}"


@_param("rows_sizes", ([1024, 1024, 2048, 16384], [17, 4097, 1, 40960 + 48], [576 * 32, 64 * 32]))
def test_native_gather_column_ranges_device_local(rows_sizes):
    """The staged slices' shape: the same column range of every row of a tensor-major table,
    device -> device, only the selected pages written."""
    from vllm_npu_offload.plan import Descriptors
    from vllm_npu_offload.copy.base import DescriptorRange

    p = _platform()
    path = make_path("gather_native", rows_sizes)
    rng = np.random.default_rng(len(rows_sizes))
    rows, cols = len(rows_sizes), 300
    sizes = np.repeat(np.asarray(rows_sizes, np.int64), cols)
    stride = int(max(rows_sizes) + 255) // 256 * 256
    n = rows * cols
    src = torch.randint(0, 256, (n * stride,), dtype=torch.uint8, device=p.device)
    dst = torch.full((n * stride,), POISON, dtype=torch.uint8, device=p.device)
    so = rng.permutation(n).astype(np.int64) * stride
    do = rng.permutation(n).astype(np.int64) * stride
    bufs = DescriptorBuffers(p, n)
    bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n] = src.data_ptr() + so, dst.data_ptr() + do, sizes
    stream = p.new_stream()
    with p.stream_context(stream):
        prepared = path.prepare(Descriptors(bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n], 0, bufs))
    picked = set()
    for r in (DescriptorRange(3, 100, rows, cols), DescriptorRange(250, 50, rows - 1, cols), DescriptorRange(n - 7, 7)):
        path.copy_range(prepared, r, Direction.D2H, stream)
        picked.update(r.indices().tolist())
    stream.synchronize()
    expect = np.full(n * stride, POISON, np.uint8)
    s_np = src.cpu().numpy()
    for i in picked:
        expect[do[i]:do[i] + sizes[i]] = s_np[so[i]:so[i] + sizes[i]]
    assert np.array_equal(dst.cpu().numpy(), expect)


@_param("force", (None, "dma", "sm"))
def test_engine_end_to_end(force):
    """Store scattered blocks of 8 KV tensors to host, poison, load into other blocks."""
    from vllm_npu_offload.engine import TransferEngine

    p = _platform()
    if force:
        os.environ["NPU_OFFLOAD_COPY_PATH"] = force
    try:
        tensors, blocks, page = 8, 64, 16 * 2 * 128 * 2
        dev = torch.randint(0, 256, (tensors, blocks, page), dtype=torch.uint8, device=p.device)
        host = p.empty_pinned(tensors * blocks * page, torch.uint8).view(tensors, blocks, page)
        host.fill_(POISON)
        lay = lambda t, i: BlockLayout(t[i].data_ptr(), page, blocks)  # noqa: E731
        store = CopyPlanner([TensorPair(lay(dev, i), lay(host, i), page) for i in range(tensors)])
        load = CopyPlanner([TensorPair(lay(host, i), lay(dev, i), page) for i in range(tensors)])
        try:
            backend = NPUDmaCopyBackend(p, [page] * tensors)
        except ImportError as e:
            _skip(f"{force} unavailable: {e}")
        eng = TransferEngine(p)
        rng = np.random.default_rng(3)
        dev_ids, host_ids = rng.choice(blocks, 20, replace=False), rng.choice(blocks, 20, replace=False)
        before = dev.cpu()
        p.synchronize()
        eng.submit(1, DirectTransfer(Direction.D2H, store.plan(dev_ids, host_ids, eng.pool), backend))
        eng.drain()
        new_ids = np.setdiff1d(np.arange(blocks), dev_ids)[:20]
        dev[:, new_ids] = POISON
        eng.submit(2, DirectTransfer(Direction.H2D, load.plan(host_ids, new_ids, eng.pool), backend))
        eng.drain()
        res = {r.job_id: r for r in eng.poll()}
        assert res[1].success and res[2].success, res
        assert res[1].num_bytes == res[2].num_bytes == 20 * tensors * page
        assert torch.equal(host[:, host_ids], before[:, dev_ids])
        assert torch.equal(dev[:, new_ids].cpu(), before[:, dev_ids])
        eng.shutdown()
    finally:
        os.environ.pop("NPU_OFFLOAD_COPY_PATH", None)


def test_transfer_streams_are_not_torch_pool_streams():
    """vLLM computes on a stream from torch's pool (32 per priority, handed out round-robin):
    a transfer stream must never be one of them, however many the process has drawn, or the
    next forward waits for the whole transfer (their flags: test_cuda_build, fake driver)."""
    from vllm_npu_offload.engine import TransferEngine

    p = _platform()
    try:
        from vllm_npu_offload._native.cuda import load_library

        load_library()
    except ImportError as e:
        if os.environ.get("NPU_OFFLOAD_REQUIRE_NATIVE") == "1":
            raise
        _skip(f"native library unavailable: {e}")
    pool = {torch.cuda.Stream().cuda_stream for _ in range(64)} | {
        torch.cuda.Stream(priority=-1).cuda_stream for _ in range(64)}
    backend = NPUDmaCopyBackend(p, [4096])
    eng = TransferEngine(p)
    dev = torch.randint(0, 256, (4, 4096), dtype=torch.uint8, device=p.device)
    host = p.empty_pinned(4 * 4096, torch.uint8).view(4, 4096)
    planner = CopyPlanner([TensorPair(BlockLayout(dev.data_ptr(), 4096, 4), BlockLayout(host.data_ptr(), 4096, 4),
                                      4096)])
    for job in range(8):  # many jobs in flight: still the direction's fixed ring of streams
        eng.submit(job, DirectTransfer(Direction.D2H, planner.plan([job % 4], [job % 4], eng.pool), backend))
    eng.drain()
    assert all(r.success for r in eng.poll())
    rings = eng._streams.values()  # each direction's ring, made when the engine started
    streams = {s.cuda_stream for ring in rings for s in ring}
    assert [len(r) for r in rings] == [eng._ring] * 2 and len(streams) == 2 * eng._ring and not streams & pool
    assert torch.equal(host.cpu(), dev.cpu())
    eng.shutdown()


def _main() -> int:
    """Run every case without pytest; prints one line per case."""
    if not HAS_GPU:
        print("no CUDA GPU: skipped")
        return 0
    cases = [(f, {"name": n, "direction": d}) for f in (test_odd_sizes_and_offsets, test_single_descriptor,
                                                        test_100k_descriptors) for n in PATHS for d in DIRS]
    cases += [(f, {"name": n}) for f in (test_null_address_raises_copy_error, test_invalid_address_fails_cleanly)
              for n in ("dma", "dma_loop", "sm")]
    cases += [(test_engine_end_to_end, {"force": f}) for f in (None, "dma", "sm")]
    cases += [(test_transfer_streams_are_not_torch_pool_streams, {})]
    failed = 0
    for fn, kw in cases:
        label = f"{fn.__name__}[{','.join(str(v) for v in kw.values())}]"
        try:
            fn(**kw)
            print(f"PASSED {label}")
        except Skip as e:
            print(f"SKIPPED {label}: {e}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"FAILED {label}: {type(e).__name__}: {e}")
    print(f"{len(cases) - failed} passed/skipped, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
