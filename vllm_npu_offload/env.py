"""Every run-time environment variable the package reads: name, type, default, meaning.

One parser, one list: ``get(NAME)`` returns the checked value (a bad value raises a
``ValueError`` naming the variable, the value and what is allowed), and
``python -m vllm_npu_offload info`` prints the list with the values in effect. Values are read
where the object that uses them is built (a worker core, a copy path), never per transfer.
Each is for a user or an operator, and its meaning says when to set it: tuning constants live in
the module that uses them, with the measurement that chose them. Build-time flags (``NPU_OFFLOAD_BUILD_*``, ``VLLM_ASCEND_ENABLE_BATCH_MEMCPY`` ...)
are read by ``setup.py`` / ``csrc_*/build.py``, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


FAULT_KINDS = ("load", "store", "disk_read", "disk_corrupt", "disk_write")


def parse_faults(raw: str) -> dict[str, float] | None:
    """``KIND=P,KIND=P`` with KIND in FAULT_KINDS and 0 <= P <= 1; None if malformed."""
    out: dict[str, float] = {}
    for part in raw.split(","):
        kind, eq, val = part.strip().partition("=")
        try:
            p = float(val)
        except ValueError:
            return None
        if not eq or kind not in FAULT_KINDS or not 0.0 <= p <= 1.0:
            return None
        out[kind] = p
    return out


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "flag" (0/1), "int", "choice", "path", "faults"
    default: Any  # the value when unset (None: decided by the code, see meaning)
    meaning: str
    choices: tuple[str, ...] = ()
    lo: int | None = None
    hi: int | None = None

    def raw(self) -> str:
        return os.environ.get(self.name, "").strip()

    def allowed(self) -> str:
        if self.kind == "flag":
            return "0 or 1"
        if self.kind == "choice":
            return ", ".join(self.choices)
        if self.kind == "int":
            return f"an integer in {self.lo}..{self.hi}" if self.hi is not None else f"an integer >= {self.lo}"
        if self.kind == "faults":
            return f"KIND=PROBABILITY[,KIND=PROBABILITY...] with KIND in {', '.join(FAULT_KINDS)} and 0 <= PROBABILITY <= 1"
        return "a folder"

    def get(self) -> Any:
        raw = self.raw()
        if not raw:
            return self.default
        bad = ValueError(f"{self.name}={raw!r}; allowed: {self.allowed()}, or unset "
                         f"({'default ' + repr(self.default) if self.default is not None else 'automatic'})")
        if self.kind == "flag":
            if raw not in ("0", "1"):
                raise bad
            return raw == "1"
        if self.kind == "choice":
            if raw not in self.choices:
                raise bad
            return raw
        if self.kind == "faults":
            val = parse_faults(raw)
            if val is None:
                raise bad
            return val
        if self.kind == "int":
            try:
                val = int(raw)
            except ValueError:
                raise bad from None
            if (self.lo is not None and val < self.lo) or (self.hi is not None and val > self.hi):
                raise bad
            return val
        return raw


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("NPU_OFFLOAD_COPY_PATH", "choice", None,
         "force one direct copy path for both directions (unset: calibrated per direction): to pin a path the "
         "start-up measurement misjudges, or to compare paths",
         ("host", "dma", "dma_loop", "sm", "gather_native", "acl_batch", "acl_loop")),
    Knob("NPU_OFFLOAD_STAGED", "flag", None,
         "1: every transfer staged, 0: every transfer direct (unset: by size, from the start-up measurement; "
         "CPU-only machines stay direct): to override the measured crossover"),
    Knob("NPU_OFFLOAD_STAGED_STORES", "flag", None,
         "0: stores always direct on the copy engines, 1: stores staged from the measured size (unset: direct "
         "on CUDA for pages of 32 KiB or more, else as 1; loads as NPU_OFFLOAD_STAGED says): 0 keeps every "
         "gather kernel off the model's device"),
    Knob("NPU_OFFLOAD_CALIBRATE", "flag", True,
         "0 skips the start-up measurements (copy path, staged threshold) and uses heuristics: a faster "
         "start, or a device busy with other work while the worker starts"),
    Knob("NPU_OFFLOAD_CACHE_DIR", "path", None,
         "folder of the calibration cache (unset: $XDG_CACHE_HOME or ~/.cache, /vllm_npu_offload): for a "
         "read-only home, or one cache shared by identical machines"),
    Knob("NPU_OFFLOAD_NUMA_NODE", "int", None,
         "NUMA node of the host KV buffer (unset: the device's node from sysfs): where sysfs does not say "
         "it, or the CPUs that serve the device sit elsewhere", lo=0),
    Knob("NPU_OFFLOAD_NATIVE_DIR", "path", None,
         "folder holding libnpu_offload_cuda.so / libnpu_offload_acl.so (unset: the package's _native/): "
         "libraries built apart from the install, e.g. for another toolkit"),
    Knob("NPU_OFFLOAD_ALLOW_UNKNOWN_KEYS", "flag", False,
         "1: an unknown kv_connector_extra_config key is a warning, not an error: a config written for a "
         "newer release still starts"),
    Knob("NPU_OFFLOAD_FAULTS", "faults", None,
         "a test hook: failures injected at random into copies (load, store) and disk tier I/O (disk_read, "
         "disk_corrupt, disk_write), e.g. load=0.02,disk_corrupt=0.1, to see in real serving that each is a "
         "recompute with the right tokens, counted (vllm_npu_offload/faults.py); never set it for users"),
    Knob("NPU_OFFLOAD_DEVICE", "choice", None,
         "force the device kind (unset: npu > cuda > cpu by availability): a host with more than one kind, "
         "or the CPU path on an accelerator host",
         ("npu", "cuda", "cpu")),
)}


def get(name: str) -> Any:
    """The checked value of one variable (its default when unset)."""
    return KNOBS[name].get()


def describe() -> list[tuple[str, str, str]]:
    """(name, value in effect or 'unset', meaning) of every variable, for ``info``."""
    out = []
    for k in KNOBS.values():
        try:
            val = repr(k.get()) if k.raw() else "unset"
        except ValueError as e:
            val = f"INVALID ({e})"
        out.append((k.name, val, k.meaning))
    return out


__all__ = ["FAULT_KINDS", "KNOBS", "Knob", "describe", "get", "parse_faults"]
