#!/usr/bin/env bash
# Kept for old instructions: the vLLM 0.23.0 venv (.venv023) is now one of scripts/dev/setup_vllm.sh's.
# Usage: PY023=$(bash scripts/dev/setup_v023.sh)   (VENV023 still picks the venv path)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VLLM_VENV=${VENV023:-${VLLM_VENV:-$ROOT/.venv023}} exec bash "$ROOT/scripts/dev/setup_vllm.sh" 0.23.0
