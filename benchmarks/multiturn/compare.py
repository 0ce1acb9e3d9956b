"""Same workload against offload off and offload on; side-by-side table with on/off ratios.

Servers are either given (``url_off``/``url_on``) or started one after the other by the
launcher, so the two never compete for the machine while measured."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, ContextManager

from .driver import DriverConfig, run_load
from .generate import Conversation
from .report import format_compare, format_summary, run_payload, summarize, write_json


def run_one(convs: list[Conversation], dcfg: DriverConfig, label: str,
            server: Callable[[], ContextManager[str]] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run on ``dcfg.url``, or on the URL a freshly started ``server()`` yields."""
    with (server() if server else contextlib.nullcontext(dcfg.url)) as url:
        run = asyncio.run(run_load(copy.deepcopy(convs), replace(dcfg, url=url), label))
    return run, summarize(run)


def compare(convs: list[Conversation], dcfg: DriverConfig, out_dir: str | Path,
            servers: dict[str, Callable[[], ContextManager[str]] | str]) -> dict[str, Any]:
    """``servers`` maps "offload-off"/"offload-on" to a URL or a server factory. Writes
    compare.json and ttft_by_turn.png in ``out_dir``; returns both summaries and the table."""
    from .plot import plot_ttft_by_turn

    out = Path(out_dir)
    sums, payload = [], {}
    for label, srv in servers.items():
        if isinstance(srv, str):
            run, s = run_one(convs, replace(dcfg, url=srv), label, None)
        else:
            run, s = run_one(convs, dcfg, label, srv)
        print(format_summary(s), flush=True)
        sums.append(s)
        payload[label] = run_payload(run, s)
    table = format_compare(sums[0], sums[1])
    payload["table"] = table
    write_json(out / "compare.json", payload)
    png = plot_ttft_by_turn(sums, out / "ttft_by_turn.png")
    return {"summaries": sums, "table": table, "json": str(out / "compare.json"), "png": str(png) if png else None}
