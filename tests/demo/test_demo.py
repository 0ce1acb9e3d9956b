"""The demo as a newcomer runs it: progress lines, the table and a verdict, no log noise."""

import os
import re
import subprocess
import sys

import pytest

from vllm_npu_offload.demo.run import TurnRow, verdict


def test_verdict_lines():
    good = [TurnRow(1, 64, 32, 4096, 1.0, 1.0, 1.0, True), TurnRow(2, 96, 64, 8192, 1.0, 1.0, 1.0, True)]
    assert verdict(good, 12.34) == (True, "PASS: outputs equal to the offload-off run in all 2 turns; 96 prompt "
                                          "tokens (12288 bytes) served from host memory; wall 12.3 s")
    bad = [good[0], TurnRow(2, 96, 64, 8192, 1.0, 1.0, 1.0, False)]
    assert verdict(bad, 1.0) == (False, "FAIL: turn(s) [2] differ from the offload-off run (1.0 s)")
    cold = [TurnRow(1, 64, 0, 0, 0.0, 1.0, 1.0, True)]
    assert verdict(cold, 1.0)[0] is False and "no token was served from host" in verdict(cold, 1.0)[1]


@pytest.mark.vllm
def test_demo_is_quiet(tmp_path):
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "PYTHONWARNINGS"))}
    env["NPU_OFFLOAD_CACHE"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "vllm_npu_offload.demo", "--turns", "2", "--system-words", "80", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    phases = [ln for ln in lines if re.match(r"\[ *\d+\.\d s\] ", ln)]
    assert [p.split("] ", 1)[1].split(":")[0] for p in phases] == [
        "building the tiny random-weight Llama and its tokenizer (offline, no model hub)",
        "offload off", "offload on, round 1", "offload on, round 2",
    ]
    rest = [ln for ln in lines if ln not in phases and ln]
    assert rest[0].startswith("turn prompt tok") and set(rest[1]) == {"-"}
    assert len(rest) == 2 + 2 + 2, rest  # head, rule, 2 turns, store bandwidth, verdict
    assert rest[-2].startswith("store bandwidth over round 1:")
    assert rest[-1].startswith("PASS: outputs equal to the offload-off run in all 2 turns;")
    assert out.stderr.strip() == "", out.stderr[-3000:]
