"""The core must import with torch, numpy and crc32c alone (the GPU bench machine has no vLLM): every
module of the package except the adapters (``integration``), the demo and ``__main__``."""

import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "vllm_npu_offload"
ADAPTERS = ("integration", "demo", "__main__")


def core_modules() -> list[str]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("").parts
        if rel[0] in ADAPTERS:
            continue
        out.append(".".join(("vllm_npu_offload",) + (rel[:-1] if rel[-1] == "__init__" else rel)))
    return out


def test_core_module_list_is_derived():
    mods = core_modules()
    assert "vllm_npu_offload.offload_worker" in mods and "vllm_npu_offload._native.cuda" in mods
    assert not any(".integration" in m for m in mods)


def test_core_imports_without_vllm():
    code = (
        "import sys, importlib\n"
        "sys.modules['vllm'] = None  # any 'import vllm' now raises ImportError\n"
        f"for m in {core_modules()!r}: importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('vllm', 'transformers'))\n"
        "assert bad == ['vllm'], bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
