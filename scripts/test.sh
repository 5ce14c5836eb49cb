#!/usr/bin/env bash
# Sets up .venv if needed, then runs pytest from the repository root.
# Arguments go to pytest; with none, the linters run first (ruff, then mypy; configured in
# pyproject.toml, any finding or unformatted file fails the run) and then every test, quietly.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# Tests start local Ray clusters; they have no reason to report usage anywhere.
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
if (($# == 0)); then
    .venv/bin/ruff check --quiet
    .venv/bin/ruff format --check --quiet
    .venv/bin/mypy
    # The full run then compiles every CUDA source and catalogue operator with NVRTC and links
    # them into a worker image (cached; no GPU needed), printing one line per unit.
    .venv/bin/python -m gpuos_core.build
    set -- -q
fi
exec .venv/bin/python -m pytest "$@"
