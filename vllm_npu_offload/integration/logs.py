"""Our log records go out through vLLM's own handlers.

The package logs under ``vllm_npu_offload.*``, which vLLM's logging setup does not cover: without
this, INFO lines (the disk tier's start-up line and its counters) never reach a server's log. The
handler looks vLLM's logger up when a record is emitted, so whatever vLLM configures, and whenever
it does, applies: its format, destination and level.
"""

from __future__ import annotations

import logging
import os

PACKAGE = "vllm_npu_offload"


class ToVLLM(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if record.levelno >= target.getEffectiveLevel():
            target.handle(record)


def route_to_vllm() -> None:
    """Idempotent; called when the integration is imported (only then does vLLM run)."""
    pkg = logging.getLogger(PACKAGE)
    if any(isinstance(h, ToVLLM) for h in pkg.handlers):
        return
    pkg.addHandler(ToVLLM())
    if pkg.level == logging.NOTSET:
        debug = os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"
        pkg.setLevel(logging.DEBUG if debug else logging.INFO)
    pkg.propagate = False  # vLLM's logger passes it on to the root where vLLM lets it


__all__ = ["ToVLLM", "route_to_vllm"]
