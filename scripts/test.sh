#!/usr/bin/env bash
# Sets up .venv if needed, then runs pytest from the repository root.
# Arguments go to pytest; with none, every test runs quietly (-q).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# Tests start local Ray clusters; they have no reason to report usage anywhere.
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
if (($# == 0)); then
    # The full run first compiles every CUDA source and catalogue operator with NVRTC and links
    # them into a worker image (cached; no GPU needed), printing one line per unit.
    .venv/bin/python -m gpuos_core.build
    set -- -q
fi
exec .venv/bin/python -m pytest "$@"
