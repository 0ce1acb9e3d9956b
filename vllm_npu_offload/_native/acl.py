"""ctypes binding of ``libnpu_offload_acl.so`` (the copy paths over it: ``copy.acl_copy``).

The library is plain C with every ACL symbol resolved at run time, so loading it never
needs CANN; a missing ``libascendcl.so`` (or symbol) surfaces as a ``CopyError`` from
the first copy, naming what is missing. Streams are raw ``aclrtStream`` handles taken
from the platform (torch_npu's ``.npu_stream``, which flushes its task queue first).
"""

from __future__ import annotations

import ctypes
import functools
import os


from ..errors import CopyError
from . import library_path

LIBRARY_NAME = "npu_offload_acl"

# Status codes of the C library (csrc_npu/npu_offload_acl.h).
OK, ACL_FAILED, MISSING, BAD_ARGUMENT, NOT_BUILT = range(5)
# Direction codes of the C library: 0 and 1 are Direction.H2D / D2H; 2 copies within the current device.
D2D = 2


class AclError(ctypes.Structure):
    """Mirror of ``npu_offload_acl_error``."""

    _fields_ = [
        ("acl_code", ctypes.c_int32),
        ("status", ctypes.c_int32),
        ("index", ctypes.c_int64),
        ("fail_index", ctypes.c_int64),
        ("call", ctypes.c_char * 64),
        ("message", ctypes.c_char * 512),
    ]


class AclCopyError(CopyError):
    """A CopyError that also carries ACL's return code, failIndex and the library status."""

    def __init__(self, message: str, call: str, index: int | None, fail_index: int | None, acl_code: int, status: int):
        super().__init__(message, call, index)
        self.fail_index = fail_index
        self.acl_code = acl_code
        self.status = status


OUT_OF_RANGE = 5  # NPU_OFFLOAD_OUT_OF_RANGE


def _raise(err: AclError, what: str) -> None:
    idx = err.index if err.index >= 0 else None
    fail = err.fail_index if err.fail_index >= 0 else None
    msg = f"{what}: {err.message.decode(errors='replace')}"
    if idx is not None:
        msg += f" [descriptor {idx}" + (f", failIndex {fail}]" if fail is not None else "]")
    if err.status == OUT_OF_RANGE:  # a block id the planner checked: bad input, nothing enqueued
        raise ValueError(msg)
    raise AclCopyError(msg, err.call.decode(errors="replace"), idx, fail, err.acl_code, err.status)


class StagedJob(ctypes.Structure):
    """Mirror of ``npu_offload_staged_job`` (csrc_npu/npu_offload_acl.h)."""

    _fields_ = [
        ("store", ctypes.c_int32), ("link", ctypes.c_int32), ("batch", ctypes.c_int32), ("reserved", ctypes.c_int32),
        ("max_per_call", ctypes.c_int64), ("stream", ctypes.c_void_p), ("aux", ctypes.c_void_p),
        ("events", ctypes.POINTER(ctypes.c_void_p)), ("slots", ctypes.c_int64), ("n_slices", ctypes.c_int64),
        ("local_src", ctypes.c_void_p), ("local_dst", ctypes.c_void_p), ("local_size", ctypes.c_void_p),
        ("local_bounds", ctypes.c_void_p), ("link_src", ctypes.c_void_p), ("link_dst", ctypes.c_void_p),
        ("link_size", ctypes.c_void_p), ("link_bounds", ctypes.c_void_p),
    ]


class StagedGroup(ctypes.Structure):
    """Mirror of ``npu_offload_staged_group``: one KV group of a transfer the library plans."""

    _fields_ = [("pairs", ctypes.c_void_p), ("n_pairs", ctypes.c_int64), ("span_lo", ctypes.c_int64),
                ("span_hi", ctypes.c_int64), ("device_ids", ctypes.c_void_p), ("host_ids", ctypes.c_void_p),
                ("blocks", ctypes.c_int64), ("device_limit", ctypes.c_int64)]


