"""NUMA placement of the host KV buffer: the node closest to the device.

Why: on a two-socket server, host KV on the far node crosses the socket link on every
transfer (measured elsewhere at 20-40% of PCIe bandwidth lost). The node of a PCI
device is in ``/sys/bus/pci/devices/<bus id>/numa_node``; memory is bound to it with
``mbind`` before first touch, so every page lands there. Where the device's bus id is
not known here (Ascend: torch_npu does not expose it), the node that holds every CPU the
worker thread may run on stands in: vLLM-Ascend binds each worker to its NPU's CPUs by
default on ARM hosts (``enable_cpu_binding``), as do numactl-style launchers. Single-node
machines (and devices whose node neither tells) are left alone and say so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from . import env

logger = logging.getLogger(__name__)

SYSFS_NODES = Path("/sys/devices/system/node")
SYSFS_PCI = Path("/sys/bus/pci/devices")
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_BIND = 2
_MPOL_MF_MOVE = 2


@dataclass(frozen=True)
class NumaPlacement:
    """Where the host KV buffer was put, for the start-up log and ``info``."""

    nodes: int  # NUMA nodes on this machine
    node: int | None  # the device's node, None when unknown or single-node
    bound: bool  # mbind succeeded
    why: str  # one phrase: how the node was found or why nothing was done

    def describe(self) -> str:
        if self.nodes <= 1:
            return "single NUMA node (nothing to place)"
        if self.node is None:
            return f"{self.nodes} NUMA nodes, device node unknown ({self.why}); left to first touch"
        return f"NUMA node {self.node} of {self.nodes} ({self.why}){'' if self.bound else ', mbind failed'}"


def num_nodes(root: Path = SYSFS_NODES) -> int:
    try:
        return max(1, sum(1 for p in root.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()))
    except OSError:
        return 1


def pci_numa_node(bus_id: str, root: Path = SYSFS_PCI) -> int | None:
    """The node sysfs reports for a PCI bus id (``0000:3b:00.0``); None when unknown (-1)."""
    bus_id = bus_id.lower()
    if bus_id.count(":") == 1:
        bus_id = "0000:" + bus_id
    try:
        node = int((root / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def device_bus_id(kind: str) -> str | None:
    """PCI bus id of the current device (CUDA); None where torch does not expose it."""
    if kind != "cuda":
        return None
    try:
        import torch

        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001 - older torch: no PCI ids
        return None


def parse_cpulist(text: str) -> set[int]:
    """CPU ids of a sysfs cpulist ("0-3,8,10-11"; empty: none)."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus(root: Path = SYSFS_NODES) -> dict[int, set[int]]:
    """Node -> its CPUs, from ``nodeN/cpulist`` (empty where sysfs does not say)."""
    out: dict[int, set[int]] = {}
    try:
        for p in root.iterdir():
            if p.name.startswith("node") and p.name[4:].isdigit():
                try:
                    out[int(p.name[4:])] = parse_cpulist((p / "cpulist").read_text())
                except (OSError, ValueError):
                    continue
    except OSError:
        pass
    return out


def affinity_node(cpus: set[int], by_node: dict[int, set[int]]) -> int | None:
    """The one node that holds every CPU of ``cpus``; None when they span nodes or none is known."""
    homes = {n for n, have in by_node.items() if have & cpus}
    if len(homes) != 1:
        return None
    (node,) = homes
    return node if cpus <= by_node[node] else None


def device_node(kind: str) -> tuple[int | None, str]:
    """The node closest to the current ``kind`` device and one phrase on how it was found: sysfs for
    the device's PCI bus id (CUDA); else, for an accelerator, the node holding every CPU this thread
    may run on; else None."""
    bus = device_bus_id(kind)
    node = pci_numa_node(bus) if bus else None
    if node is not None:
        return node, f"sysfs, device {bus}"
    unknown = f"no sysfs node for {kind} device {bus or '?'}"
    if kind == "cpu":
        return None, unknown
    node = affinity_node(os.sched_getaffinity(0), node_cpus())
    if node is None:
        return None, f"{unknown}, and this thread's CPUs span nodes"
    return node, f"this thread's CPUs are all on node {node}; {unknown}"


def mbind(addr: int, nbytes: int, node: int) -> bool:
    """Bind ``[addr, addr + nbytes)`` (page aligned inside) to ``node`` before first touch."""
    nr = _SYS_MBIND.get(os.uname().machine)
    if nr is None or nbytes <= 0:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    start = (addr + page - 1) // page * page
    length = (addr + nbytes) // page * page - start
    if length <= 0:
        return False
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    rc = libc.syscall(nr, ctypes.c_void_p(start), ctypes.c_ulong(length), _MPOL_BIND, mask,
                      ctypes.c_ulong(64 * len(mask) + 1), _MPOL_MF_MOVE)
    if rc != 0:
        logger.warning("mbind to NUMA node %d failed: %s", node, os.strerror(ctypes.get_errno()))
    return rc == 0


_SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}


def page_nodes(addr: int, nbytes: int, samples: int = 64) -> dict[int, int]:
    """NUMA node -> how many of ``samples`` pages spread over ``[addr, addr + nbytes)`` are resident
    there, asked of the kernel (``move_pages`` in query mode: nothing moves). Verifies a placement
    rather than trusting the mbind that made it. Node -1: the kernel could not say (not resident,
    or the syscall is unavailable on this machine)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = addr // page, (addr + max(nbytes, 1) - 1) // page
    n = max(1, min(samples, last - first + 1))
    pages = [(first + i * (last - first) // max(n - 1, 1)) * page for i in range(n)]
    nr = _SYS_MOVE_PAGES.get(os.uname().machine)
    if nr is None:
        return {-1: n}
    ptrs, status = (ctypes.c_void_p * n)(*pages), (ctypes.c_int * n)()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.syscall(nr, 0, ctypes.c_ulong(n), ptrs, None, status, 0) != 0:
        return {-1: n}
    out: dict[int, int] = {}
    for s in status:
        out[s if s >= 0 else -1] = out.get(s if s >= 0 else -1, 0) + 1
    return out


def place(addr: int, nbytes: int, kind: str) -> NumaPlacement:
    """Bind host memory to the device's node where there is a choice; never raises."""
    nodes = num_nodes()
    if nodes <= 1:
        return NumaPlacement(nodes, None, False, "single node")
    forced = env.get("NPU_OFFLOAD_NUMA_NODE")
    if forced is not None:
        if forced >= nodes:
            raise ValueError(f"NPU_OFFLOAD_NUMA_NODE={str(forced)!r}; allowed: 0..{nodes - 1}")
        node, why = forced, "NPU_OFFLOAD_NUMA_NODE"
    else:
        node, why = device_node(kind)
        if node is None:
            return NumaPlacement(nodes, None, False, why)
    return NumaPlacement(nodes, node, mbind(addr, nbytes, node), why)
