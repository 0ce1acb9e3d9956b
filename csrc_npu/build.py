"""Build libnpu_offload_acl.so (and, for tests, libacl_emulation.so) with the C compiler.

Plain C, no torch/CANN link: ACL entry points are resolved at run time, so only the
ACL *headers* are needed, found in this order:
  1. ``$ASCEND_TOOLKIT_HOME`` / ``$ASCEND_HOME_PATH`` (``include/`` or ``<arch>-linux/include/``)
  2. an installed ``torch_npu`` (located with importlib, never imported: it needs CANN)
  3. ``$NPU_OFFLOAD_ACL_INCLUDE`` (e.g. headers unpacked by ``fetch_headers.py``)
Toggle ``VLLM_ASCEND_ENABLE_BATCH_MEMCPY``: ``1`` builds the aclrtMemcpyBatchAsync path
(failing if the headers lack it), ``0`` the aclrtMemcpyAsync loop only, unset probes the
headers. ``CC`` picks the compiler (default ``cc``).

    python csrc_npu/build.py [--out DIR] [--emulation]
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

LIBRARY = "libnpu_offload_acl.so"
EMULATION = "libacl_emulation.so"
SOURCES = ("acl_symbols.c", "errors.c", "batch_copy.c", "loop_copy.c", "host_register.c", "info.c", "events.c",
           "staged_run.c", "staged_plan.c")
COMMON = "csrc_common"  # beside csrc_npu: headers shared with csrc_cuda (staged_plan_core.h)
TOGGLE = "VLLM_ASCEND_ENABLE_BATCH_MEMCPY"
# Warnings are errors only where they mean a wrong call; other compilers' new warnings must not
# break a build on an Ascend box. The ACL headers are -isystem: their own warnings are not ours.
CFLAGS = ("-std=c11", "-O2", "-fPIC", "-Wall", "-Wextra", "-Werror=implicit-function-declaration",
          "-Werror=incompatible-pointer-types", "-Werror=int-conversion", "-fvisibility=hidden")
# --no-undefined proves no ACL symbol is linked directly: the .so loads without CANN.
LDFLAGS = ("-shared", "-Wl,--no-undefined", "-ldl", "-lpthread")


class ToolkitMissing(RuntimeError):
    """No ACL headers or no C compiler: setup.py skips the NPU backend unless it is required."""


class BuildFailed(RuntimeError):
    """The toolkit is there but the build cannot do what was asked (e.g. batch without the API)."""


def _has_acl(include: Path) -> bool:
    return (include / "acl" / "acl_rt.h").is_file()


def find_acl_include() -> tuple[Path, str]:
    """(include dir, where it came from); raises ToolkitMissing listing every place tried."""
    tried = []
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        home = os.environ.get(var)
        if home:
            for inc in (Path(home) / "include", Path(home) / f"{platform.machine()}-linux" / "include"):
                if _has_acl(inc):
                    return inc, f"${var}"
                tried.append(f"${var} -> {inc}")
    spec = importlib.util.find_spec("torch_npu")  # top-level package: not executed
    if spec and spec.submodule_search_locations:
        inc = Path(list(spec.submodule_search_locations)[0]) / "include"
        if _has_acl(inc):
            return inc, "torch_npu"
        tried.append(f"torch_npu -> {inc}")
    explicit = os.environ.get("NPU_OFFLOAD_ACL_INCLUDE")
    if explicit:
        if _has_acl(Path(explicit)):
            return Path(explicit), "$NPU_OFFLOAD_ACL_INCLUDE"
        tried.append(f"$NPU_OFFLOAD_ACL_INCLUDE -> {explicit}")
    raise ToolkitMissing(
        "no ACL headers (acl/acl_rt.h) found; tried: " + ("; ".join(tried) or "nothing set")
        + ". Source CANN's set_env.sh, install torch_npu, or set NPU_OFFLOAD_ACL_INCLUDE to the "
        "output of `python csrc_npu/fetch_headers.py`"
    )


def find_compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or not shutil.which(cc[0]):
        raise ToolkitMissing(f"C compiler {cc[0] if cc else '(empty $CC)'!r} not found; install gcc or set CC")
    return cc


# Each probe compiles against the headers with the exact signature this library calls.
_PROBES = {
    "BATCH_V1": "aclError (*f)(void **, size_t *, void **, size_t *, size_t, aclrtMemcpyBatchAttr *, size_t *,"
    " size_t, size_t *, aclrtStream) = aclrtMemcpyBatchAsync;",
    "BATCH_V2": "aclError (*f)(void **, size_t *, void **, size_t *, size_t, aclrtMemcpyBatchAttr *, size_t *,"
    " size_t, aclrtStream) = aclrtMemcpyBatchAsyncV2;",
    "EVENT_EX": "aclError (*f)(aclrtEvent *, uint32_t) = aclrtCreateEventExWithFlag;"
    " unsigned long flag = ACL_EVENT_SYNC; (void)flag;",
    "HOST_REGISTER_V2": "aclError (*f)(void *, uint64_t, uint32_t) = aclrtHostRegisterV2;"
    " aclError (*g)(void *) = aclrtHostUnregister; (void)g; unsigned long flag = ACL_HOST_REG_PINNED; (void)flag;",
}
_BATCH_TYPES = ("aclrtMemcpyBatchAttr a = {0}; a.srcLoc.type = ACL_MEM_LOCATION_TYPE_HOST;"
                " a.dstLoc.type = ACL_MEM_LOCATION_TYPE_DEVICE; a.dstLoc.id = 0; (void)a;")


def probe(cc: list[str], include: Path, feature: str) -> bool:
    """Does ``feature`` (a key of _PROBES) compile against these headers?"""
    body = _PROBES[feature] + (" " + _BATCH_TYPES if feature.startswith("BATCH") else "")
    src = f"#include <acl/acl_rt.h>\nint main(void) {{ {body} (void)f; return 0; }}\n"
    with tempfile.TemporaryDirectory() as d:
        c = Path(d) / "probe.c"
        c.write_text(src)
        r = subprocess.run([*cc, "-std=c11", "-Werror", "-fsyntax-only", "-isystem", str(include), str(c)],
                           capture_output=True, text=True)
    return r.returncode == 0


def batch_mode(cc: list[str], include: Path, declared: dict[str, bool]) -> bool:
    """Apply the toggle: True builds the batch path."""
    value = os.environ.get(TOGGLE, "").strip()
    have = declared["BATCH_V1"] or declared["BATCH_V2"]
    if value == "1":
        if not have:
            raise BuildFailed(
                f"{TOGGLE}=1 but the ACL headers in {include} declare neither aclrtMemcpyBatchAsync nor "
                "aclrtMemcpyBatchAsyncV2 with the expected signature (CANN >= 8.5 needed); use "
                f"{TOGGLE}=0 for the per-copy loop"
            )
        return True
    if value == "0":
        return False
    if value:
        raise BuildFailed(f"{TOGGLE}={value!r} is not allowed; use 1 (batch), 0 (loop) or leave it unset (probe)")
    return have


def _compile(cc: list[str], include: Path, sources: list[Path], out: Path, defines: list[str],
             extra: tuple[str, ...] = ()) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = [*cc, *CFLAGS, *extra, "-isystem", str(include), *[f"-D{d}" for d in defines], *map(str, sources),
           "-o", str(tmp), *LDFLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildFailed(f"compiling {out.name} failed:\n$ {shlex.join(cmd)}\n{r.stdout}{r.stderr}")
    os.replace(tmp, out)  # never leave a half-written library for a running process to load


def build(src_dir: Path, out_dir: Path, required: bool = False) -> list[str]:
    """Build libnpu_offload_acl.so into ``out_dir``; returns the built file names.

    ``required`` is accepted for setup.py's interface: missing headers always raise
    ToolkitMissing and setup.py decides whether that is fatal.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    cc = find_compiler()
    include, origin = find_acl_include()
    declared = {k: probe(cc, include, k) for k in _PROBES}
    batch = batch_mode(cc, include, declared)
    defines = [f"NPU_OFFLOAD_DECLARED_{k}" for k, ok in declared.items() if ok]
    defines.append(f'NPU_OFFLOAD_HEADERS_ORIGIN="{origin}"')
    if batch:
        defines.append("NPU_OFFLOAD_BATCH_MEMCPY")
    common = (f"-I{src_dir.parent / COMMON}",)
    _compile(cc, include, [src_dir / s for s in SOURCES], out_dir / LIBRARY, defines, common)
    mode = "batch" if batch else "loop"
    print(f"[csrc_npu] {LIBRARY}: mode={mode}, headers {include} ({origin}), declared "
          f"{sorted(k for k, ok in declared.items() if ok)}")
    return [LIBRARY]


def build_emulation(src_dir: Path, out_dir: Path, include: Path | None = None) -> Path:
    """Build the ACL test double (tests only; never installed)."""
    cc = find_compiler()
    include = include or find_acl_include()[0]
    out = Path(out_dir) / EMULATION
    # The emulation exports the ACL names themselves: default visibility.
    _compile(cc, include, [Path(src_dir) / "acl_emulation.c"], out, [], ("-fvisibility=default",))
    return out


if __name__ == "__main__":
    import argparse

    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description="build csrc_npu (see module docstring)")
    ap.add_argument("--out", type=Path, default=here.parent / "vllm_npu_offload" / "_native")
    ap.add_argument("--emulation", action="store_true", help="also build the ACL emulation (tests)")
    args = ap.parse_args()
    print(build(here, args.out, required=True))
    if args.emulation:
        print(build_emulation(here, args.out))
