"""Which host hits load layer by layer inside the step that computes them. Pure Python.

vLLM's scheduler takes a synchronous hit as computed and schedules the rest of the prompt in the
same step, which needs at least one token left (``assert num_new_tokens > 0``). We ask for two: a
step whose only new token per request is one is a uniform decode batch, which a FULL CUDA graph
replays without running the layer hooks. A hit that ends on an offloaded-block boundary with fewer
left (the reload of a whole block-aligned prompt: vLLM's lookup offers every token) gives up its
last block instead, which the step then computes; other hits keep the asynchronous path, as do
hits shorter than ``layerwise_min_tokens``, whose copies are too short to be worth hiding, and hits
with fewer than ``layerwise_min_new_tokens`` tokens left to compute, whose step has too little forward
to hide the copies under.
"""

from __future__ import annotations

MIN_TOKENS_LEFT = 2


def sync_hit(num_tokens: int, num_computed: int, hit: int, block_tokens: int, min_tokens: int,
             trim: bool = True, min_left: int = MIN_TOKENS_LEFT) -> int | None:
    """Tokens to load layer by layer for a hit of ``hit`` tokens after ``num_computed`` local ones
    (``num_tokens`` in the request, ``block_tokens`` per offloaded block), or None: asynchronous.
    ``trim=False``: the hit may not be shortened (vLLM 0.32 pinned its end: a partial-tail hit).
    ``min_left``: tokens the step must still compute beside the hit (``layerwise_min_new_tokens``)."""
    if hit <= 0:
        return None
    if num_tokens - num_computed - hit < MIN_TOKENS_LEFT:
        if not trim or (num_computed + hit) % block_tokens:
            return None  # not on a block boundary (a partial tail): keep vLLM's own handling
        hit -= block_tokens
    left = num_tokens - num_computed - hit
    return hit if hit >= min_tokens and hit > 0 and left >= max(min_left, MIN_TOKENS_LEFT) else None


__all__ = ["MIN_TOKENS_LEFT", "sync_hit"]
