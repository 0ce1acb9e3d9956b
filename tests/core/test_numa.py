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
