"""Where the runtime finds its CUDA sources and keeps its caches."""

from __future__ import annotations

import os
from pathlib import Path


def shipped(package: Path, name: str) -> Path:
    """The folder `name` that ships with the package in folder `package`: inside the package when
    installed from a wheel (pyproject.toml maps it in as package data), else at the root of the
    checkout, beside the package. Installed, it must be inside: `package.parent` is then
    site-packages, whose `cuda` is cuda-bindings' own package."""
    inside = package / name
    return inside if inside.is_dir() else package.parent / name


# The CUDA sources; GPUOS_CUDA_DIR points it elsewhere (e.g. operators under development).
CUDA_DIR: Path = Path(
    os.environ.get("GPUOS_CUDA_DIR") or shipped(Path(__file__).resolve().parent, "cuda")
)


def cache_dir() -> Path:
    """Return the root of gpuos' on-disk caches, creating it: $GPUOS_CACHE_DIR or ~/.cache/gpuos."""
    root = Path(os.environ.get("GPUOS_CACHE_DIR") or Path.home() / ".cache" / "gpuos")
    root.mkdir(parents=True, exist_ok=True)
    return root
