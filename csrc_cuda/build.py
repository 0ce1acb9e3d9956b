"""Build ``libnpu_offload_cuda.so``: a plain C-ABI library needing only ``cuda.h``.

No ``-lcuda`` and no CUDA runtime: the driver is resolved at run time, so the host C++
compiler and the toolkit headers are all the copy-engine part needs. The one kernel
(the device-local gather, ``gather_kernel.cu``) is compiled by nvcc into a fatbin that
is embedded in the library and loaded with cuModuleLoadData; without nvcc the library
is built without it (staged copies then gather with Triton).

``NPU_OFFLOAD_CUDA_BATCH_MEMCPY`` = 1 (cuMemcpyBatchAsync, fails without CUDA >= 12.8
headers) | 0 (cuMemcpyAsync loop only) | unset (probe the headers).
``NPU_OFFLOAD_CUDA_GATHER`` = 1 (the kernel; fails without nvcc) | 0 (no kernel) | unset
(build it when nvcc is found). ``NPU_OFFLOAD_CUDA_ARCHS`` = SM versions to compile for,
e.g. ``90`` or ``80,90,100`` (default below; PTX of the lowest is added for newer GPUs).

Usable from setup.py (``build(src_dir, out_dir, required)``) and as a script:
``python csrc_cuda/build.py [--out DIR] [--batch 1|0]``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LIB_NAME = "libnpu_offload_cuda.so"
SOURCES = ("driver.cc", "loop_copy.cc", "batch_copy.cc", "mode.cc", "gather_launch.cc", "staged_run.cc",
           "staged_plan.cc", "streams.cc")
KERNEL = "gather_kernel.cu"
COMMON = "csrc_common"  # beside csrc_cuda: headers shared with csrc_npu (staged_plan_core.h)
ENV_BATCH = "NPU_OFFLOAD_CUDA_BATCH_MEMCPY"
ENV_GATHER = "NPU_OFFLOAD_CUDA_GATHER"
ENV_ARCHS = "NPU_OFFLOAD_CUDA_ARCHS"
DEFAULT_ARCHS = (80, 90, 100, 120)


class ToolkitMissing(RuntimeError):
    """No CUDA toolkit (cuda.h) or no compiler: the CUDA backend is skipped."""


def _candidate_roots() -> list[Path]:
    roots = [os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        roots.append(str(real.parent.parent))
        roots.extend(_roots_from_nvcc(real))
    roots.append("/usr/local/cuda")
    roots.extend(sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True))
    return [Path(r) for r in roots if r]


def _roots_from_nvcc(nvcc: Path) -> list[str]:
    """nvcc may be a wrapper script; its dry run prints the toolkit's real TOP folder."""
    try:
        out = subprocess.run([str(nvcc), "--dryrun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"TOP=(\S+)", out.stdout + out.stderr)


def find_cuda_include() -> Path:
    """The folder holding cuda.h, or ToolkitMissing naming where it looked."""
    tried = []
    for root in _candidate_roots():
        for inc in (root / "include", root / "targets" / "x86_64-linux" / "include",
                    root / "targets" / "sbsa-linux" / "include"):
            if (inc / "cuda.h").exists():
                return inc.resolve()
            tried.append(str(inc))
    raise ToolkitMissing("cuda.h not found (set CUDA_HOME); looked in: " + ", ".join(dict.fromkeys(tried)))


def find_compiler() -> list[str]:
    for cxx in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cxx and shutil.which(cxx):
            return [cxx, "-x", "cu"] if Path(cxx).name == "nvcc" else [cxx]
    nvcc = shutil.which("nvcc")
    if nvcc:
        return [nvcc, "-x", "cu"]  # compiles the host code with its own host compiler
    raise ToolkitMissing("no C++ compiler (c++/g++/clang++/nvcc) on PATH")


def _is_nvcc(cxx: list[str]) -> bool:
    return Path(cxx[0]).name == "nvcc"


_PROBE = """#include <cuda.h>
#if !defined(CUDA_VERSION) || CUDA_VERSION < 12080
#error old
#endif
CUmemcpyAttributes a; int x = CU_MEMCPY_SRC_ACCESS_ORDER_ANY;
"""


def probe_batch(cxx: list[str], inc: Path) -> bool:
    """True when cuda.h declares the cuMemcpyBatchAsync types (CUDA >= 12.8)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cc"
        src.write_text(_PROBE)
        cmd = cxx + ["-c", f"-I{inc}", str(src), "-o", str(Path(tmp) / "probe.o")]
        return subprocess.run(cmd, capture_output=True, cwd=tmp).returncode == 0


def batch_mode(cxx: list[str], inc: Path, override: str | None = None) -> bool:
    flag = (override if override is not None else os.environ.get(ENV_BATCH, "")).strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{ENV_BATCH}={flag!r}; allowed: 1 (batch), 0 (loop), unset (auto)")
    if flag == "0":
        return False
    ok = probe_batch(cxx, inc)
    if flag == "1" and not ok:
        raise RuntimeError(f"{ENV_BATCH}=1 but cuda.h in {inc} is older than CUDA 12.8 (no cuMemcpyBatchAsync)")
    return ok


def archs(override: str | None = None) -> list[int]:
    raw = (override if override is not None else os.environ.get(ENV_ARCHS, "")).strip()
    if not raw:
        return list(DEFAULT_ARCHS)
    try:
        vals = sorted({int(x) for x in re.split(r"[,;\s]+", raw) if x})
    except ValueError:
        vals = []
    if not vals or any(v < 75 for v in vals):
        raise ValueError(f"{ENV_ARCHS}={raw!r}; allowed: SM versions >= 75 separated by commas, e.g. 90 or 80,90")
    return vals


def find_nvcc() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for root in _candidate_roots():
        if (root / "bin" / "nvcc").exists():
            return str(root / "bin" / "nvcc")
    return None


def gather_mode(override: str | None = None) -> str | None:
    """The nvcc that compiles the gather kernel, or None to build without it."""
    flag = (override if override is not None else os.environ.get(ENV_GATHER, "")).strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{ENV_GATHER}={flag!r}; allowed: 1 (build the kernel), 0 (skip it), unset (auto)")
    if flag == "0":
        return None
    nvcc = find_nvcc()
    if flag == "1" and nvcc is None:
        raise RuntimeError(f"{ENV_GATHER}=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    return nvcc


def compile_fatbin(nvcc: str, src_dir: Path, tmp: Path, sm: list[int]) -> Path:
    """gather_kernel.cu -> a C++ file embedding its fatbin (SASS per arch + PTX of the lowest)."""
    fatbin = tmp / "gather.fatbin"
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in sm] + [f"-gencode=arch=compute_{sm[0]},code=compute_{sm[0]}"]
    cmd = [nvcc, "-fatbin", "-O3", "-std=c++17", f"-I{src_dir}", *gencode, str(src_dir / KERNEL), "-o", str(fatbin)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {KERNEL} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
    data = fatbin.read_bytes()
    rows = (",".join(str(b) for b in data[i:i + 64]) for i in range(0, len(data), 64))
    embed = tmp / "gather_fatbin.cc"
    embed.write_text("// Generated by csrc_cuda/build.py from gather_kernel.cu; do not edit.\n"
                     "extern \"C\" {\n__attribute__((aligned(64))) extern const unsigned char npo_gather_fatbin[];\n"
                     "__attribute__((aligned(64))) const unsigned char npo_gather_fatbin[] = {\n"
                     + ",\n".join(rows) + "\n};\n}\n")
    return embed


def build(src_dir: Path, out_dir: Path, required: bool = False, batch: str | None = None,
          gather: str | None = None) -> list[str]:
    """Compile the library into ``out_dir``; returns the paths built.

    Raises ToolkitMissing when cuda.h or a compiler is absent (setup.py then skips
    the backend unless ``required``), RuntimeError when compilation fails.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    inc = find_cuda_include()
    cxx = find_compiler()
    use_batch = batch_mode(cxx, inc, batch)
    nvcc = gather_mode(gather)
    sm = archs() if nvcc else []
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / LIB_NAME
    flags = ["-O2", "-std=c++17", "-shared", f"-I{inc}", f"-I{src_dir}", f"-I{src_dir.parent / COMMON}",
             f"-DNPO_BATCH_MEMCPY={int(use_batch)}", f"-DNPO_GATHER_KERNEL={int(bool(nvcc))}"]
    if _is_nvcc(cxx):
        flags += ["-Xcompiler", "-fPIC,-fvisibility=hidden,-Wall"]
    else:
        flags += ["-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"]
    tmp_out = out.with_suffix(".so.tmp")
    with tempfile.TemporaryDirectory() as tmp:
        extra = [str(compile_fatbin(nvcc, src_dir, Path(tmp), sm))] if nvcc else []
        cmd = cxx + flags + [str(src_dir / s) for s in SOURCES] + extra + ["-ldl", "-lpthread", "-o", str(tmp_out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"building {LIB_NAME} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
    os.replace(tmp_out, out)  # atomic: a loaded old copy stays valid
    mode = "cuMemcpyBatchAsync" if use_batch else "cuMemcpyAsync loop"
    kernel = f"gather kernel for sm_{',sm_'.join(map(str, sm))}" if nvcc else "no gather kernel"
    print(f"[csrc_cuda] built {out} ({mode}; {kernel}; cuda.h from {inc})")
    return [str(out)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(here.parent / "vllm_npu_offload" / "_native"))
    ap.add_argument("--batch", choices=("1", "0", "auto"), default=None)
    ap.add_argument("--gather", choices=("1", "0", "auto"), default=None)
    args = ap.parse_args(argv)
    batch = None if args.batch in (None,) else ("" if args.batch == "auto" else args.batch)
    gather = None if args.gather in (None,) else ("" if args.gather == "auto" else args.gather)
    try:
        build(here, Path(args.out), required=True, batch=batch, gather=gather)
    except ToolkitMissing as e:
        print(f"[csrc_cuda] toolkit missing: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
