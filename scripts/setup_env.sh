#!/usr/bin/env bash
# Creates or updates .venv at the repository root so that scripts/serve.sh and scripts/test.sh run.
# Idempotent and quiet: a second run with an unchanged pyproject.toml installs nothing and prints
# nothing. Errors from python/pip stay visible.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.gpuos-pyproject.sha256"
# The CPU build of this torch is what a machine without a GPU gets from the configured indexes;
# a bare `torch` requirement would resolve to the CUDA build and pull gigabytes of CUDA wheels.
TORCH_PIN="torch==2.13.0"

say() { echo "setup_env: $*" >&2; }

# Prints the first interpreter, python3 preferred, whose version pyproject.toml accepts.
# Runs each one because a pyenv shim exists even where its version is not selected.
pick_python() {
    local py
    for py in python3 python3.11 python3.12 python3.13; do
        if "$py" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 13)))' \
            >/dev/null 2>&1; then
            echo "$py"
            return 0
        fi
    done
    say "no Python 3.11 to 3.13 found: install one (e.g. apt-get install python3.11-venv)"
    return 1
}

create_venv() {
    local py
    py="$(pick_python)"
    say "creating .venv with $("$py" --version)"
    "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -qq --upgrade pip
}

install_torch_if_missing() {
    # find_spec, not import: importing torch costs seconds on every run of the scripts.
    if ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'; then
        say "installing $TORCH_PIN"
        "$VENV/bin/python" -m pip install -qq "$TORCH_PIN"
    fi
}

install_project_if_changed() {
    local want
    want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
        return 0
    fi
    say "installing gpuos-serve (editable) with extras test,load"
    "$VENV/bin/python" -m pip install -qq -e "$ROOT[test,load]" -c "$ROOT/scripts/constraints.txt"
    echo "$want" >"$STAMP"
}

[[ -x "$VENV/bin/python" ]] || create_venv
install_torch_if_missing
install_project_if_changed
