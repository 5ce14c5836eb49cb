"""`gpuos-serve`: each command word hands what follows it to the right program, unchanged.

`bench` and `serve` replace the process (os.execv); the tests record the command line instead.
Building through the installed console script is tested in tests/integration/test_wheel.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuos_serve import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def executed(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Command lines `os.execv` was given, instead of running them."""
    lines: list[list[str]] = []
    monkeypatch.setattr(cli.os, "execv", lambda path, line: lines.append(line))
    return lines


def test_a_checkout_runs_its_own_scripts_and_configs() -> None:
    assert cli.BENCH_DIR == ROOT / "bench" and cli.CONFIG_DIR == ROOT / "deployments"
    assert {"micro", "sched", "kernels", "llm"} <= set(cli.bench_scripts())


def test_bench_passes_the_arguments_on(executed: list[list[str]]) -> None:
    cli.main(["bench", "micro", "--quick", "--out", "x"])
    assert executed == [[sys.executable, str(ROOT / "bench" / "micro.py"), "--quick", "--out", "x"]]


def test_bench_refuses_an_unknown_script(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "nope"])
    assert exited.value.code == 2 and "micro" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, config, rest",
    [
        (["serve"], ROOT / "deployments" / "llm.yaml", []),
        (["serve", "--address", "auto"], ROOT / "deployments" / "llm.yaml", ["--address", "auto"]),
        (
            ["serve", "multi.yaml", "--non-blocking"],
            ROOT / "deployments" / "multi.yaml",
            ["--non-blocking"],
        ),
        (["serve", "deployments/llm.yaml"], Path("deployments/llm.yaml"), []),
    ],
)
def test_serve_runs_serve_run_on_a_config(
    executed: list[list[str]], argv: list[str], config: Path, rest: list[str]
) -> None:
    cli.main(argv)
    assert executed == [[sys.executable, "-m", "ray.serve.scripts", "run", str(config), *rest]]


def test_build_takes_its_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["build", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and all(o in out for o in ("--arch", "--jobs"))


def test_build_refuses_a_job_count_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["build", "--jobs", "0"])
    assert exited.value.code == 2
    assert "--jobs takes a count of at least 1" in capsys.readouterr().err
