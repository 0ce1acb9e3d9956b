"""host_limits on fake /proc and /sys/fs/cgroup trees, a fake RLIMIT_MEMLOCK, and this machine."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from vllm_npu_offload import host_limits as hl
from vllm_npu_offload.errors import OffloadConfigError

GiB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """An empty /proc and cgroup mount; tests fill in what they need."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cg.mkdir()
    monkeypatch.setattr(hl, "PROC", proc)
    monkeypatch.setattr(hl, "CGROUP", cg)
    return proc, cg


def meminfo(proc: Path, avail_kib: int) -> None:
    write(proc / "meminfo", f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {avail_kib} kB\n")


def test_nothing_readable_means_no_number_and_no_error(fake):
    assert hl.meminfo_available() is None and hl.cgroup_limit() is None and hl.host_memory() is None
    hl.check_host_allocation(10 << 40, "cpu_bytes_to_use", 10 << 40)  # cannot tell: passes


def test_meminfo_only(fake):
    proc, _ = fake
    meminfo(proc, 8 * 1024 * 1024)
    write(proc / "self" / "cgroup", "0::/\n")  # v2, but no limit file at the root
    assert hl.available_host_bytes() == 8 * GiB
    assert hl.host_memory().source.endswith("meminfo")


def test_cgroup_v2_limit_below_meminfo_counts_reclaimable_cache_as_free(fake):
    proc, cg = fake
    meminfo(proc, 64 * 1024 * 1024)
    write(proc / "self" / "cgroup", "0::/svc/worker\n")
    write(cg / "svc" / "memory.max", f"{4 * GiB}\n")
    write(cg / "svc" / "memory.current", f"{3 * GiB}\n")
    write(cg / "svc" / "memory.stat", f"anon 1\ninactive_file {GiB}\nactive_file 5\n")
    write(cg / "svc" / "worker" / "memory.max", "max\n")  # the leaf has no limit of its own
    lim = hl.cgroup_limit()
    assert (lim.limit, lim.used, lim.free) == (4 * GiB, 2 * GiB, 2 * GiB)
    mem = hl.host_memory()
    assert mem.available == 2 * GiB and "cgroup v2" in mem.source and str(cg / "svc" / "memory.max") in mem.source


def test_cgroup_v1_unlimited_is_ignored_and_container_root_is_used(fake):
    proc, cg = fake
    meminfo(proc, 64 * 1024 * 1024)
    # the path from /proc/self/cgroup is not under the mount (a container sees its own group there)
    write(proc / "self" / "cgroup", "5:cpu:/\n4:memory:/docker/abc\n0::/\n")
    write(cg / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert hl.cgroup_limit() is None
    write(cg / "memory" / "memory.limit_in_bytes", f"{6 * GiB}\n")
    write(cg / "memory" / "memory.usage_in_bytes", f"{2 * GiB}\n")
    write(cg / "memory" / "memory.stat", f"inactive_file 7\ntotal_inactive_file {GiB}\n")
    assert hl.available_host_bytes() == 5 * GiB


def test_cgroup_v1_tightest_of_leaf_and_parents(fake):
    proc, cg = fake
    meminfo(proc, 64 * 1024 * 1024)
    write(proc / "self" / "cgroup", "4:memory:/a/b\n")
    mem = cg / "memory"
    write(mem / "memory.limit_in_bytes", "9223372036854771712\n")
    write(mem / "a" / "memory.limit_in_bytes", f"{3 * GiB}\n")
    write(mem / "a" / "memory.usage_in_bytes", f"{GiB}\n")
    write(mem / "a" / "b" / "memory.limit_in_bytes", f"{10 * GiB}\n")
    write(mem / "a" / "b" / "memory.usage_in_bytes", f"{GiB}\n")
    assert hl.available_host_bytes() == 2 * GiB
    assert str(mem / "a" / "memory.limit_in_bytes") in hl.host_memory().source


def test_check_names_key_bytes_and_what_is_available(fake):
    proc, _ = fake
    meminfo(proc, 20 * 1024 * 1024)
    hl.check_host_allocation(20 * GiB, "cpu_bytes_to_use", 40 * GiB)  # fits exactly
    with pytest.raises(OffloadConfigError) as err:
        hl.check_host_allocation(10 << 40, "cpu_bytes_to_use", 20 << 40, "its share over 2 ranks")
    assert str(err.value) == (
        f"kv_connector_extra_config['cpu_bytes_to_use']={20 << 40}: this rank would allocate {10 << 40} bytes "
        f"(10.0 TiB) of host memory (its share over 2 ranks), but only {20 * GiB} bytes (20.0 GiB) are available "
        f"(MemAvailable in {proc / 'meminfo'}). Lower 'cpu_bytes_to_use' so that each rank's share fits, "
        "or free host memory."
    )
    with pytest.raises(OffloadConfigError, match=r"\['cpu_bytes_to_use'\] \(not set\): this rank would allocate"):
        hl.check_host_allocation(8 << 40, "cpu_bytes_to_use")


def test_pin_failure_hint_names_the_limit_and_how_to_raise_it(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 << 20, 8 << 20))
    assert hl.memlock_limit() == 8 << 20
    hint = hl.pin_failure_hint(3 * GiB)
    assert hint.startswith(f"could not page-lock {3 * GiB} host bytes (3.0 GiB); the locked-memory limit")
    assert f"is {8 << 20} bytes (8.0 MiB)" in hint
    for how in ("ulimit -l unlimited", "LimitMEMLOCK=infinity", "--ulimit memlock=-1:-1"):
        assert how in hint
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert hl.memlock_limit() is None
    assert "is unlimited, so the driver refused for another reason" in hl.pin_failure_hint(GiB)


def test_fmt_bytes():
    sizes = (512, 1536, 10 << 40, 5000 << 40)
    assert [hl.fmt_bytes(n) for n in sizes] == ["512 B", "1.5 KiB", "10.0 TiB", "5000.0 TiB"]


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="not Linux")
def test_this_machine():
    mem = hl.host_memory()
    assert mem is not None and 0 < mem.available < (1 << 50)
    with pytest.raises(OffloadConfigError, match="are available"):
        hl.check_host_allocation(1 << 50, "cpu_bytes_to_use", 1 << 50)
