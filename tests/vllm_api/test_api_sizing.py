"""Host sizing of both connectors at real model shapes on the installed vLLM release (see
tests/support/sizing_matrix.py). Before 0.26 each layer (or layer pair of a hybrid model) is its own KV
tensor, which is where the Simple connector once sized host blocks by one layer's bytes
(16 GiB -> 512 GiB at 32 layers); from 0.26 layers are placed in one allocation."""

import pytest

vllm = pytest.importorskip("vllm")

import sizing_matrix as sm  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return sm.tp8_model_dir(tiny_model, tmp_path_factory.mktemp("tp8") / "model")


@pytest.mark.parametrize("name,tp", sm.CASES, ids=sm.CASE_IDS)
def test_simple_connector_host_holds_the_schedulers_blocks_within_the_share(model_dir, name, tp):
    sm.check_simple(model_dir, name, tp, "per-layer")  # cross-layer: tests/integration/test_sizing_matrix.py (>= 0.26)


@pytest.mark.parametrize("layout", sm.LAYOUTS)
@pytest.mark.parametrize("name,tp", sm.CASES, ids=sm.CASE_IDS)
def test_spec_host_holds_its_chunks_within_the_share(model_dir, name, tp, layout):
    sm.check_spec(model_dir, name, tp, layout)
