"""CPU platforms posing as CUDA for the fake libcuda.so.1 (which copies at call time): shared by
the fake-driver cases (gather_cases.py) and scripts/dev/bench_front_end_cuda.py."""

import torch

from vllm_npu_offload.platform import CpuPlatform


class FakeCuda(CpuPlatform):
    """A CPU platform posing as 'cuda': streams run inline, the fake driver copies at call time."""

    kind = "cuda"

    def raw_stream_handle(self, stream) -> int:
        return 0x51

    def device_name(self) -> str:
        return "fake-cuda"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class RawEvent:
    """An event the fake driver takes by handle (its copies are done at call time: always complete)."""

    _next = 0xE000

    def __init__(self):
        RawEvent._next += 1
        self.cuda_event = RawEvent._next

    def record(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return 0.0


class FakeCudaOrdered(FakeCuda):
    """FakeCuda whose events have driver handles: the engine hands natively planned transfers
    their stream order (the ordered branch of ``TransferEngine.submit``)."""

    raw_events = True

    def new_event(self):
        return RawEvent()

    def raw_event_handle(self, event) -> int:
        return event.cuda_event

    def raw_current_stream(self) -> int:
        return 0xC0

    def raw_order(self, start, end, after=None):
        # as CudaPlatform's: the handles read as attributes, the current stream inline (no frame),
        # so the fake-driver cases count the frames a CUDA submit makes (gather_cases.case_submit_frames)
        return 0xC0, 0 if after is None else after.cuda_event, start.cuda_event, end.cuda_event
