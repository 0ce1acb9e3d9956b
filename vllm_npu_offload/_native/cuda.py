"""ctypes binding of ``libnpu_offload_cuda.so``: batch / per-copy DMA, the gather kernel's
launcher, the staged pipeline, driver streams and events.

Below the platform and the copy paths (both use it; it uses neither). The library is plain
C, so it works with any torch build; the driver is resolved inside it at run time.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from typing import Any

import numpy as np

from ..errors import CopyError
from . import library_path

LIB_BASENAME = "npu_offload_cuda"
ABI_VERSION = 10
MODE_NAMES = {0: "loop", 1: "batch_v1 (CUDA 12.8 ABI)", 2: "batch_v2 (CUDA 13 ABI)"}
NPO_ERR_RANGE = -4  # a block id out of range: bad input, raised as ValueError
_MSG_LEN = 512

_u64p = ctypes.POINTER(ctypes.c_uint64)


class NativeCudaLib:
    """The loaded library with typed entry points."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        copy_args = [_u64p, _u64p, _u64p, ctypes.c_size_t]
        lib.npo_cuda_batch_copy.argtypes = copy_args + [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.npo_cuda_loop_copy.argtypes = copy_args + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.npo_cuda_runtime_mode.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
        u64 = ctypes.c_uint64
        lib.npo_cuda_gather.argtypes = [u64] * 8 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.npo_cuda_gather_load.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.npo_cuda_staged_plan.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.npo_cuda_staged_submit.argtypes = [ctypes.c_void_p, _u64p, ctypes.c_char_p, ctypes.c_size_t]
        events_args = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        lib.npo_cuda_events_create.argtypes = lib.npo_cuda_events_destroy.argtypes = events_args
        lib.npo_cuda_stream_create.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                               ctypes.c_size_t]
        lib.npo_cuda_stream_destroy.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        for fn in ("npo_cuda_batch_copy", "npo_cuda_loop_copy", "npo_cuda_runtime_mode", "npo_cuda_built_mode",
                   "npo_cuda_abi_version", "npo_cuda_gather", "npo_cuda_gather_built", "npo_cuda_gather_load",
                   "npo_cuda_staged_plan", "npo_cuda_staged_submit", "npo_cuda_events_create",
                   "npo_cuda_events_destroy", "npo_cuda_stream_create", "npo_cuda_stream_destroy"):
            getattr(lib, fn).restype = ctypes.c_int
        abi = lib.npo_cuda_abi_version()
        if abi != ABI_VERSION:
            raise ImportError(f"{path} has ABI version {abi}, this package needs {ABI_VERSION}; rebuild it")
        self._lib = lib
        self._tls = threading.local()

    @property
    def built_batch(self) -> bool:
        return bool(self._lib.npo_cuda_built_mode())

    @property
    def built_gather(self) -> bool:
        """The device-local gather kernel is compiled in (the library was built with nvcc)."""
        return bool(self._lib.npo_cuda_gather_built())

    def runtime_mode(self) -> tuple[int, int, str]:
        """(mode, driver_version, error): mode < 0 means the driver could not be resolved."""
        ver = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(_MSG_LEN)
        mode = self._lib.npo_cuda_runtime_mode(ctypes.byref(ver), buf, _MSG_LEN)
        return mode, ver.value, buf.value.decode(errors="replace") if mode < 0 else ""

    def describe(self) -> dict:
        mode, ver, err = self.runtime_mode()
        return {
            "library": self.path,
            "built": "batch" if self.built_batch else "loop",
            "gather_kernel": self.built_gather,
            "runtime": MODE_NAMES.get(mode, "unavailable"),
            "driver_version": ver,
            "error": err,
        }

    def _msg(self) -> ctypes.Array:
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = ctypes.create_string_buffer(_MSG_LEN)
        return buf

    def copy(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream_handle: int, batch: bool,
             src_order_any: bool = False) -> None:
        n = len(sizes)
        if n == 0:
            return
        arrs = [np.ascontiguousarray(a, dtype=np.int64) for a in (src, dst, sizes)]
        ptrs = [a.ctypes.data_as(_u64p) for a in arrs]
        buf = self._msg()
        if batch:
            rc = self._lib.npo_cuda_batch_copy(*ptrs, n, int(src_order_any), stream_handle or None, buf, _MSG_LEN)
        else:
            rc = self._lib.npo_cuda_loop_copy(*ptrs, n, stream_handle or None, buf, _MSG_LEN)
        if rc != 0:
            msg = buf.value.decode(errors="replace")
            m = re.search(r"descriptor (\d+)", msg)
            call = msg.split(" ", 1)[0].rstrip(":")
            raise CopyError(f"{msg} (rc={rc}, {n} descriptors)", call, int(m.group(1)) if m else None)

    def _call(self, fn, *args, call: str, what: str = "") -> None:
        """Call a library entry point with the thread's message buffer; on a nonzero return code,
        CopyError with the library's message, naming ``call`` and what was being copied."""
        buf = self._msg()
        rc = fn(*args, buf, _MSG_LEN)
        if rc != 0:
            self._fail(rc, buf, call, what)

    @staticmethod
    def _fail(rc: int, buf, call: str, what: str = "") -> None:
        text = buf.value.decode(errors="replace")
        if rc == NPO_ERR_RANGE:  # checked before anything was enqueued
            raise ValueError(text)
        raise CopyError(f"{text} (rc={rc}{', ' + what if what else ''})", call)

    def gather(self, columns: tuple[int, int, int], first: int, width: int, rows: int, stride: int, min_page: int,
               programs: int, stream_handle: int) -> None:
        """Launch the gather kernel over device-resident descriptor ``columns`` (src, dst, size)."""
        self._call(self._lib.npo_cuda_gather, *columns, first, width, rows, stride, min_page, programs,
                   stream_handle or None, call="npo_cuda_gather", what=f"{rows * width} descriptors")

    def gather_load(self) -> None:
        """Load the gather kernel into the current context now: loading code may wait for the device,
        so at a transfer's first launch it held that submit until the model's step ended."""
        self._call(self._lib.npo_cuda_gather_load, call="npo_cuda_gather_load")

    def staged_plan(self, request, out) -> None:
        """Plan a staged transfer (``cuda_pipeline.StagedRequest``) into ``out`` without enqueueing it."""
        self._call(self._lib.npo_cuda_staged_plan, ctypes.byref(request), ctypes.byref(out),
                   call="npo_cuda_staged_plan")

    def staged_submit(self, request) -> int:
        """Plan and enqueue a staged transfer in one call; its link copy count. The thread's message
        buffer, count and references to a reused request are made once (``staged_submitter``)."""
        cache = getattr(self._tls, "submit", None)
        if cache is None:
            cache = self._tls.submit = {}
        refs = cache.get(id(request))  # held with its entry, so no other request takes its id meanwhile
        if refs is None:
            if len(cache) >= 8:  # one request per direction and pipeline: a few; stay small
                cache.clear()
            refs = cache[id(request)] = (request, self.staged_submitter(request))
        call, links, msg = refs[1]
        rc = call()
        if rc != 0:
            self.staged_failed(rc, msg)
        return links.value

    def staged_submitter(self, request) -> tuple[Any, Any, Any]:
        """(call, links, msg): ``call()`` is ``npo_cuda_staged_submit`` on ``request`` with its arguments
        bound (a C partial, no Python frame), its return code returned; then ``links.value`` is the
        link copy count, and ``staged_failed(rc, msg)`` raises a failure. For a caller that reuses one
        request from one thread at a time (this call sits on a transfer's critical path; ctypes objects
        cost ~0.1-0.2 us each to make on the engine thread, and each Python frame more when the step
        before left the caches cold)."""
        links, msg = ctypes.c_uint64(), self._msg()
        call = functools.partial(self._lib.npo_cuda_staged_submit, ctypes.byref(request), ctypes.byref(links), msg,
                                 _MSG_LEN)
        return call, links, msg

    def staged_failed(self, rc: int, msg) -> None:
        self._fail(rc, msg, "npo_cuda_staged_submit")

    def create_events(self, n: int):
        """``n`` timing-disabled CUevents, as a ctypes array of handles."""
        evs = (ctypes.c_void_p * n)()
        self._call(self._lib.npo_cuda_events_create, n, evs, call="cuEventCreate")
        return evs

    def destroy_events(self, evs) -> None:
        self._call(self._lib.npo_cuda_events_destroy, len(evs), evs, call="cuEventDestroy")

    def create_stream(self, priority: int = 0) -> int:
        """A non-blocking driver stream of our own (its raw handle)."""
        out = ctypes.c_void_p()
        self._call(self._lib.npo_cuda_stream_create, int(priority), ctypes.byref(out), call="cuStreamCreateWithPriority",
                   what=f"priority {priority}")
        return int(out.value or 0)

    def destroy_stream(self, handle: int) -> None:
        self._call(self._lib.npo_cuda_stream_destroy, handle or None, call="cuStreamDestroy")


_LIB: NativeCudaLib | None = None
_LIB_LOCK = threading.Lock()


def load_library() -> NativeCudaLib:
    """The loaded library (cached); ImportError naming how to build it when absent."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            path = library_path(LIB_BASENAME)
            if path is None:
                raise ImportError(
                    f"lib{LIB_BASENAME}.so not found; build it with `python csrc_cuda/build.py` or "
                    "`pip install .` on a machine with the CUDA toolkit (or set NPU_OFFLOAD_NATIVE_DIR)"
                )
            _LIB = NativeCudaLib(str(path))
        return _LIB
