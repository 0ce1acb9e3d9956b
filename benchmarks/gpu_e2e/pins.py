"""Files staged for the GPU machine by their sha256 (``SHA256  NAME`` lines): LMCache's wheels, Mooncake's.
Stdlib only (stage.py's rule)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def read_pins(path: Path) -> dict[str, str]:
    """{file name relative to its folder: sha256} ("SHA256  NAME" lines; comments and blanks dropped)."""
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            digest, name = line.split()
            out[name] = digest.lower()
    return out


def pinned_files(folder: Path | None, pins: dict[str, str]) -> tuple[list[Path], list[str]]:
    """The pinned files in ``folder`` (each sha256 checked) and what is wrong: ``([], [])`` when
    ``folder`` is None or absent (nothing to stage); a missing file or another hash is named."""
    if folder is None or not folder.is_dir():
        return [], []
    out, bad = [], []
    for name, digest in pins.items():
        f = folder / name
        if not f.is_file():
            bad.append(f"{name} missing")
        elif (got := sha256(f)) != digest:
            bad.append(f"{name}: sha256 {got}, pinned {digest}")
        else:
            out.append(f)
    return out, bad
