"""NUMA placement: the device's node from sysfs, the forced node, single-node machines."""

import os

import pytest
import torch

from vllm_npu_offload import numa


def test_sysfs_parsing(tmp_path):
    nodes = tmp_path / "node"
    for n in ("node0", "node1", "possible", "has_cpu"):
        (nodes / n).mkdir(parents=True)
    assert numa.num_nodes(nodes) == 2
    pci = tmp_path / "pci"
    (pci / "0000:3b:00.0").mkdir(parents=True)
    (pci / "0000:3b:00.0" / "numa_node").write_text("1\n")
    (pci / "0000:5e:00.0").mkdir(parents=True)
    (pci / "0000:5e:00.0" / "numa_node").write_text("-1\n")
    assert numa.pci_numa_node("0000:3B:00.0", pci) == 1
    assert numa.pci_numa_node("3b:00.0", pci) == 1  # domain added
    assert numa.pci_numa_node("0000:5e:00.0", pci) is None  # firmware did not say
    assert numa.pci_numa_node("0000:99:00.0", pci) is None
    assert numa.num_nodes(tmp_path / "missing") == 1


def test_single_node_does_nothing(monkeypatch):
    monkeypatch.setattr(numa, "num_nodes", lambda root=None: 1)
    p = numa.place(0, 4096, "cuda")
    assert (p.nodes, p.node, p.bound) == (1, None, False) and "single NUMA node" in p.describe()


def test_forced_node_binds_before_first_touch(monkeypatch):
    monkeypatch.setattr(numa, "num_nodes", lambda root=None: 2)
    calls = []
    monkeypatch.setattr(numa, "mbind", lambda addr, n, node: calls.append((addr, n, node)) or True)
    monkeypatch.setenv("NPU_OFFLOAD_NUMA_NODE", "1")
    t = torch.empty(1 << 20, dtype=torch.uint8)
    p = numa.place(t.data_ptr(), t.nbytes, "cpu")
    assert calls == [(t.data_ptr(), t.nbytes, 1)] and p.node == 1 and p.bound
    assert "NUMA node 1 of 2" in p.describe()
    monkeypatch.setenv("NPU_OFFLOAD_NUMA_NODE", "7")
    with pytest.raises(ValueError, match=r"NPU_OFFLOAD_NUMA_NODE='7'; allowed: 0..1"):
        numa.place(t.data_ptr(), t.nbytes, "cpu")


def test_unknown_device_node_is_reported(monkeypatch):
    monkeypatch.setattr(numa, "num_nodes", lambda root=None: 2)
    monkeypatch.delenv("NPU_OFFLOAD_NUMA_NODE", raising=False)
    p = numa.place(0, 4096, "cpu")
    assert p.node is None and not p.bound and "device node unknown" in p.describe()


def test_mbind_to_node0_on_this_machine():
    """Node 0 always exists; binding a fresh page-aligned buffer to it must succeed."""
    t = torch.empty(1 << 22, dtype=torch.uint8)
    assert numa.mbind(t.data_ptr(), t.nbytes, 0)


def test_page_nodes_reports_resident_pages_only():
    import torch

    from vllm_npu_offload.numa import page_nodes

    touched = torch.zeros(1 << 24, dtype=torch.uint8)  # zeroed: every page resident
    got = page_nodes(touched.data_ptr(), touched.numel(), samples=32)
    assert sum(got.values()) == 32 and -1 not in got and all(node >= 0 for node in got)
    import ctypes
    import mmap

    fresh = mmap.mmap(-1, 1 << 26)  # a new anonymous mapping: never touched, so no page has a node yet
    fresh[0] = 1  # but the first one now has
    addr = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    got = page_nodes(addr, len(fresh), samples=16)
    assert sum(got.values()) == 16 and got.get(-1, 0) == 15 and -1 in got
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-touched.data_ptr() // page) * page  # 100 bytes inside one page (the buffer may start late in one)
    assert sum(page_nodes(start, 100, samples=64).values()) == 1  # one page: one sample
    assert sum(page_nodes(start + page - 50, 100, samples=64).values()) == 2  # across a boundary: two


