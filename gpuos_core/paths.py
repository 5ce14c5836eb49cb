"""Where the runtime finds its CUDA sources and keeps its caches."""
from __future__ import annotations

import os
from pathlib import Path

# The repository's cuda/ folder; GPUOS_CUDA_DIR points it elsewhere (e.g. an installed copy).
_REPO_CUDA_DIR = Path(__file__).resolve().parent.parent / "cuda"
CUDA_DIR: Path = Path(os.environ.get("GPUOS_CUDA_DIR") or _REPO_CUDA_DIR)


def cache_dir() -> Path:
    """Return the root of gpuos' on-disk caches, creating it: $GPUOS_CACHE_DIR or ~/.cache/gpuos."""
    root = Path(os.environ.get("GPUOS_CACHE_DIR") or Path.home() / ".cache" / "gpuos")
    root.mkdir(parents=True, exist_ok=True)
    return root
