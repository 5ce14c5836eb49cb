"""`gpuos-serve`: build the CUDA image, run a benchmark, or start the Serve app.

    gpuos-serve build [--arch sm_86] [--jobs N]    # compile and link every unit (no GPU)
    gpuos-serve bench micro [--quick] [--out DIR]  # bench/<name>.py, arguments passed on
    gpuos-serve serve [CONFIG] [serve run options] # `serve run` (default: llm.yaml)

`bench` and `serve` hand the process over (exec) to the script or to Ray's command line, so
signals, exit status and output are theirs. Installed, the scripts and configs come from the
package; in a checkout, from its bench/ and deployments/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gpuos_core.build import main as build_main
from gpuos_core.paths import shipped

PACKAGE = Path(__file__).resolve().parent
BENCH_DIR = shipped(PACKAGE, "bench")
CONFIG_DIR = shipped(PACKAGE, "deployments")


def bench_scripts() -> list[str]:
    """The benchmark names `gpuos-serve bench` takes (bench/<name>.py)."""
    return sorted(p.stem for p in BENCH_DIR.glob("*.py"))


def bench_command(name: str, args: list[str]) -> list[str]:
    """The command line that runs benchmark `name` with `args`."""
    return [sys.executable, str(BENCH_DIR / f"{name}.py"), *args]


def serve_command(config: str | None, args: list[str]) -> list[str]:
    """The `serve run` command line for `config` (a path, or the name of a shipped config)."""
    path = Path(config) if config else CONFIG_DIR / "llm.yaml"
    if config and not path.exists() and (CONFIG_DIR / config).exists():
        path = CONFIG_DIR / config
    return [sys.executable, "-m", "ray.serve.scripts", "run", str(path), *args]


def parser() -> argparse.ArgumentParser:
    """The command word's parser; what follows the word belongs to the command."""
    commands = argparse.ArgumentParser(
        prog="gpuos-serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands.add_argument("command", choices=("build", "bench", "serve"))
    return commands


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gpuos-serve` console script."""
    argv = sys.argv[1:] if argv is None else argv
    words = parser()
    command, rest = words.parse_args(argv[:1]).command, argv[1:]
    if command == "build":
        return build_main(rest)
    if command == "bench":
        if not rest or rest[0] not in bench_scripts():
            words.error(f"bench takes one of {', '.join(bench_scripts())}, then its arguments")
        line = bench_command(rest[0], rest[1:])
    else:
        config = rest[0] if rest and not rest[0].startswith("-") else None
        line = serve_command(config, rest[1:] if config else rest)
    os.execv(line[0], line)
    return 1  # not reached: execv replaces the process or raises


if __name__ == "__main__":
    sys.exit(main())
