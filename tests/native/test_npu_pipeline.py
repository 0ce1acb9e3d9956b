"""The Ascend staged pipeline in one native call (``npu_offload_acl_staged_submit``, which plans a
transfer and enqueues it with ``npu_offload_acl_staged_run``), against the ACL emulation: byte-exact
round trips through the worker core for both build toggles, that one native call per transfer
replaced the Python loop, the exact order of copies and slot events of a job run directly,
``link=False``, and an injected copy failure in a middle slice."""

# ruff: noqa: F811  (pytest fixtures imported from _npu_build_support are parameters by design)
from __future__ import annotations

import numpy as np
import pytest
import torch

from _npu_build_support import (  # noqa: F401  (fixtures: built, emu, lib_batch, lib_loop)
    SLOTS,
    INCLUDE,
    SKIP_REASON,
    built,
    emu,
    lib_batch,
    lib_loop,
    staged_core,
)
from staged_round_trip import store_then_load_groups

from vllm_npu_offload._native import acl
from vllm_npu_offload.copy import acl_copy, npu_pipeline
from vllm_npu_offload.copy.base import Direction
from vllm_npu_offload.plan import address

pytestmark = pytest.mark.skipif(INCLUDE is None, reason=SKIP_REASON)


def _count_native_runs(monkeypatch) -> list:
    """Every npu_offload_acl_staged_submit call: (store, slices, slots)."""
    calls, real_submit = [], acl.staged_submit

    def counting_submit(req, lib):
        slices, links = real_submit(req, lib)
        calls.append((req.job.store, slices, req.job.slots))
        return slices, links

    monkeypatch.setattr(acl, "staged_submit", counting_submit)
    return calls


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("toggle", ["1", "0"])
def test_fused_round_trip(built, emu, monkeypatch, toggle, groups):
    core, kv, refs, rng = staged_core(built, monkeypatch, toggle, groups, seed=int(toggle) + groups)
    assert isinstance(core.stager._fused, npu_pipeline.AclStagedPipeline) and not core.stager.table_form
    assert core.stager.plans_natively
    live = emu.acl_emu_count(b"events_live")
    assert live >= 2 * (1 + 2 * SLOTS)  # entry, filled[], drained[] per direction, in the library

    def python_loop(*a, **k):
        raise AssertionError("the Python slice loop ran")

    monkeypatch.setattr(core.stager.local_path, "copy_range", python_loop)
    monkeypatch.setattr(core.stager.link_path, "copy", python_loop)
    runs = _count_native_runs(monkeypatch)
    emu.acl_emu_reset()
    sizes = [15] if groups == 1 else [9, 6]
    store_then_load_groups(core, kv, refs, rng, sizes)  # skip=1: a partial first chunk
    # One native call per transfer, each with more slices than slots (every slot reused).
    assert [r[0] for r in runs] == [1, 0] and all(n > s for _, n, s in runs), runs
    slices = sum(n for _, n, _ in runs)
    pages = sum(n * len(r) for n, r in zip(sizes, refs))  # a group copies only its own tensors
    assert emu.acl_emu_count(b"d2d_copies") == 2 * pages
    if toggle == "1":  # one batch call per slice and side
        assert emu.acl_emu_count(b"aclrtMemcpyBatchAsync") == 2 * slices
        assert emu.acl_emu_count(b"aclrtMemcpyAsync") == 0
    else:
        assert emu.acl_emu_count(b"aclrtMemcpyBatchAsync") == 0
        assert emu.acl_emu_count(b"aclrtMemcpyAsync") > 2 * pages  # plus the link copies
    # a store's entry, filled + drained per slice; waits: a store's entry, filled per slice, drained on slot
    # reuse, a load's last
    assert emu.acl_emu_count(b"aclrtRecordEvent") == sum(st + 2 * n for st, n, _ in runs)
    assert emu.acl_emu_count(b"aclrtStreamWaitEvent") == sum(st + n + n - s + (not st) for st, n, s in runs)
    core.shutdown()
    assert emu.acl_emu_count(b"events_live") == live - 2 * (1 + 2 * SLOTS)


