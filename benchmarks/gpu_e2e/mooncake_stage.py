"""Mooncake Store on the GPU machine, which has no registry and may lack the libraries it links.

Host side (``prepare``): the pinned CPU wheel (``mooncake_files.txt``; TCP is all servers on one host
need) trimmed to what the tier and the pair part run (the ``mooncake.store`` extension, its bundled
libraries, ``mooncake_master``): 101 MB unpacked, 14 MB as ``tar | xz``; and the Debian packages of the
system libraries it links (libibverbs, libnl, libnuma, libcurl and libcurl's own), 6.6 MB.

Device side (``install``): the trimmed tree into ``MOONCAKE_SITE``; the packages unpacked (a .deb is
an ``ar`` archive holding ``data.tar.xz``) into ``MOONCAKE_SITE/sysroot``, and of their libraries only
those the machine lacks (``ldconfig -p``) linked into ``MOONCAKE_SITE/syslib``: the processes that
use Mooncake get that folder on ``LD_LIBRARY_PATH``, so nothing the image has is replaced. Then
``ldd`` of the extension and of the master must find every library. Stdlib only.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from . import pins
from .pins import sha256

MOONCAKE_VERSION = "0.3.13.post1"
PINS = Path(__file__).with_name("mooncake_files.txt")
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "mooncake"
MOONCAKE_SITE = Path(os.environ.get("GPU_E2E_MOONCAKE_SITE", "/tmp/site_mooncake"))
TRIM_NAME = "mooncake-trimmed.tar.xz"
READY = ".gpu_e2e_ready"
# What the tier (mooncake.store) and the master need of the wheel's mooncake/ folder; the bundled
# libraries folder (mooncake_transfer_engine_non_cuda.libs/) goes whole.
KEEP = ("__init__.py", "buffer_pool.py", "store.so", "libetcd_wrapper.so", "libasio.so", "mooncake_master")
LIBS_DIR = "mooncake_transfer_engine_non_cuda.libs"
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")


class MooncakeStageError(RuntimeError):
    pass


def read_pins(path: Path = PINS) -> dict[str, str]:
    return pins.read_pins(path)


def pinned_files(folder: Path | None, pinned: dict[str, str] | None = None) -> list[Path]:
    """The pinned wheel and packages in ``folder``, each sha256 checked; [] when ``folder`` is None or
    absent (no Mooncake staged). A missing file or another hash is an error naming it."""
    out, bad = pins.pinned_files(folder, read_pins() if pinned is None else pinned)
    if bad:
        raise MooncakeStageError(f"Mooncake files in {folder}: {'; '.join(bad[:4])} ({PINS.name} says how to "
                                 f"fetch them; --no-mooncake stages without Mooncake)")
    return out


def trimmed_tar(wheel: Path, cache: Path) -> Path:
    """``tar | xz -9e`` of the wheel's KEEP files and bundled libraries, cached by the wheel's sha256."""
    out = cache / f"{TRIM_NAME}.{sha256(wheel)[:16]}"
    if out.exists():
        return out
    buf, names = io.BytesIO(), set()
    with zipfile.ZipFile(wheel) as z, tarfile.open(fileobj=buf, mode="w") as t:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            name = info.filename
            top, _, rest = name.partition("/")
            if info.is_dir() or not ((top == "mooncake" and rest in KEEP) or top == LIBS_DIR):
                continue
            data = z.read(info)
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), (info.external_attr >> 16) & 0o777 or 0o644
            t.addfile(ti, io.BytesIO(data))
            names.add(name)
    missing = [k for k in KEEP if f"mooncake/{k}" not in names]
    if missing:
        raise MooncakeStageError(f"{wheel.name} has no mooncake/{', mooncake/'.join(missing)}")
    tmp = out.with_suffix(".tmp")
    cache.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        subprocess.run(["xz", "-9e", "-T2", "-c"], input=buf.getvalue(), stdout=f, check=True)
    tmp.rename(out)
    return out


def manifest_entry(debs: list[Path], trim: Path) -> dict:
    """The manifest's ``mooncake`` entry: the trimmed tree and the packages, with their sha256."""
    return {"version": MOONCAKE_VERSION, "tar": TRIM_NAME, "tar_sha256": sha256(trim),
            "debs": [d.name for d in debs], "sha256": {d.name: sha256(d) for d in debs},
            "bytes": trim.stat().st_size + sum(d.stat().st_size for d in debs)}


