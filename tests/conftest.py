"""Tests mirror the package: core/ (worker core, engine, planning, device KV, env), native/ (the C
libraries and their copy paths), integration/ (connectors and spec in a vLLM engine or config),
vllm_api/ (each vLLM release's own scheduler and connectors), bench/ (benchmark code), demo/.
Shared fakes and rigs live in support/, which is put on sys.path here."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from vllm_npu_offload.demo.tiny_model import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama"))
