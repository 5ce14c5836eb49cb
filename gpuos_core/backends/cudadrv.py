"""A thin layer over the CUDA driver API (cuda.bindings.driver): one `check()` chokepoint that
raises with the decoded error, and the few memory helpers the CUDA backend needs."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt
from cuda.bindings import driver as cu

from ..errors import GpuosError

OK = cu.CUresult.CUDA_SUCCESS
NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY


class CudaError(GpuosError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def check(result: tuple[Any, ...], what: str) -> Any:
    """Unpack a driver result `(status, *values)`: None, the one value, or the tuple of values."""
    status, *values = result
    if status != OK:
        _, name = cu.cuGetErrorName(status)
        _, text = cu.cuGetErrorString(status)
        raise CudaError(
            f"{what} failed: {name.decode() if name else status} "
            f"({text.decode() if text else 'no description'})"
        )
    return values[0] if len(values) == 1 else tuple(values) or None


def host_array(ptr: int, nbytes: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A numpy view of `nbytes` of host memory at `ptr` (pinned or mapped allocations)."""
    raw = (ctypes.c_byte * nbytes).from_address(ptr)
    return np.frombuffer(memoryview(raw), dtype=np.uint8).view(dtype)


def kernel_params(*values: int) -> tuple[ctypes.Array, list[ctypes.c_uint64]]:
    """cuLaunchKernel's `void**` for 64-bit arguments (pointers and integers); keep both alive
    until the launch returned."""
    args = [ctypes.c_uint64(v) for v in values]
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args]), args


class PinnedBuffer:
    """Page-locked host memory, optionally mapped into the device's address space."""

    def __init__(self, nbytes: int, mapped: bool) -> None:
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | (cu.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.host = int(check(cu.cuMemHostAlloc(nbytes, flags), f"cuMemHostAlloc({nbytes})"))
        self.nbytes = nbytes
        self.device = (
            int(check(cu.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer"))
            if mapped
            else 0
        )

    def view(self, dtype: npt.DTypeLike) -> np.ndarray:
        return host_array(self.host, self.nbytes, dtype)

    def free(self) -> None:
        check(cu.cuMemFreeHost(self.host), "cuMemFreeHost")