def _two_nodes(monkeypatch, affinity, bus=None, bus_node=None):
    """A 2-node machine, CPUs 0-3 on node 0 and 4-7 on node 1; this thread may run on ``affinity``."""
    monkeypatch.setattr(numa, "num_nodes", lambda root=None: 2)
    monkeypatch.setattr(numa, "node_cpus", lambda root=None: {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}})
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(numa, "device_bus_id", lambda kind: bus)
    monkeypatch.setattr(numa, "pci_numa_node", lambda b, root=None: bus_node)
    monkeypatch.delenv("NPU_OFFLOAD_NUMA_NODE", raising=False)


def test_cpulists_and_the_node_that_holds_every_cpu(tmp_path):
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and numa.parse_cpulist("\n") == set()
    for name, cpus in (("node0", "0-3,8-11"), ("node1", "4-7,12-15"), ("node2", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node3").mkdir()  # no cpulist: left out
    (tmp_path / "possible").write_text("0-3\n")
    by_node = numa.node_cpus(tmp_path)
    assert by_node == {0: {0, 1, 2, 3, 8, 9, 10, 11}, 1: {4, 5, 6, 7, 12, 13, 14, 15}, 2: set()}
    assert numa.node_cpus(tmp_path / "missing") == {}
    assert numa.affinity_node({12, 13}, by_node) == 1 and numa.affinity_node({0, 11}, by_node) == 0
    assert numa.affinity_node({3, 4}, by_node) is None  # spans two nodes
    assert numa.affinity_node({99}, by_node) is None  # a CPU no node lists
    assert numa.affinity_node({0, 99}, by_node) is None  # partly unknown: not all on node 0
    assert numa.affinity_node(set(range(16)), {}) is None


def test_npu_host_kv_goes_to_the_node_of_the_workers_cpus(monkeypatch):
    """Ascend: no bus id here; vLLM-Ascend binds each worker to its NPU's CPUs, so their node is the NPU's."""
    _two_nodes(monkeypatch, affinity={5, 6})
    calls = []
    monkeypatch.setattr(numa, "mbind", lambda addr, n, node: calls.append((addr, n, node)) or True)
    p = numa.place(4096, 8192, "npu")
    assert calls == [(4096, 8192, 1)] and (p.node, p.bound) == (1, True)
    assert p.describe() == "NUMA node 1 of 2 (this thread's CPUs are all on node 1; no sysfs node for npu device ?)"
    _two_nodes(monkeypatch, affinity=range(8))  # not bound: nothing to go by, nothing bound
    calls.clear()
    p = numa.place(4096, 8192, "npu")
    assert calls == [] and p.node is None and "this thread's CPUs span nodes" in p.describe()
    assert "left to first touch" in p.describe()


def test_the_devices_sysfs_node_wins_over_the_cpus(monkeypatch):
    _two_nodes(monkeypatch, affinity={5}, bus="0000:3b:00.0", bus_node=0)
    assert numa.device_node("cuda") == (0, "sysfs, device 0000:3b:00.0")
    _two_nodes(monkeypatch, affinity={5}, bus="0000:3b:00.0", bus_node=None)  # firmware says -1
    assert numa.device_node("cuda") == (1, "this thread's CPUs are all on node 1; no sysfs node for cuda device "
                                           "0000:3b:00.0")
    _two_nodes(monkeypatch, affinity={5})
    assert numa.device_node("cpu") == (None, "no sysfs node for cpu device ?")  # host "device": no stand-in


def test_info_line_names_the_node_and_how_it_was_found(monkeypatch):
    from vllm_npu_offload import info, platform

    monkeypatch.setattr(platform, "detect_kind", lambda: "npu")
    _two_nodes(monkeypatch, affinity={1, 2})
    line = info._numa()
    assert line == "2 nodes; device on node 0 (this thread's CPUs are all on node 0; no sysfs node for npu device ?; " \
                   "host KV bound there)"
    _two_nodes(monkeypatch, affinity={1, 6})
    assert info._numa().startswith("2 nodes; device node unknown (") and "left to first touch" in info._numa()
