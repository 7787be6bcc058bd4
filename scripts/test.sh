#!/usr/bin/env bash
# The test command: sets up what is missing, then runs the default suite (pass -m slow for the
# long crash/resume sweeps; any other pytest arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
exec uv run --frozen pytest "$@"
