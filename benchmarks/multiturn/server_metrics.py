"""Server-side counters from vLLM's Prometheus ``/metrics``, as deltas over a run.

Why: client timings alone cannot show whether offload engaged; the prefix-cache hit rates and
offload load/store bytes can. Servers without /metrics just yield an empty dict."""

from __future__ import annotations

import httpx

COUNTERS = {
    "prefix_queries": "vllm:prefix_cache_queries",
    "prefix_hits": "vllm:prefix_cache_hits",
    "external_queries": "vllm:external_prefix_cache_queries",
    "external_hits": "vllm:external_prefix_cache_hits",
    "offload_load_bytes": "vllm:kv_offload_load_bytes",
    "offload_store_bytes": "vllm:kv_offload_store_bytes",
    "offload_load_seconds": "vllm:kv_offload_load_time",
    "offload_store_seconds": "vllm:kv_offload_store_time",
    "preemptions": "vllm:num_preemptions",
}


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        r = await http.get(f"{url}/metrics", timeout=10.0)
        if r.status_code != 200:
            return {}
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        base = name[:-6] if name.endswith("_total") else name
        for key, metric in COUNTERS.items():
            if base == metric:
                try:
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    if d.get("prefix_queries"):
        d["prefix_hit_rate"] = d.get("prefix_hits", 0.0) / d["prefix_queries"]
    if d.get("external_queries"):
        d["external_hit_rate"] = d.get("external_hits", 0.0) / d["external_queries"]
    return d
