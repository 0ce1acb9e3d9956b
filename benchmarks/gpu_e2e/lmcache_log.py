"""What LMCache says it did, read from its own log lines.

LMCache's scheduler side logs every lookup ("Reqid: ID, Total tokens N, Inference Engine computed
tokens: C, LMCache hit tokens: H, need to load: L"; "..., but need to load: L < min_retrieve M, skip
retrieve ..." when it will not load), its worker side every retrieve ("[req_id=ID] Retrieved R out
of Q required tokens ..."); one that failed to start says "degraded mode" and recomputes. A lookup
that promised tokens is only a load once its retrieve is logged: with vLLM 0.23.0, a prompt LMCache
held whole (1 token left to compute) was looked up with "need to load: 8191", no retrieve followed,
and its first token came faster than the link could have moved 1 GiB (H200, 2026-11-29).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

HIT = re.compile(r"LMCache hit tokens:\s*(\d+)")
LOAD = re.compile(r"need to load:\s*(\d+)")
REQ = re.compile(r"Reqid:\s*([^,\s]+)")
RETRIEVED = re.compile(r"(?:\[req_id=([^\]\s]+)\]\s*)?Retrieved (\d+) out of \d+ required tokens")
DEGRADED = re.compile(r"degraded mode", re.IGNORECASE)
# the logger of LMCache's cache engine, whose retrieve lines ``RetrieveCounter`` counts (LMCache's
# loggers do not propagate: a handler must sit on this one)
CACHE_ENGINE_LOGGER = "lmcache.v1.cache_engine"


def log_info(text: str) -> dict:
    """LMCache's lookups and retrieves in a stretch of a log: lookups, hit tokens (LMCache's prefix
    hit, tokens the device already holds included), tokens to load from it (the last lookup of each
    request: one waiting for room is looked up again), tokens retrieved, the requests that were to
    load and have no retrieve (``unretrieved``), and whether the stretch says degraded mode."""
    by_req: dict[str, tuple[int, int]] = {}
    other: list[tuple[int, int]] = []
    retrieved, got = 0, set()
    for line in text.splitlines():
        r = RETRIEVED.search(line)
        if r is not None:
            retrieved += int(r.group(2))
            got.add(r.group(1))
            continue
        m = HIT.search(line)
        if m is None:
            continue
        ld = LOAD.search(line)
        loaded = int(ld.group(1)) if ld and "min_retrieve" not in line else 0
        req = REQ.search(line)
        if req:
            by_req[req.group(1)] = (int(m.group(1)), loaded)
        else:
            other.append((int(m.group(1)), loaded))
    rows = list(by_req.values()) + other
    return {"lookups": len(rows), "hit_tokens": sum(h for h, _ in rows), "loaded_tokens": sum(n for _, n in rows),
            "retrieved_tokens": retrieved,
            "unretrieved": sorted(k for k, (_, n) in by_req.items() if n and k not in got),
            "degraded": DEGRADED.search(text) is not None}


def failure(info: dict) -> str | None:
    """Why a pass of an LMCache server is no LMCache number (``log_info`` of its log, degraded over
    the whole log): None when LMCache ran, reported hits and retrieved every load it promised. Hits
    with nothing to load are a number: every hit was still in the device's prefix cache (host KV far
    below the working set: ours' host-only server gets few host hits there too)."""
    if info.get("degraded"):
        return "LMCache ran in degraded mode (its log): it recomputed everything"
    if not info.get("lookups"):
        return "LMCache's log reports no lookup ('LMCache hit tokens: N') in this pass"
    if not info.get("hit_tokens"):
        return f"LMCache's log reports no hit tokens in this pass ({info['lookups']} lookups)"
    missing = info.get("unretrieved") or []
    if missing:
        return (f"LMCache promised tokens to {len(missing)} request(s) and logged no retrieve for them "
                f"(e.g. {missing[0]}): vLLM skipped computing KV that was never loaded")
    return None


def read_pass(log: Path, offset: int) -> tuple[dict, int]:
    """One pass of an LMCache server from its log: ``log_info`` of what the log gained since ``offset``
    (degraded: anywhere in the log) and the new offset."""
    try:
        with open(log, "rb") as f:
            whole = f.read()
    except OSError:
        whole = b""
    info = log_info(whole[offset:].decode(errors="replace"))
    info["degraded"] = DEGRADED.search(whole.decode(errors="replace")) is not None
    return info, len(whole)


class RetrieveCounter(logging.Handler):
    """Counts the tokens LMCache's cache engine logs as retrieved, in the process it runs in (an
    engine with tensor_parallel_size 1): ``tokens`` grows with every retrieve line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.tokens = 0
        self.retrieves = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            m = RETRIEVED.search(record.getMessage())
        except (TypeError, ValueError):  # a record whose arguments do not fit its format
            return
        if m is not None:
            self.tokens += int(m.group(2))
            self.retrieves += 1

    @classmethod
    def attach(cls, name: str = CACHE_ENGINE_LOGGER) -> "RetrieveCounter":
        """A counter on LMCache's cache-engine logger, which must let INFO through (its own stream
        handler keeps its level, so LMCache prints no more than before)."""
        h = cls()
        log = logging.getLogger(name)
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)
        log.addHandler(h)
        return h
