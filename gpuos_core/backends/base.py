"""The contract every backend fulfils."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from ..abi import TASK
from ..batch import Batch
from ..optable import Image


class Backend(ABC):
    """Executes batches of encoded tasks against the image it has loaded."""

    name: str  # "cpu" or "cuda"
    device: torch.device  # where task tensors must live
    needs_image_binary = False  # True: load() needs the linked cubin (see Runtime)
    arch: str | None = None  # the NVRTC target this backend's device needs (None: any)
    tile_elements: int | None = None  # split tasks into records of about this much work
    broken: str | None = None  # set when the backend refuses all further work, and why

    def host_records(self, n: int) -> np.ndarray:
        """Room for n TASK records where `launch` reads them best (page-locked on CUDA, so a
        batch's records are copied to the device without staging)."""
        return np.empty(n, dtype=TASK)

    @abstractmethod
    def load(self, image: Image, binary: bytes | None) -> None:
        """Make `image` the one that executes. The runtime calls this with no batch in flight."""

    @abstractmethod
    def launch(self, batch: Batch) -> None:
        """Start executing `batch`, its uploads before any of its records; the backend calls
        `batch.complete()` exactly once, from any thread, after every task finished or failed."""

    def read(self, src: torch.Tensor, dst: np.ndarray) -> None:
        """Copy contiguous `src`, which completed work wrote, into `dst` (host memory of the
        same bytes); returns once `dst` holds it."""
        dst.reshape(-1).view(np.uint8)[:] = src.numpy().reshape(-1).view(np.uint8)

    @abstractmethod
    def close(self) -> None:
        """Finish what was launched, then release resources."""
