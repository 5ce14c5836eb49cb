"""A thin layer over the CUDA driver API (cuda.bindings.driver): one `check()` chokepoint that
raises with the decoded error, and the few memory helpers the CUDA backend needs."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
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


_HELD_VERSION = 12000  # the CUDA version whose entry points `HeldDriver` takes (any 12+ driver)
_P, _U32, _SIZE, _U64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_uint64


class HeldDriver:
    """Driver calls that keep the GIL, for the submit path's short non-blocking ones (an enqueue
    or a query: microseconds). cuda.bindings lets the GIL go around every call, and a thread
    that lets it go while another thread is busy in Python waits up to the switch interval to
    have it back: under serving load an engine step made ~9 such calls and spent most of its
    time waiting (bench/NOTES.md, "where the replica's GIL goes"). Handles are raw integers
    (`int(stream)`); each call returns the driver's status. Never for a call that can block:
    holding the GIL there would stall every thread of the process. (An enqueue blocks only when
    its stream holds ~a thousand commands not yet run; the copy stream's are done in
    microseconds unless it waits for a producer's kernels, and then for those alone.)"""

    def __init__(self) -> None:
        self.stream_query = _held(b"cuStreamQuery", _P)
        self.event_query = _held(b"cuEventQuery", _P)
        self.event_record = _held(b"cuEventRecord", _P, _P)
        self.stream_wait_event = _held(b"cuStreamWaitEvent", _P, _P, _U32)
        self.memset_d32_async = _held(b"cuMemsetD32Async", _U64, _U32, _SIZE, _P)
        self.memcpy_htod_async = _held(b"cuMemcpyHtoDAsync", _U64, _P, _SIZE, _P)
        self.memcpy_dtoh_async = _held(b"cuMemcpyDtoHAsync", _P, _U64, _SIZE, _P)
        self.stream_write_value64 = _held(b"cuStreamWriteValue64", _P, _U64, _U64, _U32)


def _held(symbol: bytes, *argtypes: type) -> Callable[..., int]:
    """The driver's entry point for `symbol` as a ctypes function that keeps the GIL
    (PYFUNCTYPE), returning the CUresult as an int."""
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    found = check(cu.cuGetProcAddress(symbol, _HELD_VERSION, flags), symbol.decode())
    address = int(found[0] if isinstance(found, tuple) else found)
    if not address:
        raise CudaError(f"the driver has no {symbol.decode()} for CUDA {_HELD_VERSION}")
    return ctypes.PYFUNCTYPE(ctypes.c_int, *argtypes)(address)


def held_check(status: int, what: str) -> None:
    """`check` for a HeldDriver call's status."""
    if status:
        check((cu.CUresult(status),), what)
