"""``python -m vllm_npu_offload info``: version, device kind, native build modes, NUMA, and every
run-time environment variable with its value in effect."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_npu_offload")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, detected device, native libraries, NUMA, environment variables")
    args = ap.parse_args(argv)
    if args.command == "info":
        from .info import format_info

        print(format_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