@pytest.mark.parametrize("toggle", ["1", "0"])
@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_failure_in_a_middle_slice_fails_the_job(built, emu, monkeypatch, toggle, direction):
    """Slice 1 fails (a store's gather, a load's link copy): the job's result says so, naming
    the call and the slice, and the next transfers run normally."""
    core, kv, refs, rng = staged_core(built, monkeypatch, toggle, 1, seed=5)
    real_submit = npu_pipeline.AclStagedPipeline.submit
    armed = {"on": False}

    def arm(d, local_bounds, link_bounds) -> None:
        if armed["on"] and Direction(d) is direction:
            emu.acl_emu_reset()  # descriptors are counted from here, in submission order
            first = local_bounds[1] + link_bounds[1]  # slice 0 is through, slice 1's first side starts
            emu.acl_emu_set_fail_at(int(first) + (direction is Direction.D2H))  # a load: its 1-run link copy

    def failing_submit(self, stager, transfer, *a, **k):
        plan = self.plan_only(stager, transfer)
        arm(transfer.direction, plan["local_bounds"], plan["link_bounds"])
        return real_submit(self, stager, transfer, *a, **k)

    monkeypatch.setattr(npu_pipeline.AclStagedPipeline, "submit", failing_submit)
    n, chunks = 15, np.arange(8, dtype=np.int64)
    ids = rng.choice(40, n, replace=False).astype(np.int64)
    if direction is Direction.H2D:  # a load needs stored data to fail on
        core.submit(1, Direction.D2H, ids, [n], [1], chunks)
        core.wait([1])
        assert [r.success for r in core.poll()] == [True]
    armed["on"] = True
    core.submit(2, direction, ids, [n], [1], chunks)
    core.wait([2])
    (res,) = core.poll()
    assert not res.success
    call = "aclrtMemcpyBatchAsync" if toggle == "1" else "aclrtMemcpyAsync"
    part = "gather" if direction is Direction.D2H else "link copy host->device"
    assert call in res.error and "staged slice 1 of " in res.error and part in res.error, res.error
    armed["on"] = False
    emu.acl_emu_set_fail_at(-1)
    store_then_load_groups(core, kv, refs, rng, [15], jobs=(3, 4))
    core.shutdown()


# -- one small transfer, run directly: the exact order of calls --------------------------------
S, A = 0x100, 0x200  # raw job / aux stream handles (the emulation only logs them)
PAGE, K, N_SLICES, N_SLOTS = 256, 3, 3, 2  # 2 tensors x 3 blocks of 256 bytes, one block per slice


def _small_job(pipe, direction: Direction, dev: torch.Tensor, stg: torch.Tensor, host: torch.Tensor,
               link: bool = True, bad_link: int | None = None):
    """(the job, the arrays it points into) of one small transfer, run directly: slice i copies block i
    of both tensors (tensor t, block b at t*K + b; descriptors slice after slice) to slot i % 2 (a record
    is both tensors' pages), then one link descriptor (host record i). ``bad_link``: that link
    descriptor's size is 0."""
    b, t = np.divmod(np.arange(2 * K), 2)
    dev_a = dev.data_ptr() + (t * K + b) * PAGE
    stg_a = stg.data_ptr() + (b % N_SLOTS) * 2 * PAGE + t * PAGE
    i = np.arange(N_SLICES)
    stg_r, host_r = stg.data_ptr() + (i % N_SLOTS) * 2 * PAGE, host.data_ptr() + i * 2 * PAGE
    store = direction is Direction.D2H
    link_size = np.full(N_SLICES, 2 * PAGE, np.int64)
    if bad_link is not None:
        link_size[bad_link] = 0
    arrays = [*(np.asarray(x, np.int64) for x in ((dev_a, stg_a) if store else (stg_a, dev_a))),
              np.full(2 * K, PAGE, np.int64), np.arange(0, 2 * K + 1, 2, dtype=np.int64),
              *(np.asarray(x, np.int64) for x in ((stg_r, host_r) if store else (host_r, stg_r))),
              link_size, np.arange(N_SLICES + 1, dtype=np.int64)]
    job = acl.StagedJob(int(store), int(link), int(pipe.local.batch), 0, pipe.local.max_batch, S,
                        A if link else None, pipe.events[direction], N_SLOTS, N_SLICES,
                        *(address(a) for a in arrays))
    return job, arrays


def _expected(store: bool, batch: bool, link: bool = True) -> list[tuple]:
    """The ACL pipeline's order, as Stager.run's Python loop has it but for a load's entry event (the library
    uploads no descriptors, and each scatter waits for its own link copy) (copies as (kind, stream) per
    batch call or descriptor)."""
    def copies(kind, stream, n):
        return [("copy", kind, stream)] * (1 if batch else n)

    if not link:
        return [op for _ in range(N_SLICES) for op in copies("D2D", "S", 2)]
    ops = [("record", "E", "S"), ("wait", "A", "E")] if store else []  # a load's scatters wait for their links
    lk = "D2H" if store else "H2D"
    for i in range(N_SLICES):
        s = i % N_SLOTS
        if i >= N_SLOTS:
            ops.append(("wait", "A" if store else "S", f"D{s}"))
        if store:
            ops += [*copies("D2D", "A", 2), ("record", f"F{s}", "A"), ("wait", "S", f"F{s}"),
                    *copies(lk, "S", 1), ("record", f"D{s}", "S")]
        else:
            ops += [*copies(lk, "S", 1), ("record", f"F{s}", "S"), ("wait", "A", f"F{s}"),
                    *copies("D2D", "A", 2), ("record", f"D{s}", "A")]
    if not store:
        ops.append(("wait", "S", f"D{(N_SLICES - 1) % N_SLOTS}"))
    return ops


