"""kv_connector_extra_config validation: errors name the key and what is allowed."""

import pytest

from vllm_npu_offload.errors import OffloadConfigError
from vllm_npu_offload.integration.options import resolve_cpu_bytes, validate_extra_config


def test_missing_size_names_both_keys():
    with pytest.raises(OffloadConfigError, match="'cpu_bytes_to_use'.*'num_cpu_blocks'"):
        validate_extra_config({})


@pytest.mark.parametrize("value", [0, -1, "abc", 1.5, True])
@pytest.mark.parametrize("key", ["cpu_bytes_to_use", "num_cpu_blocks"])
def test_non_positive_sizes(key, value):
    with pytest.raises(OffloadConfigError, match=rf"\['{key}'\]=.*must be a positive integer"):
        validate_extra_config({key: value})


def test_block_size_must_be_multiple_of_engine_block():
    with pytest.raises(OffloadConfigError, match=r"\['block_size'\]=40 must be a multiple of the engine KV block size \(16 tokens\), e.g. 48"):
        validate_extra_config({"cpu_bytes_to_use": 1 << 20, "block_size": 40}, engine_block_size=16)
    assert validate_extra_config({"cpu_bytes_to_use": 1 << 20, "block_size": 64}, 16).blocks_per_chunk == 4


def test_unknown_eviction_policy():
    with pytest.raises(OffloadConfigError, match=r"\['eviction_policy'\]='fifo' is not one of \('lru', 'arc'\)"):
        validate_extra_config({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "fifo"})
    opts = validate_extra_config({"cpu_bytes_to_use": 1, "eviction_policy": "mine", "cache_policy_module_path": "x.y"})
    assert opts.eviction_policy == "mine"


def test_conflicting_keys():
    with pytest.raises(OffloadConfigError, match="both 'cpu_bytes_to_use'"):
        validate_extra_config({"cpu_bytes_to_use": 1, "num_cpu_blocks": 1})
    with pytest.raises(OffloadConfigError, match="only one of 'block_size' and 'blocks_per_chunk'"):
        validate_extra_config({"cpu_bytes_to_use": 1, "block_size": 32, "blocks_per_chunk": 2})


def test_too_small_for_one_block_and_legacy_conversion():
    opts = validate_extra_config({"cpu_bytes_to_use": 1000})
    with pytest.raises(OffloadConfigError, match="smaller than one offloaded block \\(4096 bytes.*use at least 4096"):
        resolve_cpu_bytes(opts, 4000, alignment=4096)
    legacy = validate_extra_config({"num_cpu_blocks": 1000})
    assert resolve_cpu_bytes(legacy, 4000, alignment=4096) == 1000 * 4096
    assert resolve_cpu_bytes(legacy, 4096, alignment=1) == 1000 * 4096


def test_unknown_key_suggests_the_nearest_known_key(monkeypatch):
    from vllm_npu_offload.integration.options import ALLOW_UNKNOWN_ENV, SPEC_KEYS, reject_unknown_keys

    reject_unknown_keys({"cpu_bytes_to_use": 1, "staging_bytes": 2}, SPEC_KEYS, "X")
    with pytest.raises(OffloadConfigError, match=r"an unknown key for X: 'blocks_per_chunck' \(did you mean "
                                                 r"'blocks_per_chunk'\?\)\. Known keys: block_size, "):
        reject_unknown_keys({"blocks_per_chunck": 2}, SPEC_KEYS, "X")
    monkeypatch.setenv(ALLOW_UNKNOWN_ENV, "1")
    reject_unknown_keys({"blocks_per_chunck": 2}, SPEC_KEYS, "X")  # a warning only


def test_staging_bytes_must_be_a_positive_integer():
    validate_extra_config({"cpu_bytes_to_use": 1, "staging_bytes": 4096})
    with pytest.raises(OffloadConfigError, match=r"\['staging_bytes'\]=-4096 must be a positive integer"):
        validate_extra_config({"cpu_bytes_to_use": 1, "staging_bytes": -4096})


def test_simple_options_name_the_size_key():
    from vllm_npu_offload.integration.options import SimpleOptions, validate_simple_extra_config

    assert validate_simple_extra_config({}) == SimpleOptions("cpu_bytes_to_use", None)
    both = {"cpu_bytes_to_use": 8, "cpu_bytes_to_use_per_rank": 4, "staging_bytes": 2}
    assert validate_simple_extra_config(both) == SimpleOptions("cpu_bytes_to_use_per_rank", 4)
    with pytest.raises(OffloadConfigError, match=r"\['cpu_bytes_to_use_per_rank'\]=0 must be a positive"):
        validate_simple_extra_config({"cpu_bytes_to_use_per_rank": 0})
