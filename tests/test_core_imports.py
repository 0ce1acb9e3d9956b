"""The core must import with torch and numpy alone (the GPU bench machine has no vLLM)."""

import subprocess
import sys

from vllm_npu_offload import CORE_MODULES


def test_core_imports_without_vllm():
    code = (
        "import sys, importlib\n"
        "sys.modules['vllm'] = None  # any 'import vllm' now raises ImportError\n"
        f"for m in {list(CORE_MODULES)!r}: importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('vllm', 'transformers'))\n"
        "assert bad == ['vllm'], bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
