"""Host sizing of both connectors at real model shapes on vLLM 0.23 (the API vLLM-Ascend 0.23
pairs with): one KV tensor per layer (or per layer pair of a hybrid model), which is where the
Simple connector once sized host blocks by one layer's bytes (16 GiB -> 512 GiB at 32 layers)."""

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.23"):
    pytest.skip(f"needs vLLM 0.23 (installed: {vllm.__version__})", allow_module_level=True)

import sizing_matrix as sm  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return sm.tp8_model_dir(tiny_model, tmp_path_factory.mktemp("tp8") / "model")


@pytest.mark.parametrize("name,tp", sm.CASES, ids=sm.CASE_IDS)
def test_simple_connector_host_holds_the_schedulers_blocks_within_the_share(model_dir, name, tp):
    sm.check_simple(model_dir, name, tp, "per-layer")  # 0.23's simple connector has no cross-layer blocks


@pytest.mark.parametrize("layout", sm.LAYOUTS)
@pytest.mark.parametrize("name,tp", sm.CASES, ids=sm.CASE_IDS)
def test_spec_host_holds_its_chunks_within_the_share(model_dir, name, tp, layout):
    sm.check_spec(model_dir, name, tp, layout)
