"""Multi-turn serving benchmark: generate conversations, replay them against an
OpenAI-compatible server, compare offload off vs on.

Why a package of its own: it measures what users see (TTFT per turn as history grows and
prefix KV is evicted, then reloaded from host), talks only HTTP, and imports neither vLLM
nor torch, so it runs on any client box. ``launcher`` is the only module that starts vLLM,
always as a subprocess. Entry point: ``scripts/bench_multiturn.py`` (see docs/multiturn.md).
"""


class BenchError(Exception):
    """A user-facing error: bad input, unreachable server, server failed to start."""


# our connector for vLLM's KV-connector config (name, module): the spec plus its prefetch on a request's
# arrival, which the tiers use; shared by the launcher and the GPU yardstick's engines (no imports here)
NPU_CONNECTOR = ("NPUOffloadingConnector", "vllm_npu_offload.integration.connector")
