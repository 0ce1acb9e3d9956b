"""Compiled C-ABI libraries land here (``libnpu_offload_cuda.so``, ``libnpu_offload_acl.so``)."""

from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent


def library_path(name: str) -> Path | None:
    """Path of ``lib<name>.so`` if it was built, else None. ``NPU_OFFLOAD_NATIVE_DIR`` overrides the folder."""
    from .. import env

    for folder in (env.get("NPU_OFFLOAD_NATIVE_DIR"), NATIVE_DIR):
        if folder:
            p = Path(folder) / f"lib{name}.so"
            if p.exists():
                return p
    return None
