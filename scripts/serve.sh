#!/usr/bin/env bash
# Sets up .venv if needed, then starts the main Serve application in the foreground.
# Extra arguments go to `serve run` (e.g. --address=auto to use a running Ray cluster).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# shellcheck disable=SC1091
source .venv/bin/activate
exec serve run deployments/llm.yaml "$@"