def _parsed(log: bytes, events) -> list[tuple]:
    """The emulation's op log with streams and events by name (E entry, F filled, D drained)."""
    names = {hex(S): "S", hex(A): "A"}
    names.update({hex(e): n for e, n in zip(events, ["E"] + [f"F{s}" for s in range(N_SLOTS)] +
                                             [f"D{s}" for s in range(N_SLOTS)])})
    out = []
    for line in log.decode().splitlines():
        call, *args = line.split()
        kv = dict(a.split("=", 1) for a in args if "=" in a)
        if call == "aclrtRecordEvent":
            out.append(("record", names[kv["e"]], names[kv["s"]]))
        elif call == "aclrtStreamWaitEvent":
            out.append(("wait", names[kv["s"]], names[kv["e"]]))
        elif call.startswith("aclrtMemcpy"):  # one line per batch call, or per aclrtMemcpyAsync
            out.append(("copy", args[0], names[kv["s"]]))
    return out


def _paths(kind: str, lib_batch, lib_loop):
    from _npu_build_support import acl_path

    local = acl_path(kind, lib_batch, lib_loop, device_local=True)
    return local, acl_copy.AclCopyPath(None, batch=local.batch, lib=local.lib)


@pytest.mark.parametrize("kind", ["batch", "batch_v2", "loop"])
@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_op_order_and_bytes_of_a_small_transfer(emu, lib_batch, lib_loop, kind, direction):
    local, link = _paths(kind, lib_batch, lib_loop)
    pipe = local.fused_pipeline(link, N_SLOTS)
    assert isinstance(pipe, npu_pipeline.AclStagedPipeline)
    g = torch.Generator().manual_seed(3)
    dev = torch.randint(0, 256, (2 * K * PAGE,), dtype=torch.uint8, generator=g)
    host = torch.randint(0, 256, (N_SLICES * 2 * PAGE,), dtype=torch.uint8, generator=g)
    stg = torch.zeros(N_SLOTS * 2 * PAGE, dtype=torch.uint8)
    dev0, host0 = dev.clone(), host.clone()
    emu.acl_emu_reset()
    job, _arrays = _small_job(pipe, direction, dev, stg, host)
    acl.staged_run(job, pipe.lib)
    got = _parsed(emu.acl_emu_log(), pipe.events[direction])
    assert got == _expected(direction is Direction.D2H, kind != "loop")
    # The bytes: host record i = (tensor 0 block i, tensor 1 block i), and back.
    pages = dev0.view(2, K, PAGE) if direction is Direction.D2H else host0.view(N_SLICES, 2, PAGE).transpose(0, 1)
    out = host.view(N_SLICES, 2, PAGE).transpose(0, 1) if direction is Direction.D2H else dev.view(2, K, PAGE)
    assert torch.equal(out, pages)
    pipe.close()


@pytest.mark.parametrize("kind", ["batch", "loop"])
def test_link_false_runs_only_the_gathers_on_the_job_stream(emu, lib_batch, lib_loop, kind):
    local, link = _paths(kind, lib_batch, lib_loop)
    pipe = local.fused_pipeline(link, N_SLOTS)
    dev = torch.randint(0, 256, (2 * K * PAGE,), dtype=torch.uint8)
    host = torch.zeros(N_SLICES * 2 * PAGE, dtype=torch.uint8)
    stg = torch.zeros(N_SLOTS * 2 * PAGE, dtype=torch.uint8)
    emu.acl_emu_reset()
    job, _arrays = _small_job(pipe, Direction.D2H, dev, stg, host, link=False)
    acl.staged_run(job, pipe.lib)
    assert _parsed(emu.acl_emu_log(), []) == _expected(True, kind != "loop", link=False)
    assert not host.any()  # nothing crossed the link
    # slot 0 holds slice 2 (it was reused), slot 1 slice 1: (tensor t, block b) at slot b % 2, page t
    pages = dev.view(2, K, PAGE)
    slots = stg.view(N_SLOTS, 2, PAGE)
    assert torch.equal(slots[0], pages[:, 2]) and torch.equal(slots[1], pages[:, 1])
    pipe.close()


def test_no_fused_pipeline_unless_local_and_link_share_the_library(emu, lib_batch, lib_loop):
    local, link = _paths("batch", lib_batch, lib_loop)
    assert link.fused_pipeline(local, 2) is None  # the host-side path is not the local side
    other = acl_copy.AclCopyPath(None, batch=False, lib=lib_loop)
    assert local.fused_pipeline(other, 2) is None


def test_bad_jobs_fail_whole_before_any_call(emu, lib_batch, lib_loop):
    local, link = _paths("batch", lib_batch, lib_loop)
    pipe = local.fused_pipeline(link, N_SLOTS)
    dev = torch.zeros(2 * K * PAGE, dtype=torch.uint8)
    stg, host = torch.zeros(N_SLOTS * 2 * PAGE, dtype=torch.uint8), torch.zeros(N_SLICES * 2 * PAGE, dtype=torch.uint8)
    job, _arrays = _small_job(pipe, Direction.D2H, dev, stg, host, bad_link=2)
    emu.acl_emu_reset()
    with pytest.raises(acl.AclCopyError, match="descriptor 2 is invalid"):
        acl.staged_run(job, pipe.lib)
    assert emu.acl_emu_log() == b""
    pipe.close()

