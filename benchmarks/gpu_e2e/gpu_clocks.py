"""SM clock, power and temperature while one engine runs a round (benchmark only).

Why: after staged stores, ours' steady decode steps kept the same kernels and busy time as
offload off's but left the device idle ~0.16 ms longer per step (H200, 2026-11-25). Memory-bound decode kernels hardly feel a lower SM clock, while the gaps between them
(launch and scheduling work on the device) do; no run had recorded the clocks. ``ClockSampler``
runs ``nvidia-smi -lms`` beside the round and stamps each sample with the host's own clock, so
the round's last part (its decode steps) can be read on its own.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
NAMES = ("sm_mhz", "mem_mhz", "power_w", "temp_c")


@dataclass
class ClockSampler:
    """``with ClockSampler() as s: ...`` samples every ``period_ms``; ``s.summary(tail_s)`` gives
    the medians over the whole span and over its last ``tail_s`` seconds. No nvidia-smi (or a
    failing one): an empty summary, never an error; the benchmark does not depend on it."""

    period_ms: int = 50
    gpu: int = 0
    command: str = "nvidia-smi"
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _proc: subprocess.Popen | None = None
    _thread: threading.Thread | None = None
    _end: float = 0.0

    def __enter__(self) -> "ClockSampler":
        try:
            self._proc = subprocess.Popen(
                [self.command, f"--id={self.gpu}", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return self
        self._thread = threading.Thread(target=self._read, name="clock-sampler", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            vals = parse_line(line)
            if vals is not None:
                self.samples.append((time.perf_counter(), vals))

    def __exit__(self, *exc) -> None:
        self._end = time.perf_counter()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            if self._thread is not None:
                self._thread.join(timeout=5)

    def summary(self, tail_s: float) -> dict:
        """Medians of each field over every sample and over those of the last ``tail_s`` seconds."""
        out: dict = {"samples": len(self.samples)}
        for part, xs in (("all", self.samples), ("tail", [s for s in self.samples if s[0] >= self._end - tail_s])):
            for name in NAMES:
                vals = [v[name] for _, v in xs if name in v]
                out[f"{part}_{name}"] = round(statistics.median(vals), 1) if vals else None
        return out


def parse_line(line: str) -> dict[str, float] | None:
    """One ``nvidia-smi --format=csv,noheader,nounits`` line of ``FIELDS``; fields it could not
    read ("[N/A]") are left out, a line that is not a sample gives None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    out = {}
    for name, p in zip(NAMES, parts):
        try:
            out[name] = float(p)
        except ValueError:
            continue
    return out or None


__all__ = ["ClockSampler", "FIELDS", "NAMES", "parse_line"]
