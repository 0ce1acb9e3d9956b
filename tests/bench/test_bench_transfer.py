"""Smoke test of the transfer benchmark on the CPU platform (host path only)."""

import pytest

from benchmarks.transfer import ModelConfig, bench_config, format_config
from vllm_npu_offload.platform import get_platform


def test_bench_config_cpu_smoke():
    cfg = ModelConfig("tiny", layers=2, kv_heads=1, head_dim=16, blocks=4)
    res = bench_config(get_platform("cpu"), cfg, reps=1)
    for d in ("H2D", "D2H"):
        row = res["directions"][d]
        assert row["descriptors"] == 4 * cfg.tensors and row["chosen"] == "host"
        assert set(row["gbps"]) == {"host", "chosen", "contiguous"} and not row["errors"]
    assert res["plan_us_per_10k"] > 0
    assert "tiny" in format_config(res)


def test_stall_probe_table_and_cpu_refusal():
    from benchmarks import stall

    rows = [{"compute": "default", "alone_ms": 3.0, "staged_ms": 3.2, "staged_xfer_ms": 20.0},
            {"compute": "pool0", "alone_ms": 3.0, "staged_ms": 22.0, "staged_xfer_ms": 20.0}]
    res = [{"label": "torch_pool", "shape": "llama-8b", "jobs": 1, "direction": "D2H", "bytes": 2**30,
            "burst": "b", "paths": {"direct": "dma"}, "aliased": ["pool0"], "rows": rows},
           {"label": "sm", "error": "Traceback\nRuntimeError: boom"}]
    text = stall.format_results(res)
    assert "worst  22.00 ms on pool0" in text and "['pool0']" in text and "[sm] error: RuntimeError: boom" in text
    with pytest.raises(RuntimeError, match="needs a CUDA device, found cpu"):
        stall.measure()
