"""The start-up version check: a vLLM outside the supported range fails when any of our vLLM-facing
modules is imported, with one error naming the installed version and the supported range, never a
traceback from inside vLLM. scripts/dev/version_matrix.sh runs this file in every release's venv
(vLLM 0.18.0 included, which is refused for real); here an old version is also faked."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ("spec", "connector", "simple_connector")  # what vLLM imports from kv_connector(_extra)_config
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _versions():
    """integration/versions.py itself (vLLM-free), loaded without the package's start-up check."""
    spec = importlib.util.spec_from_file_location("_npu_versions", ROOT / "vllm_npu_offload/integration/versions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("version", ["0.18.0", "0.20.2", "0.20.2+cpu", "0.11.0rc1"])
def test_old_versions_are_refused_by_name(version):
    v = _versions()
    with pytest.raises(v.UnsupportedVLLMVersion) as err:
        v.check_vllm_version(version)
    msg = str(err.value)
    assert f"the installed vLLM {version}:" in msg and v.SUPPORTED_RANGE in msg
    assert "vLLM >= 0.21.0" in msg


@pytest.mark.parametrize("version, verdict", [
    ("0.21.0", "tested"), ("0.23.0+cpu", "tested"), ("0.27.1", "tested"), ("0.33.0", "tested"),
    ("0.33.2", "tested"), ("0.34.0", "untested"), ("1.0.0.dev3+g12ab", "untested"), ("dev", "untested"),
])
def test_supported_and_newer_versions_pass(version, verdict):
    assert _versions().check_vllm_version(version) == verdict


IMPORT_EACH = textwrap.dedent("""
    import json, sys, traceback
    import vllm
    out = {}
    for fake in (None, FAKE):  # the installed version, then an old one faked on the same vllm
        if fake:
            vllm.__version__ = fake
        res = out["fake" if fake else "real"] = {}
        for name in MODULES:
            for m in [m for m in sys.modules if m.startswith("vllm_npu_offload.integration")]:
                del sys.modules[m]
            try:
                __import__("vllm_npu_offload.integration." + name)
                res[name] = None
            except Exception as e:
                frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
                res[name] = [type(e).__name__, str(e), [f for f in frames if "/site-packages/vllm/" in f]]
    print("RESULT " + json.dumps(out))
""")
FAKE = "0.20.2"


@pytest.fixture(scope="module")
def imported() -> dict:
    """Each module imported in a fresh interpreter on the installed vLLM, then with FAKE as its version."""
    code = f"FAKE = {FAKE!r}\nMODULES = {MODULES!r}\n" + IMPORT_EACH
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "VLLM_PLUGINS": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT "):])


def assert_refused(result: dict, version: str) -> None:
    for name, got in result.items():
        assert got is not None, f"{name} imported on vLLM {version}"
        kind, msg, vllm_frames = got
        assert kind == "UnsupportedVLLMVersion", (name, kind, msg)
        assert f"the installed vLLM {version}:" in msg and "vLLM >= 0.21.0" in msg
        assert vllm_frames == [], f"{name}: the error passed through vLLM's code: {vllm_frames}"


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_installed_vllm_is_checked_at_import(imported):
    """On a supported vLLM all three modules import; on an older one (0.18.0 in the matrix) each
    one raises our error before anything inside vLLM runs."""
    import vllm

    if _versions()._release(vllm.__version__) < (0, 21, 0):
        assert_refused(imported["real"], vllm.__version__)
    else:
        assert imported["real"] == {name: None for name in MODULES}


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_faked_old_vllm_is_refused_at_import(imported):
    assert_refused(imported["fake"], FAKE)