def staged_names(entry: dict | None) -> list[str]:
    return [] if not entry else [entry["tar"], *entry["debs"]]


# ---------------------------------------------------------------- device side
def deb_data(deb: Path) -> bytes:
    """The ``data.tar.*`` member of a .deb (an ``ar`` archive: 8-byte magic, then 60-byte headers)."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise MooncakeStageError(f"{deb.name}: not a Debian package (no ar magic)")
    off = 8
    while off + 60 <= len(raw):
        head = raw[off:off + 60]
        name, size = head[:16].decode().strip().rstrip("/"), int(head[48:58].decode().strip())
        off += 60
        if name.startswith("data.tar"):
            return raw[off:off + size]
        off += size + (size & 1)
    raise MooncakeStageError(f"{deb.name}: no data.tar member")


def unpack_deb(deb: Path, root: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(deb_data(deb)), mode="r:*") as t:
        t.extractall(root, filter="tar" if sys.version_info >= (3, 12) else None)


def system_sonames() -> set[str]:
    """The library names the machine's loader knows (``ldconfig -p``)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def link_missing(sysroot: Path, syslib: Path, have: set[str]) -> list[str]:
    """Link into ``syslib`` each library of ``sysroot`` whose name the machine lacks; their names."""
    syslib.mkdir(parents=True, exist_ok=True)
    given = []
    for d in LIB_DIRS:
        for f in sorted((sysroot / d).glob("*.so*")) if (sysroot / d).is_dir() else []:
            if f.name in have or (syslib / f.name).exists():
                continue
            (syslib / f.name).symlink_to(f.resolve())
            given.append(f.name)
    return given


def unresolved(binary: Path, env: dict[str, str]) -> list[str]:
    """Libraries ``ldd`` cannot find for ``binary`` under ``env``."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def runtime_env(site: Path = MOONCAKE_SITE, base: dict[str, str] | None = None) -> dict[str, str]:
    """Variables for a process that uses Mooncake: its tree on PYTHONPATH (after the caller's), the
    libraries the machine lacked on LD_LIBRARY_PATH."""
    base = dict(os.environ if base is None else base)
    py, ld = base.get("PYTHONPATH", ""), base.get("LD_LIBRARY_PATH", "")
    base["PYTHONPATH"] = f"{py}:{site}" if py else str(site)
    base["LD_LIBRARY_PATH"] = f"{site / 'syslib'}:{ld}" if ld else str(site / "syslib")
    return base


def install(entry: dict | None, stage_dir: Path, site: Path = MOONCAKE_SITE) -> dict | None:
    """The trimmed tree and the missing system libraries into ``site``; None when nothing is staged.
    Raises naming what ``ldd`` still cannot find."""
    if not entry:
        return None
    for name in staged_names(entry):
        want = entry["tar_sha256"] if name == entry["tar"] else entry["sha256"][name]
        if sha256(stage_dir / name) != want:
            raise MooncakeStageError(f"{stage_dir / name}: sha256 differs from the manifest; stage again")
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    with tarfile.open(stage_dir / entry["tar"], "r:xz") as t:
        t.extractall(site)
    for deb in entry["debs"]:
        unpack_deb(stage_dir / deb, site / "sysroot")
    given = link_missing(site / "sysroot", site / "syslib", system_sonames())
    env = runtime_env(site)
    missing = {b: unresolved(site / "mooncake" / b, env) for b in ("store.so", "mooncake_master")}
    if any(missing.values()):
        raise MooncakeStageError(f"Mooncake cannot load: {json.dumps(missing)} (given from packages: {given})")
    info = {"mooncake": entry["version"], "libraries_given": given}
    (site / READY).write_text(json.dumps(info))
    return info


def ready(site: Path = MOONCAKE_SITE) -> dict | None:
    try:
        return json.loads((site / READY).read_text())
    except (OSError, ValueError):
        return None


def master_binary(site: Path = MOONCAKE_SITE) -> Path:
    return site / "mooncake" / "mooncake_master"


def status(site: Path = MOONCAKE_SITE) -> str:
    info = ready(site)
    if info is None:
        return f"Mooncake: not installed in {site} (no pair part; prepare stages it from .cache/mooncake)"
    given = info.get("libraries_given") or []
    return (f"Mooncake {info.get('mooncake')}: installed in {site}; system libraries given: "
            f"{', '.join(given) if given else 'none (the image has them)'}")
