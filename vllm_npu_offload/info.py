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
    from ._native.acl import library_info

    return library_info()


def _cuda_native() -> str:
    try:
        from ._native.cuda import load_library
    except ImportError as e:  # torch-free install checks, or a broken tree
        return f"unavailable ({e})"
    try:
        d = load_library().describe()
    except (ImportError, OSError) as e:
        return f"not built ({e})"
    kernel = "gather kernel" if d["gather_kernel"] else "no gather kernel (Triton gathers)"
    runtime = d["runtime"] if not d["error"] else f"unavailable ({d['error']})"
    return f"{d['built']} build, {kernel}; driver: {runtime}"


def _numa() -> str:
    from .numa import device_node, num_nodes
    from .platform import detect_kind

    nodes = num_nodes()
    if nodes <= 1:
        return "single NUMA node (host KV placement needs no binding)"
    node, why = device_node(detect_kind())
    if node is None:
        return f"{nodes} nodes; device node unknown ({why}; host KV left to first touch)"
    return f"{nodes} nodes; device on node {node} ({why}; host KV bound there)"


PROVIDERS: list[tuple[str, Callable[[], str]]] = [
    ("version", _version),
    ("device", _device),
    ("native cuda (libnpu_offload_cuda)", _cuda_native),
    ("native npu (libnpu_offload_acl)", _npu_native),
    ("numa", _numa),
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
    from .env import describe

    rows = collect()
    width = max(len(n) for n, _ in rows)
    lines = [f"{n:<{width}}  {v}" for n, v in rows]
    knobs = describe()
    kw = max(len(n) for n, _, _ in knobs)
    vw = max(len(v) for _, v, _ in knobs)
    lines += ["", "environment (run time; `vllm_npu_offload/env.py`):"]
    lines += [f"  {n:<{kw}}  {v:<{vw}}  {m}" for n, v, m in knobs]
    return "\n".join(lines)
