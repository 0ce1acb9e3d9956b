"""Load driver: K concurrent clients replay conversations turn by turn with full history.

Why the scheduling matters for offload: up to ``max_active`` conversations are open at once
and clients take them round-robin, so between two turns of one conversation the server serves
others; once their histories exceed the device KV cache, a conversation's prefix has been
evicted by its next turn and must be recomputed (offload off) or loaded from host (offload on).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import BenchError
from .client import RequestResult, chat, make_http_client, server_model
from .generate import Conversation, VOCAB_WORDS
from .server_metrics import delta, scrape


@dataclass
class DriverConfig:
    url: str
    model: str | None = None  # default: the server's first model
    clients: int = 4
    max_active: int | None = None  # open conversations at once (default: 2 x clients)
    warmup: int = 2  # throwaway requests before timing
    timeout_s: float = 120.0  # per request
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM extension: fixed answer lengths with random/small models
    max_requests: int | None = None
    progress: bool = True

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise BenchError(f"url = {self.url!r}: must start with http:// or https://")
        if self.clients < 1:
            raise BenchError(f"clients = {self.clients}: need at least 1 concurrent client")
        if self.max_active is not None and self.max_active < 1:
            raise BenchError(f"max_active = {self.max_active}: need at least 1 open conversation")
        if self.warmup < 0:
            raise BenchError(f"warmup = {self.warmup}: must be >= 0")
        if not self.timeout_s > 0:
            raise BenchError(f"timeout = {self.timeout_s}: must be > 0 seconds")
        self.url = self.url.rstrip("/")


@dataclass
class _Conv:
    conv: Conversation
    history: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        if self.conv.system:
            self.history.append({"role": "system", "content": self.conv.system})


class _Progress:
    """In-place bar on a terminal; a line per 10% otherwise (CI logs stay short)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        el = time.perf_counter() - self.t0
        msg = (f"{self.label} [{'#' * int(frac * 30):<30}] {self.done}/{self.total} "
               f"{self.done / max(el, 1e-9):.1f} req/s {el:.0f}s" + (f" failed={self.failed}" if self.failed else ""))
        if self.tty:
            print("\r" + msg, end="\n" if self.done == self.total else "", file=sys.stderr, flush=True)
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            print(msg, file=sys.stderr, flush=True)


def _body(model: str, messages: list[dict[str, str]], max_tokens: int, cfg: DriverConfig) -> dict[str, Any]:
    b: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                         "temperature": cfg.temperature}
    if cfg.ignore_eos:
        b["ignore_eos"] = True
    return b


async def run_load(convs: list[Conversation], cfg: DriverConfig, label: str = "run") -> dict[str, Any]:
    """Replay ``convs``; returns {"results": [RequestResult...], "runtime_s", "model", ...}.
    Every planned request ends up in results (ok), failed, or skipped (its conversation broke)."""
    cfg.validate()
    if not convs:
        raise BenchError("no conversations to replay")
    max_active = cfg.max_active or 2 * cfg.clients
    planned = sum(len(c.turns) for c in convs)
    if cfg.max_requests is not None:
        if cfg.max_requests < 1:
            raise BenchError(f"max_requests = {cfg.max_requests}: must be >= 1")
        planned = min(planned, cfg.max_requests)
    async with make_http_client(cfg.timeout_s, cfg.clients) as http:
        model = cfg.model or await server_model(http, cfg.url)
        if cfg.model:
            await server_model(http, cfg.url)  # fail fast and clearly when unreachable
        t_w = time.perf_counter()
        if cfg.warmup:
            import random

            rng = random.Random(12345)
            warm = [RequestResult("warmup", 0, i) for i in range(cfg.warmup)]
            sem = asyncio.Semaphore(cfg.clients)

            async def one(r: RequestResult) -> None:
                async with sem:
                    msg = " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(32))
                    await chat(http, cfg.url, _body(model, [{"role": "user", "content": msg}], 8, cfg), r, t_w)

            await asyncio.gather(*(one(r) for r in warm))
            bad = [r for r in warm if not r.ok]
            if bad:
                raise BenchError(f"warm-up request to {cfg.url} failed: {bad[0].error}")
        warmup_s = time.perf_counter() - t_w

        pending = [_Conv(c) for c in convs]
        pending.reverse()
        ready: asyncio.Queue = asyncio.Queue()
        for _ in range(min(max_active, len(pending))):
            ready.put_nowait(pending.pop())
        results: list[RequestResult] = []
        state = {"issued": 0, "skipped": 0, "outstanding": planned}
        prog = _Progress(planned, label, cfg.progress)
        before = await scrape(http, cfg.url)
        t0 = time.perf_counter()

        def finish_conv(c: _Conv) -> None:
            remaining = len(c.conv.turns) - c.turn
            take = min(remaining, state["outstanding"])
            state["skipped"] += take
            state["outstanding"] -= take
            if pending:
                ready.put_nowait(pending.pop())

        async def client(cid: int) -> None:
            while True:
                if state["outstanding"] <= 0:
                    return
                try:
                    c = await asyncio.wait_for(ready.get(), timeout=0.2)
                except asyncio.TimeoutError:
                    continue
                if c is None:
                    return
                user, n_out = c.conv.turns[c.turn]
                c.history.append({"role": "user", "content": user})
                res = RequestResult(c.conv.id, c.turn, cid)
                state["outstanding"] -= 1
                await chat(http, cfg.url, _body(model, list(c.history), n_out, cfg), res, t0)
                results.append(res)
                prog.update(res.ok)
                c.turn += 1
                if res.ok:
                    c.history.append({"role": "assistant", "content": res.text})
                if res.ok and c.turn < len(c.conv.turns) and state["outstanding"] > 0:
                    ready.put_nowait(c)  # back of the queue: round-robin over open conversations
                else:
                    finish_conv(c)
                if state["outstanding"] <= 0:
                    for _ in range(cfg.clients):
                        ready.put_nowait(None)

        await asyncio.gather(*(client(i) for i in range(cfg.clients)))
        runtime = time.perf_counter() - t0
        server = delta(before, await scrape(http, cfg.url)) if before else {}
    planned_total = len(results) + state["skipped"]
    return {"label": label, "url": cfg.url, "model": model, "results": results, "runtime_s": runtime,
            "warmup_s": warmup_s, "planned": planned_total, "skipped": state["skipped"],
            "clients": cfg.clients, "max_active": max_active, "server": server}
