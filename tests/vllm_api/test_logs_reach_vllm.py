"""The package's INFO lines (the disk tier's start-up line and counters) reach vLLM's log."""

import logging

from vllm_npu_offload.integration import compat  # noqa: F401  (installs the route)
from vllm_npu_offload.integration.logs import route_to_vllm


class Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_package_info_lines_go_out_through_vllms_handlers():
    vllm_log = logging.getLogger("vllm")
    keep = Keep()
    saved = vllm_log.level, vllm_log.propagate
    vllm_log.addHandler(keep)
    vllm_log.setLevel(logging.INFO)
    vllm_log.propagate = False
    try:
        route_to_vllm()  # a second call adds nothing
        logging.getLogger("vllm_npu_offload.integration.tiered_manager").info("disk tier: hits %d", 3)
        logging.getLogger("vllm_npu_offload.tiers.disk_worker").debug("not at INFO")
        assert keep.lines == ["disk tier: hits 3"]
        vllm_log.setLevel(logging.WARNING)  # vLLM's level decides
        logging.getLogger("vllm_npu_offload.tiers.disk_tier").info("quiet now")
        assert keep.lines == ["disk tier: hits 3"]
    finally:
        vllm_log.removeHandler(keep)
        vllm_log.setLevel(saved[0])
        vllm_log.propagate = saved[1]
