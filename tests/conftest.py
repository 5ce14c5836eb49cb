"""Suite-wide pytest hooks: tests marked `gpu` are skipped on machines without a CUDA device."""
from __future__ import annotations

import pytest


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
