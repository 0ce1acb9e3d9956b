#!/usr/bin/env python3
"""What the engine thread's kinds of Python work cost on this host, one op at a time (issue #22).

The whole-transfer front end (plan + submit + the reporting poll) costs ~4x more on the H200's host
than on the CPU rig, where a plain call costs only ~1.5x more. Run on both, the table's ratios tell
which kind of work the host is slow at: calls, attribute and dict work, numpy on small arrays, ctypes,
locks, clock reads, object creation, or (with a GPU) torch's stream and event calls.

Each op runs ``--inner`` times in a loop per sample; the table prints ns per op (median of
``--samples``, the loop's own cost taken off). Prints a table, writes JSON. No vLLM, no GPU needed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform as pyplatform
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class _Slots:
    a: int = 1
    b: int = 2


class _Req(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint64), ("p", ctypes.c_void_p)]


def _f(a, b):
    return a


def ops() -> dict:
    """name -> zero-argument callable doing one op (the loop calls it, so a call is in every row)."""
    s, d, lst, lock, rlock = _Slots(), {1: 2, "k": 3}, [], threading.Lock(), threading.RLock()
    arr = np.arange(64, dtype=np.int64)
    req = _Req()
    libc = ctypes.CDLL(None)
    getpid = libc.getpid
    getpid.restype, getpid.argtypes = ctypes.c_int, []

    def with_lock():
        with lock:
            pass

    def with_rlock():
        with rlock:
            pass

    def push_pop():
        lst.append(1)
        lst.pop()

    def set_field():
        req.x = 5

    table = {
        "empty_call": lambda: None,
        "py_call": lambda: _f(1, 2),
        "slots_attr": lambda: s.a,
        "dict_get": lambda: d.get("k"),
        "list_push_pop": push_pop,
        "dataclass_new": lambda: _Slots(3, 4),
        "tuple_new": lambda: (1, 2, 3, 4, 5),
        "isinstance": lambda: isinstance(s, _Slots),
        "perf_counter": time.perf_counter,
        "thread_time": time.thread_time,
        "lock_cycle": with_lock,
        "rlock_cycle": with_rlock,
        "np_ascontig": lambda: np.ascontiguousarray(arr, np.int64),
        "np_len": lambda: len(arr),
        "np_index": lambda: arr[3],
        "np_sum_small": lambda: arr[:8].sum(),
        "ctypes_field_set": set_field,
        "ctypes_call": getpid,
        "ctypes_addressof": lambda: ctypes.addressof(req),
    }
    try:
        import torch

        table["torch_tensor_data_ptr"] = (lambda t: (lambda: t.data_ptr()))(torch.zeros(4))
        if torch.cuda.is_available():
            ev, st = torch.cuda.Event(enable_timing=True), torch.cuda.Stream()
            ev.record(st)
            st.synchronize()
            dev = torch.cuda.current_device()
            table.update({
                "cuda_get_device": torch._C._cuda_getDevice,
                "cuda_raw_current_stream": lambda: torch._C._cuda_getCurrentRawStream(dev),
                "cuda_current_stream": torch.cuda.current_stream,
                "cuda_event_query_done": ev.query,
                "cuda_event_handle": lambda: ev.cuda_event,
                "cuda_event_elapsed": lambda: ev.elapsed_time(ev),
                "cuda_stream_query": st.query,
            })
    except ImportError:
        pass
    return table


def measure(fn, inner: int, samples: int) -> float:
    """ns per call of ``fn`` in a loop of ``inner``, median of ``samples``."""
    rng = range(inner)
    ts = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in rng:
            fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) / inner * 1e9


def host() -> dict:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    try:
        with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
            clock = f.read().strip()
    except OSError:
        clock = "?"
    return {"cpu": model, "python": sys.version.split()[0], "implementation": pyplatform.python_implementation(),
            "numpy": np.__version__, "clocksource": clock, "gil": getattr(sys, "_is_gil_enabled", lambda: True)()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inner", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=31)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    table = ops()
    res = {"host": host(), "ns": {}}
    for name, fn in table.items():
        res["ns"][name] = measure(fn, a.inner, a.samples)
    base = res["ns"]["empty_call"]
    print(", ".join(f"{k} {v}" for k, v in res["host"].items()))
    print(f"{'op':26s} {'ns/op':>9s} {'less empty call':>16s}")
    for name, ns in res["ns"].items():
        print(f"{name:26s} {ns:9.1f} {ns - base:16.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
