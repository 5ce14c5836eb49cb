"""The wheel, tried as a new user would: built from the checkout, installed into a fresh venv
outside it, then `python -m gpuos_core.build` and `gpuos-serve build` compile and link every unit
from the CUDA sources the wheel installed.

No network and no second download of torch: the venv's site-packages links to every distribution
.venv already holds (what pip would have installed), except gpuos-serve's own editable install,
which points back into the checkout; the wheel goes in with --no-deps. Commands run from a
temporary folder, so the checkout is not on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the build reads from the checkout (pyproject.toml maps the folders into packages).
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "gpuos_core",
    "serving",
    "gpuos_serve",
    "cuda",
    "bench",
    "deployments",
)
OWN = ("gpuos_serve", "__editable__")  # site-packages entries of the editable install


def run(*command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a command; its stdout, or a failure showing its output."""
    # The limit catches a hang, not slowness: the cold build of every unit takes 2-4 minutes on
    # CI's two cores.
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the checkout (the build writes into its source folder)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(
            ROOT / name,
            source / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}),
        )
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        dist,
        source,
    )
    (built,) = dist.glob("gpuos_serve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; returns its bin folder."""
    home = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", home)
    python = home / "bin" / "python"
    site = Path(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    )
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(OWN):
            (site / entry.name).symlink_to(entry)
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)
    return home / "bin"


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    """A new user's environment: a fresh JIT cache, no source override, no checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUOS_CUDA_DIR", "PYTHONPATH")}
    return {**env, "GPUOS_CACHE_DIR": str(tmp_path / "cache")}


def test_the_wheel_holds_every_module_and_cuda_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {
        p.relative_to(ROOT).as_posix()
        for package in ("gpuos_core", "serving", "gpuos_serve")
        for p in (ROOT / package).rglob("*.py")
    }
    cuda = {
        f"gpuos_core/{p.relative_to(ROOT).as_posix()}"
        for p in (ROOT / "cuda").rglob("*")
        if p.is_file()
    }
    assert modules | cuda | {"gpuos_serve/deployments/llm.yaml"} <= names
    assert not [n for n in names if n.startswith("cuda/")], "cuda-bindings owns the cuda package"
    assert any(n.endswith("/licenses/LICENSE") for n in names)


def test_installed_package_builds_every_unit_from_its_own_sources(
    venv: Path, tmp_path: Path, user_env: dict[str, str]
) -> None:
    where = run(
        venv / "python",
        "-c",
        "import gpuos_core.paths as p; print(p.CUDA_DIR)",
        cwd=tmp_path,
        env=user_env,
    )
    assert Path(where.strip()).is_relative_to(venv.parent), "sources outside the installation"
    out = run(venv / "python", "-m", "gpuos_core.build", cwd=tmp_path, env=user_env)
    print(out)  # the CI log shows every unit
    assert "linked image of" in out and "compiled" in out and "cached" not in out
    again = run(venv / "gpuos-serve", "build", cwd=tmp_path, env=user_env)  # the console script
    assert "linked image of" in again and "compiled" not in again
