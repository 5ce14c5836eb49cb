"""CPU backend: executes the same task descriptors as the GPU, with torch on the CPU.

A real backend, not a mock: each task is decoded from its ABI record (address, sizes, strides in
elements, dtype), computed in fp32 from those views, and written through the encoded output view
for the work items [range_begin, range_end) the record names. A dedicated thread plays the device,
so submission is asynchronous exactly as on the GPU.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading

import numpy as np
import torch

from ..abi import CODE_DTYPES, ref_shape, ref_strides
from ..batch import Batch
from ..calls import Params
from ..optable import Image
from .base import Backend

log = logging.getLogger("gpuos.cpu")


def decode(ref: np.void) -> torch.Tensor:
    """A tensor viewing the memory an encoded TensorRef describes (no copy)."""
    dtype = CODE_DTYPES[int(ref["dtype"])]
    shape, strides = ref_shape(ref), ref_strides(ref)
    if int(ref["numel"]) == 0:
        return torch.empty(shape, dtype=dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (span * itemsize)).from_address(int(ref["data"]))
    return torch.frombuffer(buf, dtype=dtype, count=span).as_strided(shape, strides)


def write_items(out: torch.Tensor, value: torch.Tensor, begin: int, end: int, row_items: bool
                ) -> None:
    """Store `value` (shaped like `out`) into `out` for work items [begin, end): output elements
    in row-major order, or whole rows of the last dim when `row_items`."""
    width = out.shape[-1] if row_items and out.dim() else 1
    if begin == 0 and end * width == out.numel():
        out.copy_(value)
        return
    index = torch.arange(begin * width, end * width)
    offsets = torch.zeros_like(index)
    for size, stride in zip(reversed(out.shape), reversed(out.stride())):
        offsets += (index % size) * stride
        index //= size
    flat = out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,), 0)
    flat[offsets + out.storage_offset()] = value.reshape(-1)[begin * width:end * width].to(out.dtype)


class CpuBackend(Backend):
    name = "cpu"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self._slots: tuple = ()
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="gpuos-cpu-device", daemon=True)
        self._thread.start()

    def load(self, image: Image, binary: bytes | None) -> None:
        self._slots = image.slots

    def launch(self, batch: Batch) -> None:
        self._queue.put(batch)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            errors = {}
            for i, record in enumerate(batch.records):
                try:
                    self._execute(record)
                except Exception as exc:  # one failing task fails only its own request
                    log.warning("task %d of a batch failed: %s", i, exc)
                    errors[i] = f"{type(exc).__name__}: {exc}"
            batch.complete(errors)

    def _execute(self, record: np.void) -> None:
        spec = self._slots[int(record["op_slot"])].spec
        n = int(record["num_inputs"])
        xs = [decode(record["in"][k]).float() for k in range(n)]
        mask = int(record["reduce_mask"])
        dims = tuple(d for d in range(xs[0].dim() if xs else 0) if mask >> d & 1)
        params = Params(tuple(float(s) for s in record["scalars"][: len(spec.scalars)]), dims)
        out = decode(record["out"])
        value = spec.compute(xs, params)
        write_items(out, value, int(record["range_begin"]), int(record["range_end"]),
                    spec.kind.rows_are_items)
