"""CPU backend: executes the same task descriptors as the GPU, with torch on the CPU.

A real backend, not a mock: each task is decoded from its ABI record (address, sizes, strides in
elements, dtype), computed in fp32 from those views, and written through the encoded output view
for the work items [range_begin, range_end) the record names. A dedicated thread plays the device,
so submission is asynchronous exactly as on the GPU.
"""

from __future__ import annotations

import logging
import queue

import numpy as np
import torch

from ..abi import NO_EVENT, OP_NOP, decode_ref
from ..batch import Batch
from ..calls import Params
from ..optable import Image
from ..threads import daemon
from .base import Backend

log = logging.getLogger("gpuos.cpu")


def _check_waits(record: np.void, counters: np.ndarray | None) -> None:
    """Records run in submission order here, so a wait that is not met now never will be (on a
    GPU the record would wait forever): fail it instead."""
    for event, count in zip(record["wait"], record["wait_count"]):
        if event != NO_EVENT and (counters is None or counters[event] < count):
            have = "no event counters" if counters is None else f"{counters[event]} signal(s)"
            raise RuntimeError(
                f"record waits for event {event} to reach {count}, but {have} "
                "came before it: a program's producers must precede its consumers"
            )


class CpuBackend(Backend):
    name = "cpu"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self._slots: tuple = ()
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._thread = daemon(self._loop, "gpuos-cpu-device")

    def load(self, image: Image, binary: bytes | None) -> None:
        self._slots = image.slots

    def launch(self, batch: Batch) -> None:
        for dst, src in batch.uploads:  # now: the caller may write src again once it completed
            dst.copy_(src)
        self._queue.put(batch)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            counters = None if batch.events is None else batch.events.numpy().view(np.uint32)
            if counters is not None:
                counters[:] = 0  # as the CUDA backend does before publishing
            errors = {}
            for i, record in enumerate(batch.records):
                try:
                    _check_waits(record, counters)
                    if int(record["op_slot"]) != OP_NOP:
                        self._execute(record)
                except Exception as exc:  # one failing task fails only its own request
                    log.warning("task %d of a batch failed: %s", i, exc)
                    errors[i] = f"{type(exc).__name__}: {exc}"
                if counters is not None and int(record["signal"]) != NO_EVENT:
                    counters[int(record["signal"])] += 1  # failed records signal too, as on a GPU
            batch.complete(errors)

    def _execute(self, record: np.void) -> None:
        spec = self._slots[int(record["op_slot"])].spec
        n = int(record["num_inputs"])
        xs = [decode_ref(record["in"][k]) for k in range(n)]
        mask = int(record["reduce_mask"])
        dims = tuple(d for d in range(xs[0].dim() if xs else 0) if mask >> d & 1)
        params = Params(tuple(float(s) for s in record["scalars"][: len(spec.scalars)]), dims)
        spec.kind.execute(
            decode_ref(record["out"]),
            xs,
            params,
            spec.expression,
            int(record["range_begin"]),
            int(record["range_end"]),
        )
