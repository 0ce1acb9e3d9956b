"""Smoke test of the transfer benchmark on the CPU platform (host path only)."""

from vllm_npu_offload.bench.transfer import ModelConfig, bench_config, format_config
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
