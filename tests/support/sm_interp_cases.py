"""Triton SM-copy cases run under TRITON_INTERPRET=1 on CPU tensors (in a subprocess,
so the interpreter flag is set before triton decorates the kernel)."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_npu_offload.copy.base import Direction  # noqa: E402
from vllm_npu_offload.copy.sm_triton import SmCopyPath  # noqa: E402
from vllm_npu_offload.errors import CopyError  # noqa: E402
from vllm_npu_offload.plan import DescriptorBuffers  # noqa: E402
from vllm_npu_offload.platform import get_platform  # noqa: E402

POISON = 0xA5


def run_case(sizes, src_off, dst_off, page, programs, tile, use_buffers=False):
    p = get_platform("cpu")
    span = int(max(src_off.max(), dst_off.max()) + sizes.max() + 64)
    src = torch.randint(0, 256, (span,), dtype=torch.uint8)
    dst = torch.full((span,), POISON, dtype=torch.uint8)
    s = src.data_ptr() + src_off
    d = dst.data_ptr() + dst_off
    bufs = None
    if use_buffers:
        bufs = DescriptorBuffers(p, len(sizes) + 5)
        n = len(sizes)
        bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n] = s, d, sizes
        s, d, sizes = bufs.src_np[:n], bufs.dst_np[:n], bufs.sizes_np[:n]
    SmCopyPath(p, [page], programs=programs, tile_bytes=tile).copy(s, d, sizes, Direction.H2D, None, bufs)
    ref = np.full(span, POISON, np.uint8)
    sn = src.numpy()
    for so, do, z in zip(src_off, dst_off, sizes):
        ref[do:do + z] = sn[so:so + z]
    assert np.array_equal(dst.numpy(), ref), "copied bytes differ (or poison overwritten)"


def case_odd():
    # odd sizes, unaligned and aligned offsets, sizes around vector/tail boundaries
    sizes = np.array([1, 3, 17, 4095, 4097, 16, 32, 31, 33, 8, 4096, 15], np.int64)
    gap = 8192
    src_off = np.arange(len(sizes), dtype=np.int64) * gap + np.array([0, 1, 0, 3, 0, 0, 16, 0, 0, 8, 0, 5])
    dst_off = np.arange(len(sizes), dtype=np.int64)[::-1] * gap + np.array([0, 2, 0, 0, 16, 32, 0, 0, 0, 0, 1, 0])
    run_case(sizes, src_off, dst_off, page=4096, programs=3, tile=8192)


def case_tiles():
    rng = np.random.default_rng(0)
    n = 70  # not a multiple of any tile's job count
    sizes = rng.choice([16, 48, 256, 1024, 1040], n).astype(np.int64)
    slots = rng.permutation(2 * n)[:n].astype(np.int64) * 2048
    dslots = rng.permutation(2 * n)[:n].astype(np.int64) * 2048
    run_case(sizes, slots, dslots, page=1024, programs=4, tile=4096, use_buffers=True)  # 4 jobs x 1 KiB
    run_case(sizes, slots, dslots, page=256, programs=1, tile=1 << 20)  # many jobs, chunk loop per job


def case_ranges():
    """Column ranges of a tensor-major table (staged slices): only the selected descriptors move."""
    from vllm_npu_offload.copy.base import DescriptorRange

    p = get_platform("cpu")
    rows, cols, page = 3, 11, 256
    src = torch.randint(0, 256, (rows * cols * page,), dtype=torch.uint8)
    dst = torch.full((rows * cols * page,), POISON, dtype=torch.uint8)
    bufs = DescriptorBuffers(p, rows * cols)
    idx = np.arange(rows * cols, dtype=np.int64)
    perm = np.random.default_rng(1).permutation(rows * cols)
    bufs.src_np[:] = src.data_ptr() + idx * page
    bufs.dst_np[:] = dst.data_ptr() + perm * page
    bufs.sizes_np[:] = page

    class Descs:
        src, dst, sizes, buffers = bufs.src_np, bufs.dst_np, bufs.sizes_np, bufs

    path = SmCopyPath(p, [page], programs=2, tile_bytes=512)  # 2 descriptors per group: prefetch crosses rows
    prep = path.prepare(Descs)
    chosen = [DescriptorRange(2, 4, rows, cols), DescriptorRange(9, 2, rows, cols), DescriptorRange(7, 1)]
    for r in chosen:
        path.copy_range(prep, r, Direction.D2H, None)
    ref = np.full(rows * cols * page, POISON, np.uint8)
    sn = src.numpy()
    for i in np.concatenate([r.indices() for r in chosen]):
        ref[perm[i] * page:(perm[i] + 1) * page] = sn[i * page:(i + 1) * page]
    assert np.array_equal(dst.numpy(), ref), "range copy differs (or touched descriptors outside the ranges)"


def case_errors():
    p = get_platform("cpu")
    path = SmCopyPath(p, [16], programs=2)
    x = torch.zeros(64, dtype=torch.uint8)
    try:
        path.copy(np.array([x.data_ptr(), 0]), np.array([x.data_ptr() + 32] * 2), np.array([4, 4]), Direction.D2H, None)
    except CopyError as e:
        assert e.index == 1 and "descriptor 1" in str(e), e
    else:
        raise AssertionError("null address accepted")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        globals()[f"case_{name}"]()
        print(f"ok {name}")
