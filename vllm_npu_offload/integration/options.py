"""Validation of ``kv_connector_extra_config`` for NPUOffloadingSpec.

Pure Python (no vLLM import) so it is tested directly. Keys keep upstream's meaning:

- ``cpu_bytes_to_use``: total host bytes for offloaded KV, summed over all tensor-
  parallel ranks (each rank allocates its share).
- ``num_cpu_blocks`` (legacy vLLM-Ascend key): number of offloaded blocks; converted to
  ``cpu_bytes_to_use = num_cpu_blocks * round_up(bytes_per_block_all_ranks *
  blocks_per_chunk, alignment)``, i.e. exactly that many blocks fit.
- ``block_size`` (tokens per offloaded block, a multiple of the engine block size) or
  ``blocks_per_chunk`` (engine blocks per offloaded block); not both.
- ``eviction_policy``: a registered cache policy (``lru``, ``arc``) unless
  ``cache_policy_module_path`` names an out-of-tree one.
- ``staging_bytes``: device staging memory for staged copies (a positive integer).
- ``layerwise_load`` / ``layerwise_min_tokens`` / ``layerwise_min_new_tokens`` / ``layerwise_groups``
  (``NPUOffloadingConnector`` only): load a host hit of at least that many tokens, with at least that
  many left to compute, inside the step that computes the rest of its prompt, in that many layer
  groups (``LayerwiseOptions``; docs/layerwise.md). ``"auto"``: only while no other request is
  running, where the loading step delays nobody's decode.

Keys are strict: a key that neither we nor the installed vLLM read for the connector in use
is an error naming the nearest known key (``reject_unknown_keys``; vLLM's own keys per
version are listed in ``compat``), so a misspelt size is never silently replaced by a default.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .. import env
from ..errors import OffloadConfigError
from ..memory import round_up
from .layerwise_policy import MIN_TOKENS_LEFT

logger = logging.getLogger(__name__)

SIZE_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks")

# Keys our own code reads, per connector; vLLM's keys (which it reads itself) come from compat.
SPEC_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size", "blocks_per_chunk", "eviction_policy", "staging_bytes")
SIMPLE_KEYS = ("cpu_bytes_to_use", "kv_offload_backend", "staging_bytes")
# Read by NPUOffloadingConnector only: vLLM's OffloadingConnector never calls the layer hooks.
LAYERWISE_KEYS = ("layerwise_load", "layerwise_min_tokens", "layerwise_min_new_tokens", "layerwise_groups")
SIMPLE_BACKENDS = ("cpu",)

# Escape hatch for a newer vLLM that reads a key we do not list yet: warn instead of failing.
ALLOW_UNKNOWN_ENV = "NPU_OFFLOAD_ALLOW_UNKNOWN_KEYS"


def reject_unknown_keys(extra: Mapping[str, Any], known: Iterable[str], owner: str) -> None:
    """Raise ``OffloadConfigError`` for keys outside ``known``, suggesting the nearest known key."""
    known = sorted(set(known))
    unknown = sorted((k for k in extra if k not in known), key=str)
    if not unknown:
        return
    parts = []
    for k in unknown:
        near = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
        parts.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    msg = (
        f"kv_connector_extra_config has {'an unknown key' if len(unknown) == 1 else 'unknown keys'} for "
        f"{owner}: {', '.join(parts)}. Known keys: {', '.join(known)}"
    )
    if env.get(ALLOW_UNKNOWN_ENV):
        logger.warning("%s (ignored: %s=1)", msg, ALLOW_UNKNOWN_ENV)
        return
    raise OffloadConfigError(f"{msg}. ({ALLOW_UNKNOWN_ENV}=1 turns this into a warning.)")


def _positive_int(extra: Mapping[str, Any], key: str) -> int | None:
    if key not in extra or extra[key] is None:
        return None
    raw = extra[key]
    try:
        val = int(raw)
        if isinstance(raw, float) and raw != val:
            raise ValueError
        if isinstance(raw, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise OffloadConfigError(f"kv_connector_extra_config[{key!r}]={raw!r} must be a positive integer") from None
    if val <= 0:
        raise OffloadConfigError(f"kv_connector_extra_config[{key!r}]={raw!r} must be a positive integer (> 0)")
    return val


@dataclass(frozen=True)
class OffloadOptions:
    cpu_bytes_to_use: int | None  # None until the KV size per block is known (legacy key)
    num_cpu_blocks: int | None
    blocks_per_chunk: int
    eviction_policy: str


def validate_extra_config(
    extra: Mapping[str, Any],
    engine_block_size: int | None = None,
    allowed_policies: Iterable[str] = ("lru", "arc"),
) -> OffloadOptions:
    """Check every key we understand; raise ``OffloadConfigError`` naming the key and the allowed values."""
    cpu_bytes = _positive_int(extra, "cpu_bytes_to_use")
    num_blocks = _positive_int(extra, "num_cpu_blocks")
    if cpu_bytes is None and num_blocks is None:
        raise OffloadConfigError(
            "kv_connector_extra_config needs 'cpu_bytes_to_use' (total host bytes for offloaded KV "
            "across all tensor-parallel ranks, e.g. 8589934592 for 8 GiB) or the legacy 'num_cpu_blocks'"
        )
    if cpu_bytes is not None and num_blocks is not None:
        raise OffloadConfigError(
            f"kv_connector_extra_config sets both 'cpu_bytes_to_use'={cpu_bytes} and 'num_cpu_blocks'={num_blocks}; "
            "give only one"
        )
    block_size = _positive_int(extra, "block_size")
    bpc = _positive_int(extra, "blocks_per_chunk")
    if block_size is not None and bpc is not None:
        raise OffloadConfigError("kv_connector_extra_config: give only one of 'block_size' and 'blocks_per_chunk'")
    blocks_per_chunk = bpc or 1
    if block_size is not None and engine_block_size:
        if block_size % engine_block_size:
            raise OffloadConfigError(
                f"kv_connector_extra_config['block_size']={block_size} must be a multiple of the engine KV block "
                f"size ({engine_block_size} tokens), e.g. {round_up(block_size, engine_block_size)}"
            )
        blocks_per_chunk = block_size // engine_block_size
    policy = extra.get("eviction_policy", "lru")
    allowed = tuple(allowed_policies)
    if not extra.get("cache_policy_module_path") and policy not in allowed:
        raise OffloadConfigError(
            f"kv_connector_extra_config['eviction_policy']={policy!r} is not one of {allowed} "
            "(or set 'cache_policy_module_path' for an out-of-tree policy)"
        )
    _positive_int(extra, "staging_bytes")  # read where staged copies are set up; checked here, at start-up
    return OffloadOptions(cpu_bytes, num_blocks, blocks_per_chunk, str(policy))


def staging_bytes_option(extra: Mapping[str, Any]) -> int | None:
    """``staging_bytes``: device memory for staged copies, both directions together (None = default)."""
    return _positive_int(extra, "staging_bytes")


def resolve_cpu_bytes(opts: OffloadOptions, bytes_per_chunk_all_ranks: int, alignment: int = 1) -> int:
    """Host bytes to use; converts the legacy ``num_cpu_blocks`` and rejects a size below one chunk."""
    chunk = round_up(bytes_per_chunk_all_ranks, alignment)
    if opts.num_cpu_blocks is not None:
        return opts.num_cpu_blocks * chunk
    assert opts.cpu_bytes_to_use is not None
    if chunk > 0 and opts.cpu_bytes_to_use < chunk:
        raise OffloadConfigError(
            f"kv_connector_extra_config['cpu_bytes_to_use']={opts.cpu_bytes_to_use} is smaller than one offloaded "
            f"block ({chunk} bytes across all ranks); use at least {chunk}"
        )
    return opts.cpu_bytes_to_use


@dataclass(frozen=True)
class LayerwiseOptions:
    """Layer-wise reload (docs/layerwise.md): off by default; a hit of ``min_tokens`` or more loads
    in ``groups`` layer groups inside the step that computes it, shorter hits stay asynchronous.
    ``auto``: only while no other request runs. A layer-wise step runs piecewise and every request
    in it waits for the copies: alone, that is the request's own TTFT gain (0.72x native's at 8k on
    an H200); beside decodes, their TPOT pays (serving at 8 clients -5.3% req/s)."""

    enabled: bool = False
    min_tokens: int = 256  # below it the copies are short and the asynchronous path is as good
    groups: int = 4  # per group one stream wait per step; a few groups hide most of the copy
    auto: bool = False
    # tokens the step must still compute beside the hit (the forward the copies hide under); at least 2
    min_new_tokens: int = MIN_TOKENS_LEFT

    @property
    def mode(self) -> bool | str:
        return "auto" if self.auto else self.enabled


# ``auto``'s defaults: a bare 2k reload was 1.29x slower layer by layer (its piecewise step costs
# more than 5 ms of copies hide), an 8k one 0.85x (H200, docs/layerwise.md); a bare 32k
# reload (64 tokens left to compute) 1.13x slower, while 8k and 32k histories with 1,024 new tokens
# were 0.85x / 0.93x of the asynchronous path (H200; docs/layerwise.md): without a forward to hide
# under, the copies are the step. 512 lies between the two measured cases.
AUTO_MIN_TOKENS = 4096
AUTO_MIN_NEW_TOKENS = 512


_IN_NPU_CONNECTOR: contextvars.ContextVar[bool] = contextvars.ContextVar("npu_offloading_connector", default=False)


@contextlib.contextmanager
def npu_connector_context():
    """Marks specs built inside ``NPUOffloadingConnector.__init__``: the only connector that reads
    the ``layerwise_*`` keys (vLLM's ``OffloadingConnector`` builds the same spec)."""
    token = _IN_NPU_CONNECTOR.set(True)
    try:
        yield
    finally:
        _IN_NPU_CONNECTOR.reset(token)


def check_layerwise_owner(extra: Mapping[str, Any]) -> None:
    """A ``layerwise_*`` key outside ``NPUOffloadingConnector`` would do nothing: an error naming it."""
    used = [k for k in LAYERWISE_KEYS if k in extra]
    if used and not _IN_NPU_CONNECTOR.get():
        raise OffloadConfigError(
            f"kv_connector_extra_config[{used[0]!r}]={extra[used[0]]!r} is read only by NPUOffloadingConnector "
            "(\"kv_connector\": \"NPUOffloadingConnector\", \"kv_connector_module_path\": "
            "\"vllm_npu_offload.integration.connector\"); vLLM's OffloadingConnector does not load layer by layer"
        )


def layerwise_options(extra: Mapping[str, Any]) -> LayerwiseOptions:
    """The ``layerwise_*`` keys, checked: ``layerwise_load`` true, false or "auto", the others
    positive integers."""
    raw = extra.get("layerwise_load", False)
    if not (isinstance(raw, bool) or raw == "auto"):
        raise OffloadConfigError(
            f"kv_connector_extra_config['layerwise_load']={raw!r} must be true, false (JSON booleans) or \"auto\""
        )
    auto = raw == "auto"
    default = LayerwiseOptions()
    return LayerwiseOptions(
        bool(raw),
        _positive_int(extra, "layerwise_min_tokens") or (AUTO_MIN_TOKENS if auto else default.min_tokens),
        _positive_int(extra, "layerwise_groups") or default.groups,
        auto,
        _positive_int(extra, "layerwise_min_new_tokens")
        or (AUTO_MIN_NEW_TOKENS if auto else default.min_new_tokens),
    )


@dataclass(frozen=True)
class SimpleOptions:
    size_key: str  # the key that sets this rank's host bytes
    size_value: int | None  # None: not set, vLLM's default applies


def validate_simple_extra_config(extra: Mapping[str, Any]) -> SimpleOptions:
    """Values of the keys ``NPUSimpleCPUOffloadConnector`` and vLLM's simple connector read."""
    total = _positive_int(extra, "cpu_bytes_to_use")
    per_rank = _positive_int(extra, "cpu_bytes_to_use_per_rank")
    _positive_int(extra, "staging_bytes")  # read where staged copies are set up; checked here, at start-up
    backend = str(extra.get("kv_offload_backend", "cpu"))
    if backend not in SIMPLE_BACKENDS:
        raise OffloadConfigError(
            f"kv_connector_extra_config['kv_offload_backend']={backend!r} is not supported by "
            f"NPUSimpleCPUOffloadConnector; allowed: {SIMPLE_BACKENDS}"
        )
    if per_rank is not None:  # vLLM's simple connector prefers it over cpu_bytes_to_use / world size
        return SimpleOptions("cpu_bytes_to_use_per_rank", per_rank)
    return SimpleOptions("cpu_bytes_to_use", total)
