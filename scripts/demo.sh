#!/usr/bin/env bash
# The README's first command: the whole pipeline (01b -> tokenize -> 02 -> 03 -> 04 -> 05) on the
# bundled tiny trained target, on this CPU, in real vLLM. Sets up what is missing first; rerunning
# it after an interruption continues where it stopped. Output under runs/demo (see scripts/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
exec uv run --frozen python scripts/demo.py "$@"
