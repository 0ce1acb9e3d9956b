"""Stage vLLM 0.23.0 (CUDA) for a GPU machine that has no registry, and install it there.

Host side (needs registry access; stdlib + pip + xz only):
  prepare: download the vLLM 0.23.0 wheel and the wheels in ``deps.txt`` (cached), strip the
  wheel, apply the edits, ``tar | xz``, and split everything into parts that each fit one
  device call (<= ``--part-bytes``, as few parts as fit, balanced), plus ``manifest.json`` in every
  part. LMCache's wheels (``lmcache_wheels.txt``, sha256 pinned), when their folder is there
  (``--lmcache-wheels``, default ``.cache/lmcache``), go into the parts too. Then fetch the vLLM
  0.23.0 sdist (pinned sha256, cached) and take vLLM's multi-turn client out of it.

Device side (no registry; stdlib only):
  stage PART_DIR: copy one part into ``/tmp/gpu_e2e/stage`` (it survives while the machine stays warm).
  install: check that every piece is there, unpack vLLM into ``/tmp/site``, pip-install the wheels;
  LMCache's, when staged, ``--no-deps`` into ``/tmp/site_lmcache`` (``LMCACHE_SITE``).
  check: exit 3 with "machine is cold ..." when ``/tmp/site`` is not a finished install; says whether
  LMCache is installed.

Why: ../shared/research/gpu_vllm.md (the GPU image has torch 2.11.0+cu130, which vLLM 0.23.0 pins).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from . import mooncake_stage, pins
from .pins import sha256 as _sha256

VLLM_VERSION = "0.23.0"
VLLM_WHEEL = "vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl"
# The sdist holds benchmarks/multi_turn/ (vLLM's multi-turn client), which the wheel does not.
VLLM_SDIST = "vllm-0.23.0.tar.gz"
VLLM_SDIST_SHA256 = "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5"  # as scripts/dev/setup_v023.sh
CLIENT_FILES = ("benchmark_serving_multi_turn.py", "bench_dataset.py", "bench_utils.py")
CLIENT_SOURCE = "SOURCE.json"
INDEX_URL = "https://pypi.org/simple"
# What a Llama on TRITON_ATTN never loads (gpu_vllm.md: 274 MB wheel -> 144 MB tree).
FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
STRIP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/third_party/deep_gemm",
    "vllm/vllm-rs",
    "vllm/_flashmla_C.abi3.so",
    "vllm/_moe_C.abi3.so",
)
# FlashAttention 3 (SM90) stays: MLA's prefill on Hopper runs only on it in 0.23 (its prefill
# selector offers FLASH_ATTN alone below SM100). 153 MB in the tree, 7.9 MB after xz.
# ``prepare --no-fa3`` strips it too (no MLA layout then).
# Source edits of the staged copy: (file, old, new). Without the FA libraries,
# vllm_flash_attn/__init__.py raises ImportError, and llama.py imports it indirectly.
EDITS = (("vllm/vllm_flash_attn/__init__.py", "if not (FA2_AVAILABLE or FA3_AVAILABLE):", "if False:"),)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)] + ["manylinux2014_x86_64", "any"]
DEPS_FILE = Path(__file__).with_name("deps.txt")
TAR_NAME = "vllm-stripped.tar.xz"
# The most one part may hold: 64 MiB (67.1 MB) per call minus the repository's tree (10.1 MB raw on
# 2026-11-28, most of it docs/results) and the code copy (1.3 MB), with ~2.5 MB of room for growth.
# The stripped vLLM with FA3 (97.5 MB), the wheels (38.9 MB) and LMCache's (18.4 MB) are 154.8 MB:
# three balanced parts of 51.6 MB (without LMCache, three of 45.5 MB).
DEFAULT_PART_BYTES = 53_000_000

STAGE_DIR = Path(os.environ.get("GPU_E2E_STAGE", "/tmp/gpu_e2e/stage"))
SITE_DIR = Path(os.environ.get("GPU_E2E_SITE", "/tmp/site"))
READY = ".gpu_e2e_ready"
# LMCache: its wheels' pins, and the folder it is installed into on the device (only the lmcache engines
# and servers get it on their path, after vLLM's site; scripts/dev/gpu_e2e.sh names the same folder)
ROOT = Path(__file__).resolve().parents[2]
LMCACHE_VERSION = "0.5.3"
LMCACHE_PINS = Path(__file__).with_name("lmcache_wheels.txt")
LMCACHE_DEFAULT_DIR = ROOT / ".cache" / "lmcache"
LMCACHE_SITE = Path("/tmp/site_lmcache")
COLD_MSG = "machine is cold: nothing staged in {site}; run the stage calls (part 1, part 2 + install) again"


class StageError(RuntimeError):
    pass


def read_deps(path: Path = DEPS_FILE) -> list[str]:
    """Pinned requirement lines of deps.txt (comments and blanks dropped); each must pin ==."""
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line:
            raise StageError(f"{path}: '{line}' is not pinned (NAME==VERSION)")
        out.append(line)
    return out


def read_lmcache_pins(path: Path = LMCACHE_PINS) -> dict[str, str]:
    """{wheel file name: sha256} of lmcache_wheels.txt."""
    return pins.read_pins(path)


def lmcache_wheels(folder: Path | None, pinned: dict[str, str] | None = None) -> list[Path]:
    """LMCache's pinned wheels in ``folder``, each sha256 checked; [] when ``folder`` is None or absent
    (no LMCache staged). A folder that lacks one, or holds one with another hash, is an error."""
    out, bad = pins.pinned_files(folder, read_lmcache_pins() if pinned is None else pinned)
    if bad:
        raise StageError(f"LMCache wheels in {folder}: {'; '.join(bad)} (lmcache_wheels.txt says how to fetch them; "
                         f"--no-lmcache stages without LMCache)")
    return out


def plan_parts(items: list[tuple[str, int, bool]], budget: int) -> list[list[tuple[str, int, int]]]:
    """Pack (name, size, splittable) items into parts of at most ``budget`` bytes.

    Returns per part a list of (name, offset, length). Whole items (wheels) are placed first,
    each in the first part with room (a new part if none); then splittable items (the tarball)
    fill the room that is left, part by part, and continue in new parts."""
    if budget <= 0:
        raise StageError(f"part size {budget} must be > 0")
    parts: list[list[tuple[str, int, int]]] = [[]]
    room = [budget]
    for name, size, split in sorted(items, key=lambda it: it[2]):  # stable: whole items first
        if not split:
            if size > budget:
                raise StageError(f"{name} ({size} bytes) does not fit a part of {budget} bytes")
            i = next((k for k, r in enumerate(room) if r >= size), None)
            if i is None:
                parts.append([])
                room.append(budget)
                i = len(parts) - 1
            parts[i].append((name, 0, size))
            room[i] -= size
            continue
        off = 0
        k = 0
        while off < size:
            while k < len(parts) and room[k] == 0:
                k += 1
            if k == len(parts):
                parts.append([])
                room.append(budget)
            n = min(room[k], size - off)
            parts[k].append((name, off, n))
            room[k] -= n
            off += n
    return [p for p in parts if p]


def balanced_parts(items: list[tuple[str, int, bool]], max_bytes: int) -> list[list[tuple[str, int, int]]]:
    """``plan_parts`` with the fewest parts of at most ``max_bytes``, each about as large as the others
    (every call then keeps the same room for the checkout's tree and the code copy)."""
    total = sum(size for _, size, _ in items)
    largest = max((size for _, size, split in items if not split), default=0)
    n = max(1, -(-total // max_bytes))
    while True:
        budget = min(max_bytes, max(-(-total // n), largest))
        parts = plan_parts(items, budget)
        if len(parts) <= n or budget >= max_bytes:
            return parts
        n += 1


# ---------------------------------------------------------------- host side: prepare
def _pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + args, check=True)


def download(cache: Path) -> tuple[Path, list[Path]]:
    """The vLLM wheel and the dependency wheels, downloaded once into ``cache``."""
    dl, wheels = cache / "dl", cache / "wheels"
    dl.mkdir(parents=True, exist_ok=True)
    wheels.mkdir(parents=True, exist_ok=True)
    vllm = dl / VLLM_WHEEL
    if not vllm.exists():
        print(f"[prepare] downloading vllm=={VLLM_VERSION} (274 MB)", file=sys.stderr, flush=True)
        _pip_download([f"vllm=={VLLM_VERSION}"], dl)
    deps = read_deps()
    names = {d.split("==")[0].lower().replace("-", "_").replace(".", "_") for d in deps}

    def have() -> dict[str, Path]:
        got = {}
        for w in wheels.glob("*.whl"):
            key = w.name.split("-")[0].lower().replace(".", "_")
            got[key] = w
        return got

    missing = [d for d in deps if d.split("==")[0].lower().replace("-", "_").replace(".", "_") not in have()]
    if missing:
        print(f"[prepare] downloading {len(missing)} wheels", file=sys.stderr, flush=True)
        _pip_download(missing, wheels)
    got = have()
    lost = sorted(names - set(got))
    if lost:
        raise StageError(f"wheels not downloaded: {lost}")
    return vllm, sorted(got[n] for n in names)


def _index_url() -> str:
    """The package index pip uses here (PIP_INDEX_URL, pip's config), else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            url = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            url = ""
    return (url or INDEX_URL).rstrip("/")


def fetch_sdist(cache: Path, local: list[Path] | None = None) -> Path:
    """vLLM 0.23.0's sdist in ``cache/dl``, its sha256 checked: an earlier download, a copy from
    ``local`` (setup_v023.sh's download), else the file the index lists for it (PEP 691 JSON, the
    simple API pip reads). pip itself cannot fetch it without building vLLM's metadata (torch)."""
    dst = cache / "dl" / VLLM_SDIST
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and _sha256(dst) == VLLM_SDIST_SHA256:
        return dst
    for cand in local or []:
        if cand.exists() and _sha256(cand) == VLLM_SDIST_SHA256:
            shutil.copy2(cand, dst)
            return dst
    import urllib.request

    index = _index_url()
    print(f"[prepare] downloading {VLLM_SDIST} (37 MB) via {index}", file=sys.stderr, flush=True)
    req = urllib.request.Request(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == VLLM_SDIST), None)
    if entry is None:
        raise StageError(f"{index}/vllm/ lists no {VLLM_SDIST}")
    if entry.get("hashes", {}).get("sha256", VLLM_SDIST_SHA256) != VLLM_SDIST_SHA256:
        raise StageError(f"the index's sha256 of {VLLM_SDIST} is {entry['hashes']['sha256']}, pinned {VLLM_SDIST_SHA256}")
    tmp = dst.with_suffix(".part")
    with urllib.request.urlopen(entry["url"], timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f, 1 << 20)
    if _sha256(tmp) != VLLM_SDIST_SHA256:
        tmp.unlink()
        raise StageError(f"{VLLM_SDIST}: sha256 mismatch after download (pinned {VLLM_SDIST_SHA256})")
    tmp.rename(dst)
    return dst


def extract_client(sdist: Path, dest: Path) -> dict:
    """vLLM's benchmarks/multi_turn client files out of the sdist into ``dest``, with ``SOURCE.json``
    (the sdist's and each file's sha256): vLLM's code is run on the device, not committed here."""
    prefix = f"vllm-{VLLM_VERSION}/benchmarks/multi_turn/"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    files = {}
    with tarfile.open(sdist, "r:gz") as t:
        for name in CLIENT_FILES:
            try:
                data = t.extractfile(prefix + name).read()
            except KeyError:
                raise StageError(f"{sdist.name} has no {prefix}{name}") from None
            (dest / name).write_bytes(data)
            files[name] = hashlib.sha256(data).hexdigest()
    man = {"sdist": sdist.name, "sdist_sha256": _sha256(sdist), "path": prefix, "files": files}
    (dest / CLIENT_SOURCE).write_text(json.dumps(man, indent=1))
    return man


def build_tree(wheel: Path, tree: Path, strip: tuple[str, ...] = STRIP) -> None:
    """Unzip the wheel into ``tree`` without the stripped paths, then apply EDITS."""
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if any(info.filename == s or info.filename.startswith(s + "/") for s in strip):
                continue
            z.extract(info, tree)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(tree / info.filename, mode & 0o777)
    for rel, old, new in EDITS:
        p = tree / rel
        text = p.read_text()
        if old not in text:
            raise StageError(f"edit of {rel}: '{old}' not found (wrong vLLM version?)")
        p.write_text(text.replace(old, new, 1))


def prepare(out: Path, cache: Path, part_bytes: int, fa3: bool = True, lmcache_dir: Path | None = None,
            mooncake_dir: Path | None = None) -> dict:
    """The parts in ``out``; ``lmcache_dir``: LMCache's pinned wheels, ``mooncake_dir``: Mooncake's pinned
    wheel and system packages (None or absent: not staged)."""
    lmc = lmcache_wheels(lmcache_dir)
    mc_files = mooncake_stage.pinned_files(mooncake_dir)
    mc_wheel = next((f for f in mc_files if f.suffix == ".whl"), None)
    mc_trim = mooncake_stage.trimmed_tar(mc_wheel, cache) if mc_wheel else None
    mc_debs = [f for f in mc_files if f.suffix == ".deb"]
    vllm, wheels = download(cache)
    strip = STRIP if fa3 else STRIP + (FA3,)
    # The tarball depends only on the wheel, the stripped paths and EDITS: cache it by that key.
    key = hashlib.sha256(json.dumps([VLLM_WHEEL, strip, EDITS]).encode()).hexdigest()[:16]
    tar = cache / f"vllm-{key}.tar.xz"
    if not tar.exists():
        tree = cache / "tree"
        build_tree(vllm, tree, strip)
        print("[prepare] tar | xz -9e (about 1.5 min on 2 cores)", file=sys.stderr, flush=True)
        tmp = tar.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            t = subprocess.Popen(["tar", "-C", str(tree), "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9e", "-T2", "-c"], stdin=t.stdout, stdout=f, check=True)
            if t.wait() != 0:
                raise StageError("tar failed")
        tmp.rename(tar)
        shutil.rmtree(tree)
    whole = {w.name: w for w in wheels + lmc + mc_debs}
    if mc_trim is not None:
        whole[mooncake_stage.TRIM_NAME] = mc_trim
    items = [(TAR_NAME, tar.stat().st_size, True)] + [(n, f.stat().st_size, False) for n, f in whole.items()]
    src = {TAR_NAME: tar, **whole}
    parts = balanced_parts(items, part_bytes)
    manifest = {
        "vllm": VLLM_VERSION, "tar": TAR_NAME, "tar_sha256": _sha256(tar), "tar_bytes": tar.stat().st_size,
        "pieces": [], "wheels": [w.name for w in wheels], "parts": len(parts), "fa3": fa3, "stripped": list(strip),
        "lmcache": lmcache_manifest(lmc),
        "mooncake": mooncake_stage.manifest_entry(mc_debs, mc_trim) if mc_trim is not None else None,
    }
    for i, part in enumerate(parts, 1):
        for name, off, n in part:
            if name == TAR_NAME:
                manifest["pieces"].append({"part": i, "file": f"{TAR_NAME}.{off:012d}", "offset": off, "bytes": n})
    for old in out.glob("part*"):
        shutil.rmtree(old)
    for i, part in enumerate(parts, 1):
        d = out / f"part{i}"
        d.mkdir(parents=True)
        for name, off, n in part:
            if name == TAR_NAME:
                with open(src[name], "rb") as f_in, open(d / f"{TAR_NAME}.{off:012d}", "wb") as f_out:
                    f_in.seek(off)
                    f_out.write(f_in.read(n))
            else:
                shutil.copy2(src[name], d / name)
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def lmcache_manifest(wheels: list[Path]) -> dict | None:
    """The manifest's LMCache entry: version, wheels, their sha256 and bytes (None: not staged)."""
    if not wheels:
        return None
    return {"version": LMCACHE_VERSION, "wheels": [w.name for w in wheels],
            "sha256": {w.name: _sha256(w) for w in wheels}, "bytes": sum(w.stat().st_size for w in wheels)}


def server_kinds(man: dict) -> list[str]:
    """The serve part's server kinds a staged manifest allows (LMCache's only with its wheels)."""
    from .serve import SERVER_KINDS  # noqa: PLC0415 - stage.py stays stdlib-only on import

    from .engine import LMCACHE_KINDS  # noqa: PLC0415

    return [k for k in SERVER_KINDS if man.get("lmcache") or k not in LMCACHE_KINDS]


def part_sizes(out: Path) -> dict[str, int]:
    return {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in sorted(out.glob("part*"))}


# ---------------------------------------------------------------- device side
def stage(part_dir: Path, stage_dir: Path = STAGE_DIR) -> list[str]:
    """Copy one part into ``stage_dir``; return the tar pieces still missing."""
    man = json.loads((part_dir / "manifest.json").read_text())
    stage_dir.mkdir(parents=True, exist_ok=True)
    for f in part_dir.iterdir():
        shutil.copy2(f, stage_dir / f.name)
    return missing_pieces(man, stage_dir)


def missing_pieces(man: dict, stage_dir: Path) -> list[str]:
    need = ([p["file"] for p in man["pieces"]] + man["wheels"] + ((man.get("lmcache") or {}).get("wheels") or [])
            + mooncake_stage.staged_names(man.get("mooncake")))
    return [n for n in need if not (stage_dir / n).exists()]


def pip_target_command(target: Path, wheels: list[str]) -> list[str]:
    """pip installing ``wheels`` into ``target`` from the files alone: no index, no dependencies."""
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(target), *wheels]


def install_lmcache(man: dict, stage_dir: Path = STAGE_DIR, target: Path = LMCACHE_SITE) -> bool:
    """LMCache's staged wheels, sha256 checked, ``--no-deps`` into ``target`` (emptied first); False
    when the manifest has none (``target`` is left as it is)."""
    lmc = man.get("lmcache")
    if not lmc:
        return False
    if target.exists():
        shutil.rmtree(target)
    for name in lmc["wheels"]:
        got = _sha256(stage_dir / name)
        if got != lmc["sha256"][name]:
            raise StageError(f"{stage_dir / name}: sha256 {got}, manifest {lmc['sha256'][name]}; stage again")
    target.mkdir(parents=True)
    subprocess.run(pip_target_command(target, [str(stage_dir / w) for w in lmc["wheels"]]), check=True)
    (target / READY).write_text(json.dumps({"lmcache": lmc["version"], "wheels": lmc["sha256"]}))
    return True


def lmcache_ready(target: Path = LMCACHE_SITE) -> bool:
    return (target / "lmcache").is_dir() and (target / READY).exists()


def lmcache_status(target: Path = LMCACHE_SITE) -> str:
    if lmcache_ready(target):
        ver = json.loads((target / READY).read_text()).get("lmcache", "?")
        return f"LMCache {ver}: installed in {target} (server kinds lmcache, lmcache-disk)"
    return f"LMCache: not installed in {target} (no lmcache server kinds; prepare stages it from .cache/lmcache)"


def install(stage_dir: Path = STAGE_DIR, site: Path = SITE_DIR, lmcache_site: Path = LMCACHE_SITE) -> bool:
    """vLLM and its wheels into ``site``, LMCache's (when staged) into ``lmcache_site``; True when
    LMCache was installed."""
    man_path = stage_dir / "manifest.json"
    if not man_path.exists():
        raise StageError(f"nothing staged in {stage_dir}: the machine went cold; stage every part again")
    man = json.loads(man_path.read_text())
    miss = missing_pieces(man, stage_dir)
    if miss:
        parts = sorted({p["part"] for p in man["pieces"] if p["file"] in miss})
        raise StageError(f"missing in {stage_dir}: {miss[:4]}{'...' if len(miss) > 4 else ''} "
                         f"(tar parts {parts} or wheels); the machine may have gone cold between calls: "
                         f"stage every part again, back to back")
    tar = stage_dir / man["tar"]
    with open(tar, "wb") as out:
        for p in sorted(man["pieces"], key=lambda p: p["offset"]):
            with open(stage_dir / p["file"], "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if _sha256(tar) != man["tar_sha256"]:
        raise StageError(f"{tar}: sha256 mismatch; stage again")
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    with tarfile.open(tar, "r:xz") as t:
        t.extractall(site)
    tar.unlink()
    wheels = [str(stage_dir / w) for w in man["wheels"]]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    lmc = install_lmcache(man, stage_dir, lmcache_site)
    try:
        mooncake_stage.install(man.get("mooncake"), stage_dir)
    except (mooncake_stage.MooncakeStageError, OSError, subprocess.SubprocessError) as e:
        print(f"warning: Mooncake not installed ({e}): no pair part", file=sys.stderr, flush=True)
    (site / READY).write_text(json.dumps({"vllm": man["vllm"], "tar_sha256": man["tar_sha256"]}))
    return lmc


def is_ready(site: Path = SITE_DIR) -> bool:
    return (site / "vllm").is_dir() and (site / READY).exists()


def check(site: Path = SITE_DIR, lmcache_site: Path = LMCACHE_SITE) -> int:
    if is_ready(site):
        print(f"[check] vLLM {VLLM_VERSION} in {site}; {lmcache_status(lmcache_site)}; {mooncake_stage.status()}",
              flush=True)
        return 0
    print(COLD_MSG.format(site=site), file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_e2e.stage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="host: download, strip, pack into parts")
    p.add_argument("--out", default=os.environ.get("GPU_E2E_DIR", "/work/main/.gpu"))
    p.add_argument("--cache", default=os.environ.get("GPU_E2E_CACHE", str(Path.home() / ".cache/npu_offload_gpu_e2e")))
    p.add_argument("--part-bytes", type=int, default=DEFAULT_PART_BYTES)
    p.add_argument("--no-fa3", dest="fa3", action="store_false",
                   help="strip FlashAttention 3 too (one part less; no MLA layout on the device)")
    p.add_argument("--client-dir", default=None,
                   help="where to put vLLM's multi-turn client files (default: OUT/vllm_multi_turn)")
    p.add_argument("--sdist", action="append", default=[],
                   help="a local copy of vllm-0.23.0.tar.gz to use if its sha256 matches (repeatable)")
    p.add_argument("--lmcache-wheels", default=os.environ.get("LMCACHE_WHEELS", str(LMCACHE_DEFAULT_DIR)),
                   help="folder of LMCache's pinned wheels (lmcache_wheels.txt; default .cache/lmcache, "
                        "skipped when absent)")
    p.add_argument("--no-lmcache", action="store_true", help="stage without LMCache")
    p.add_argument("--mooncake-files", default=os.environ.get("MOONCAKE_FILES", str(mooncake_stage.DEFAULT_DIR)),
                   help="folder of Mooncake's pinned wheel and system packages (mooncake_files.txt; default "
                        ".cache/mooncake, skipped when absent)")
    p.add_argument("--no-mooncake", action="store_true", help="stage without Mooncake")
    s = sub.add_parser("stage", help="device: copy one part into the stage folder")
    s.add_argument("part_dir")
    sub.add_parser("install", help="device: unpack vLLM + install wheels into the site folder")
    sub.add_parser("check", help="device: exit 3 if nothing is installed (cold machine)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            lmc_dir = None if a.no_lmcache else Path(a.lmcache_wheels)
            mc_dir = None if a.no_mooncake else Path(a.mooncake_files)
            man = prepare(out, Path(a.cache), a.part_bytes, a.fa3, lmc_dir, mc_dir)
            sizes = part_sizes(out)
            for name, n in sizes.items():
                print(f"{out / name}: {n / 1e6:.1f} MB")
            lmc = man["lmcache"]
            print(f"{man['parts']} parts; vLLM tarball {man['tar_bytes'] / 1e6:.1f} MB "
                  f"({'with' if a.fa3 else 'without'} FlashAttention 3), {len(man['wheels'])} wheels"
                  + (f", LMCache {lmc['version']} ({len(lmc['wheels'])} wheels, {lmc['bytes'] / 1e6:.1f} MB)" if lmc
                     else "")
                  + (f", Mooncake {man['mooncake']['version']} ({man['mooncake']['bytes'] / 1e6:.1f} MB)"
                     if man["mooncake"] else ", no Mooncake (no pair part)"))
            print(f"server kinds: {', '.join(server_kinds(man))}"
                  + ("" if lmc else f" (no lmcache, lmcache-disk: no LMCache wheels in {lmc_dir or '(--no-lmcache)'}; "
                                    f"{LMCACHE_PINS.name} says how to fetch them)"))
            sdist = fetch_sdist(Path(a.cache), [Path(x) for x in a.sdist])
            client = extract_client(sdist, Path(a.client_dir) if a.client_dir else out / "vllm_multi_turn")
            print(f"vLLM's multi-turn client: {', '.join(client['files'])} from {client['sdist']} "
                  f"(sha256 {client['sdist_sha256'][:16]}...)")
            return 0
        if a.cmd == "stage":
            miss = stage(Path(a.part_dir))
            print(f"[stage] {a.part_dir} -> {STAGE_DIR}; still missing: {len(miss)} file(s)")
            return 0
        if a.cmd == "install":
            lmc = install()
            print(f"[install] vLLM {VLLM_VERSION} + wheels in {SITE_DIR}"
                  + (f"; LMCache {LMCACHE_VERSION} in {LMCACHE_SITE}" if lmc else "; no LMCache staged"))
            return 0
        return check()
    except (StageError, mooncake_stage.MooncakeStageError, subprocess.CalledProcessError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
