#!/usr/bin/env bash
# The test command: sets up what is missing, then runs the default suite (pass -m slow for the
# long crash/resume sweeps; any other pytest arguments pass through). Two pytest workers, a test
# file each (so a module's server is started once): the end-to-end tests wait on servers and
# stage processes much of the time, and a second worker fills it. EAGLE3_TEST_WORKERS=0 runs
# everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.local/bin:$PATH"
workers="${EAGLE3_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec uv run --frozen pytest "$@"
fi
exec uv run --frozen pytest -n "$workers" --dist loadfile "$@"
