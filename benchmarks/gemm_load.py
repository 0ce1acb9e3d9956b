"""A bf16 GEMM loop on its own stream: the stand-in for model kernels in interference runs.

Why: copies that hold SMs (or HBM bandwidth) slow the model down; the honest measure is the
slowdown of a real compute-bound kernel running at the same time, not the copy's own speed.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from vllm_npu_offload.platform import Platform


class GemmLoad:
    def __init__(self, platform: Platform, n: int = 8192, count: int = 30):
        self.platform, self.n, self.count = platform, n, count
        self.a = torch.randn(n, n, device=platform.device, dtype=torch.bfloat16)
        self.b, self.c = torch.randn_like(self.a), torch.empty_like(self.a)
        self.stream = platform.new_stream()
        self.ev0, self.ev1 = platform.new_event(), platform.new_event()

    def start(self) -> None:
        """Enqueue ``count`` GEMMs between two events on the load's stream (returns at once)."""
        with self.platform.stream_context(self.stream):
            self.ev0.record(self.stream)
            for _ in range(self.count):
                torch.matmul(self.a, self.b, out=self.c)
            self.ev1.record(self.stream)

    def finish_ms(self) -> float:
        self.ev1.synchronize()
        return self.ev0.elapsed_time(self.ev1)

    def alone_ms(self, reps: int = 3) -> float:
        """Median device time of the loop with nothing else running (after one warm-up)."""
        times = []
        for _ in range(reps + 1):
            self.start()
            times.append(self.finish_ms())
        return statistics.median(times[1:])

    def while_running(self, step: Callable[[], None]) -> tuple[float, int, float]:
        """Run ``step`` back to back while the loop runs: (loop ms, steps done, their wall seconds)."""
        self.start()
        steps, t0 = 0, time.perf_counter()
        while not self.ev1.query():
            step()
            steps += 1
        wall = time.perf_counter() - t0
        return self.finish_ms(), steps, wall
