"""What this install can do: version, device kind, native libraries and their build modes.

Each line comes from a provider ``(name, callable -> str)`` in ``PROVIDERS``; a backend
adds its own with ``register_info_provider`` (or one line in the list below). A
provider that raises shows its error instead of hiding the other lines.
"""

from __future__ import annotations

from typing import Callable


def _version() -> str:
    from . import __version__

    return __version__


def _device() -> str:
    from .platform import detect_kind

    return detect_kind()


def _npu_native() -> str:
    from .copy.npu_native import library_info

    return library_info()


PROVIDERS: list[tuple[str, Callable[[], str]]] = [
    ("version", _version),
    ("device", _device),
    ("native npu (libnpu_offload_acl)", _npu_native),
]


def register_info_provider(name: str, fn: Callable[[], str]) -> None:
    PROVIDERS.append((name, fn))


def collect() -> list[tuple[str, str]]:
    out = []
    for name, fn in PROVIDERS:
        try:
            out.append((name, fn()))
        except Exception as e:  # noqa: BLE001 - one broken provider must not hide the rest
            out.append((name, f"error: {type(e).__name__}: {e}"))
    return out


def format_info() -> str:
    rows = collect()
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"{n:<{width}}  {v}" for n, v in rows)
