"""``python -m vllm_npu_offload info``: print version, device kind and native build modes."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_npu_offload")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, detected device, native libraries and their build modes")
    args = ap.parse_args(argv)
    if args.command == "info":
        from .info import format_info

        print(format_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
