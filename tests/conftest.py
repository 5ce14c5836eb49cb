"""Suite-wide pytest hooks: tests marked `gpu` are skipped on machines without a CUDA device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gpuos_core import Runtime


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Adds a skip to every `gpu` item when torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # spares the torch import (seconds) when no GPU test was collected
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


# Backend-generic tests take the `backend` fixture: they run on the CPU backend everywhere and
# again on the CUDA backend where there is a GPU (`pytest -m gpu` selects just those).
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS, scope="module")
def backend(request: pytest.FixtureRequest) -> str:
    """Name of the runtime backend under test."""
    return request.param


@pytest.fixture(scope="module")
def tiled_rt(backend: str) -> Iterator[Runtime]:
    """A runtime on `backend`; on the CPU its tasks are tiled too (512 elements a record), so
    records that cover part of a task's work items run there as they do on a GPU."""
    from gpuos_core import Runtime

    with Runtime(backend) as runtime:
        if backend == "cpu":
            runtime.backend.tile_elements = 512
        yield runtime
