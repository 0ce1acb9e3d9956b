"""One streamed chat request, timed: TTFT, TPOT, latency, tokens in/out.

Tokens come from the stream's final ``usage`` (``stream_options.include_usage``); servers that
do not send it get counted tokens (content chunks out, whitespace words in), flagged as such.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from . import BenchError


@dataclass
class RequestResult:
    conversation: str
    turn: int  # 0-based user turn index within the conversation
    client: int
    start_s: float = 0.0  # since run start
    ttft_ms: float = float("nan")
    tpot_ms: float = float("nan")
    latency_ms: float = float("nan")
    input_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0
    tokens_from: str = "usage"  # "usage" | "counted"
    ok: bool = False
    error: str = ""
    text: str = field(default="", repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        return d


def make_http_client(timeout_s: float, concurrency: int) -> httpx.AsyncClient:
    """trust_env=False: measure the server directly, never through an environment proxy."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
        trust_env=False,
    )


async def server_model(http: httpx.AsyncClient, url: str) -> str:
    """First model served at ``url`` (GET /v1/models); a clear error when nothing answers."""
    try:
        r = await http.get(f"{url}/v1/models", timeout=10.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"cannot reach an OpenAI-compatible server at {url} (GET /v1/models: "
                         f"{type(e).__name__}: {e or 'no detail'})") from None


async def chat(http: httpx.AsyncClient, url: str, body: dict[str, Any], res: RequestResult, t0: float) -> None:
    """Send ``body`` streamed, fill ``res`` in place (ok=False with the error on failure)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res.start_s = start - t0
    first = last = None
    parts: list[str] = []
    usage = None
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                raise BenchError(f"HTTP {r.status_code}: {detail}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if ev.get("error"):
                    raise BenchError(f"server error in stream: {ev['error']}")
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    delta = ch.get("delta") or {}
                    piece = delta.get("content") or delta.get("reasoning_content") or ""
                    if piece:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        parts.append(piece)
    except (httpx.HTTPError, BenchError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:400]
        res.latency_ms = (time.perf_counter() - start) * 1e3
        return
    end = time.perf_counter()
    res.text = "".join(parts)
    res.chunks = len(parts)
    if usage and usage.get("completion_tokens") is not None:
        res.input_tokens = int(usage.get("prompt_tokens") or 0)
        res.output_tokens = int(usage["completion_tokens"])
    else:
        res.tokens_from = "counted"
        res.input_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        res.output_tokens = len(parts)
    res.latency_ms = (end - start) * 1e3
    if first is None:
        res.error = "stream ended without any content"
        return
    res.ttft_ms = (first - start) * 1e3
    if res.output_tokens > 1:
        res.tpot_ms = (last - first) * 1e3 / (res.output_tokens - 1)
    res.ok = True