class StagedRequest(ctypes.Structure):
    """Mirror of ``npu_offload_staged_request``: a staged transfer the library plans and enqueues."""

    _fields_ = [("job", StagedJob), ("groups", ctypes.POINTER(StagedGroup)), ("n_groups", ctypes.c_int64)] + [
        (name, ctypes.c_int64) for name in ("slot_blocks", "record_bytes", "pages_end", "staging_base", "host_base",
                                           "host_blocks", "min_slice_bytes", "ramp", "growth")] + [
        ("out_src", ctypes.c_void_p), ("out_dst", ctypes.c_void_p), ("out_size", ctypes.c_void_p),
        ("capacity", ctypes.c_int64)]


class StagedPlanOut(ctypes.Structure):
    """Mirror of ``npu_offload_staged_plan_out`` (the plan alone: tests, benchmarks)."""

    _fields_ = [("local_bounds", ctypes.c_void_p), ("link_bounds", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("cap_slices", "n_slices", "n_local", "n_links")]


def load_library(path: "str | os.PathLike | None" = None) -> ctypes.CDLL:
    """The built library (``path`` or the one ``library_path`` finds); ImportError when not built."""
    path = path or library_path(LIBRARY_NAME)
    if path is None:
        raise ImportError(
            f"lib{LIBRARY_NAME}.so is not built; run `python csrc_npu/build.py` (needs ACL headers) "
            "or reinstall with NPU_OFFLOAD_BUILD_NPU=1"
        )
    return _open(os.fspath(path))


@functools.lru_cache(maxsize=None)
def _open(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    i64p, err_p = ctypes.c_void_p, ctypes.POINTER(AclError)
    common = [i64p, i64p, i64p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.npu_offload_acl_copy_batch.argtypes = [*common, ctypes.c_int64, err_p]
    lib.npu_offload_acl_copy_loop.argtypes = [*common, err_p]
    lib.npu_offload_acl_batch_form.argtypes = [err_p]
    lib.npu_offload_acl_set_batch_form.argtypes = [ctypes.c_int]
    lib.npu_offload_acl_probe.argtypes = [err_p]
    lib.npu_offload_acl_host_register.argtypes = [ctypes.c_void_p, ctypes.c_uint64, err_p]
    lib.npu_offload_acl_host_unregister.argtypes = [ctypes.c_void_p, err_p]
    lib.npu_offload_acl_staged_run.argtypes = [ctypes.POINTER(StagedJob), err_p]
    i64_out = ctypes.POINTER(ctypes.c_int64)
    lib.npu_offload_acl_staged_submit.argtypes = [ctypes.POINTER(StagedRequest), i64_out, i64_out, err_p]
    lib.npu_offload_acl_staged_plan.argtypes = [ctypes.POINTER(StagedRequest), ctypes.POINTER(StagedPlanOut), err_p]
    for fn in ("npu_offload_acl_events_create", "npu_offload_acl_events_destroy"):
        getattr(lib, fn).argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), err_p]
    for fn in ("npu_offload_acl_build_mode", "npu_offload_acl_build_info"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = []
    return lib


def build_mode(lib: ctypes.CDLL | None = None) -> str:
    """``"batch"`` or ``"loop"``: what the build toggle compiled in."""
    return (lib or load_library()).npu_offload_acl_build_mode().decode()


def batch_form(lib: ctypes.CDLL | None = None) -> tuple[int, str]:
    """(1 = aclrtMemcpyBatchAsync, 2 = ...V2, 0 = unusable) and why not when 0. Loads ACL."""
    err = AclError()
    form = (lib or load_library()).npu_offload_acl_batch_form(ctypes.byref(err))
    return form, "" if form else err.message.decode(errors="replace")


def set_batch_form(form: int, lib: ctypes.CDLL | None = None) -> None:
    """Force the batch symbol: 0 auto (failIndex form if exported), 1 failIndex form, 2 V2 form."""
    if (lib or load_library()).npu_offload_acl_set_batch_form(int(form)) != OK:
        raise ValueError(f"batch form {form!r} is not one of 0 (auto), 1 (aclrtMemcpyBatchAsync), 2 (V2)")


def probe(lib: ctypes.CDLL | None = None) -> str:
    """Empty when libascendcl and aclrtMemcpyAsync resolve, else why not."""
    err = AclError()
    if (lib or load_library()).npu_offload_acl_probe(ctypes.byref(err)) == OK:
        return ""
    return err.message.decode(errors="replace")


def acl_host_register(ptr: int, nbytes: int) -> bool:
    """Page-lock ``[ptr, ptr+nbytes)`` (widened to 4 KiB pages) with aclrtHostRegisterV2. False on failure."""
    try:
        lib = load_library()
    except (ImportError, OSError):
        return False
    err = AclError()
    return lib.npu_offload_acl_host_register(ctypes.c_void_p(ptr), nbytes, ctypes.byref(err)) == OK


def acl_host_unregister(ptr: int) -> None:
    err = AclError()
    if load_library().npu_offload_acl_host_unregister(ctypes.c_void_p(ptr), ctypes.byref(err)) != OK:
        _raise(err, "unpinning host memory")


def create_events(n: int, lib: ctypes.CDLL) -> "ctypes.Array[ctypes.c_void_p]":
    """``n`` ACL events owned by this library (the staged pipeline's slot events)."""
    events, err = (ctypes.c_void_p * n)(), AclError()
    if lib.npu_offload_acl_events_create(n, events, ctypes.byref(err)) != OK:
        _raise(err, f"creating {n} staging events")
    return events


def destroy_events(events: "ctypes.Array[ctypes.c_void_p]", lib: ctypes.CDLL) -> None:
    err = AclError()
    if lib.npu_offload_acl_events_destroy(len(events), events, ctypes.byref(err)) != OK:
        _raise(err, "destroying staging events")


def staged_run(job: StagedJob, lib: ctypes.CDLL) -> None:
    """Enqueue one staged transfer (``npu_offload_acl_staged_run``); AclCopyError on failure."""
    err = AclError()
    if lib.npu_offload_acl_staged_run(ctypes.byref(job), ctypes.byref(err)) != OK:
        _raise(err, f"staged {'store' if job.store else 'load'} of {job.n_slices} slices failed")


def staged_submit(req: StagedRequest, lib: ctypes.CDLL) -> tuple[int, int]:
    """Plan and enqueue one staged transfer (``npu_offload_acl_staged_submit``): (slices, link
    copies); AclCopyError on failure."""
    err, slices, links = AclError(), ctypes.c_int64(), ctypes.c_int64()
    if lib.npu_offload_acl_staged_submit(ctypes.byref(req), ctypes.byref(slices), ctypes.byref(links),
                                         ctypes.byref(err)) != OK:
        _raise(err, f"natively planned staged {'store' if req.job.store else 'load'} failed")
    return slices.value, links.value


def staged_plan(req: StagedRequest, out: StagedPlanOut, lib: ctypes.CDLL) -> None:
    """Plan one staged transfer without enqueueing it (``npu_offload_acl_staged_plan``)."""
    err = AclError()
    if lib.npu_offload_acl_staged_plan(ctypes.byref(req), ctypes.byref(out), ctypes.byref(err)) != OK:
        _raise(err, f"planning a staged {'store' if req.job.store else 'load'} failed")


def library_info() -> str:
    """One line for ``python -m vllm_npu_offload info``."""
    try:
        lib = load_library()
    except (ImportError, OSError) as e:
        return f"not built ({e})"
    line = f"built, mode={build_mode(lib)}, {lib.npu_offload_acl_build_info().decode()}, {lib._name}"
    why = probe(lib)
    if why:
        return line + f"; runtime: {why}"
    if build_mode(lib) != "batch":
        return line + "; runtime: ACL library resolved, per-copy loop"
    form, why = batch_form(lib)
    used = {1: "aclrtMemcpyBatchAsync", 2: "aclrtMemcpyBatchAsyncV2"}.get(form, f"loop only ({why})")
    return line + f"; runtime: ACL library resolved, batch via {used}"
