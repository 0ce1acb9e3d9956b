"""Run-time environment variables: one list (env.py), one parser, errors that name the variable,
the value and what is allowed, and no other module of the package reading os.environ for them."""

import re
from pathlib import Path

import pytest

from vllm_npu_offload import env
from vllm_npu_offload.info import format_info

PKG = Path(__file__).resolve().parents[2] / "vllm_npu_offload"


def test_only_what_users_and_operators_set():
    """Run-time variables are for users and operators, at most ten; a tuning value or an A/B switch
    is a constant (or a constructor argument) in the module that uses it."""
    assert list(env.KNOBS) == [
        "NPU_OFFLOAD_COPY_PATH", "NPU_OFFLOAD_STAGED", "NPU_OFFLOAD_STAGED_STORES", "NPU_OFFLOAD_CALIBRATE",
        "NPU_OFFLOAD_CACHE_DIR", "NPU_OFFLOAD_NUMA_NODE", "NPU_OFFLOAD_NATIVE_DIR", "NPU_OFFLOAD_ALLOW_UNKNOWN_KEYS",
        "NPU_OFFLOAD_FAULTS", "NPU_OFFLOAD_DEVICE"]
    for k in env.KNOBS.values():  # what it does, then (after the last colon) why one would set it
        assert "\n" not in k.meaning and ": " in k.meaning, k.name


@pytest.mark.parametrize("name, raw, value", [
    ("NPU_OFFLOAD_STAGED", "1", True), ("NPU_OFFLOAD_STAGED", "0", False), ("NPU_OFFLOAD_STAGED", "", None),
    ("NPU_OFFLOAD_CALIBRATE", "", True), ("NPU_OFFLOAD_NUMA_NODE", "4", 4),
    ("NPU_OFFLOAD_ALLOW_UNKNOWN_KEYS", "", False), ("NPU_OFFLOAD_COPY_PATH", "dma", "dma"),
    ("NPU_OFFLOAD_DEVICE", " cpu ", "cpu"),
    ("NPU_OFFLOAD_FAULTS", "", None), ("NPU_OFFLOAD_FAULTS", "load=0.5, disk_corrupt=1", {"load": 0.5, "disk_corrupt": 1.0}),
])
def test_values(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert env.get(name) == value


FAULTS_ALLOWED = ("KIND=PROBABILITY[,KIND=PROBABILITY...] with KIND in load, store, disk_read, disk_corrupt, "
                  "disk_write and 0 <= PROBABILITY <= 1")


@pytest.mark.parametrize("name, raw, allowed", [
    ("NPU_OFFLOAD_STAGED", "yes", "0 or 1"),
    ("NPU_OFFLOAD_NUMA_NODE", "-1", "an integer >= 0"),
    ("NPU_OFFLOAD_NUMA_NODE", "near", "an integer >= 0"),
    ("NPU_OFFLOAD_FAULTS", "lod=0.5", FAULTS_ALLOWED), ("NPU_OFFLOAD_FAULTS", "load=2", FAULTS_ALLOWED),
    ("NPU_OFFLOAD_FAULTS", "load", FAULTS_ALLOWED),
    ("NPU_OFFLOAD_COPY_PATH", "warp", "host, dma, dma_loop, sm, gather_native, acl_batch, acl_loop"),
    ("NPU_OFFLOAD_DEVICE", "tpu", "npu, cuda, cpu"),
])
def test_bad_values_name_variable_value_and_allowed(monkeypatch, name, raw, allowed):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r}; allowed: {allowed}")):
        env.get(name)


def test_no_module_reads_its_own_variable():
    """Every NPU_OFFLOAD_* variable read at run time goes through env.get (build scripts aside)."""
    for p in PKG.rglob("*.py"):
        if p.name == "env.py" or "bench" in p.parts or "demo" in p.parts:
            continue
        text = p.read_text()
        assert not re.search(r"(os\.environ|getenv)[^\n]*NPU_OFFLOAD_", text), p
    used = set()
    for p in PKG.rglob("*.py"):
        used |= set(re.findall(r"env\.get\(\s*[\"'](NPU_OFFLOAD_[A-Z_]+)", p.read_text()))
    assert used and used <= set(env.KNOBS), used - set(env.KNOBS)


def test_info_lists_every_variable(monkeypatch):
    monkeypatch.setenv("NPU_OFFLOAD_NUMA_NODE", "-3")
    text = format_info()
    for name in env.KNOBS:
        assert name in text
    assert "INVALID (NPU_OFFLOAD_NUMA_NODE='-3'" in text  # a bad value shows, info does not fail
