"""The runtime API everything above builds on (usable without Ray).

    rt = Runtime("auto")                                   # CUDA when usable, else CPU; says which
    batch = rt.submit([rt.prepare(OpCall("mul", (a, b)))]) # a batch is the unit of work
    out = batch.wait(timeout=1.0).result(0)                # or: await batch
    rt.register("fma", "A * B + C"); rt.swap("fma", "A * B + C + 0"); rt.rollback("fma")

Operator versions are resolved to physical slots at submit, so tasks already submitted keep the
version that was active then. A swap compiles and links off the request path, then holds new
submissions, drains those in flight, loads the new image and releases them (DESIGN.md, protocol 3).
A rollback whose target is still loaded (dual slot) only flips the host-side alias.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .abi import TASK, encode_tensor
from .backends.base import Backend
from .backends.cpu import CpuBackend
from .batch import Batch
from .calls import OpCall, Prepared
from .catalogue import CATALOGUE, expression_spec, new_version, prepare
from .errors import BackendUnavailableError, RuntimeClosedError
from .image import ImageBuild, build_image, compile_version
from .config import RuntimeConfig
from .jit import JitCache
from .optable import Image, OpTable, OpVersion

log = logging.getLogger("gpuos.runtime")
BACKENDS = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class ChangeReport:
    """What the last image change cost (the swap breakdown the benchmarks report)."""

    generation: int     # image generation it loaded
    compile_ms: float   # compiling new versions (cache hits for the rest), off the request path
    link_ms: float      # linking the image, off the request path
    pause_ms: float     # submissions held: drain in-flight batches, load, publish
    load_ms: float      # the backend's load (worker stop, module load) inside the pause


@dataclass(frozen=True)
class _State:
    """What submit reads, published as one object so a submit sees a consistent triple."""

    table: OpTable
    image: Image
    aliases: dict[str, int]  # logical name → physical slot of its current version


def cuda_unusable_reason() -> str | None:
    """None when a CUDA device can run the worker, else why not (for logs and errors)."""
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"cuInit failed: {err.name}"
        err, count = driver.cuDeviceGetCount()
        return None if err == driver.CUresult.CUDA_SUCCESS and count > 0 else "no CUDA device"
    except Exception as exc:  # no driver library at all
        return f"no CUDA driver ({type(exc).__name__}: {exc})"


def select_backend(config: RuntimeConfig) -> tuple[Backend, str]:
    """The backend `config.backend` names and a sentence saying why it was chosen."""
    choice = config.backend
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    reason = None if choice == "cpu" else cuda_unusable_reason()
    if choice == "cuda" and reason:
        raise BackendUnavailableError(f"backend 'cuda' requested but {reason}")
    if choice == "cpu" or reason:
        return CpuBackend(), "cpu backend (" + ("requested" if choice == "cpu" else
                                                f"auto: {reason}") + ")"
    from .backends.cuda import CudaBackend  # imports the driver only where there is one
    why = "requested" if choice == "cuda" else "auto: a CUDA device is usable"
    return CudaBackend(config.cuda), f"cuda backend ({why})"


class Runtime:
    """One GPUOS runtime: an operator table, the image loaded from it, and a backend."""

    def __init__(self, backend: str = "auto", config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig(backend=backend)
        self._backend, self.backend_reason = select_backend(self.config)
        log.info("gpuos runtime: %s", self.backend_reason)
        self._cache = JitCache(self.config.cache_dir)
        self._arch = self._backend.arch or self.config.arch  # a GPU builds for its own arch
        self._submit_lock = threading.Lock()  # held while quiescing: holds new submissions
        self._change_lock = threading.Lock()  # one swap/register/rollback at a time
        self._inflight: set[Batch] = set()
        self._closed = False
        self._state = _State(OpTable(), Image(0, ()), {})
        self.last_change: ChangeReport | None = None
        table = OpTable()
        for spec in CATALOGUE.values():
            table, _ = table.added(spec)
        self._activate(table, compile_new=False)  # the catalogue is compiled by the test suite

    # -- introspection -------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def backend(self) -> Backend:
        """The backend object (for its counters and knobs; submit through the runtime)."""
        return self._backend

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def table(self) -> OpTable:
        """The published operator table (immutable snapshot)."""
        return self._state.table

    @property
    def generation(self) -> int:
        """Generation number of the loaded image."""
        return self._state.image.generation

    # -- work ----------------------------------------------------------------------------------
    def prepare(self, call: OpCall) -> Prepared:
        """Validate one call against its operator, allocate its output and encode its records
        (TensorSpecError, UnknownOperatorError). Costs the caller, not the flush: no device work."""
        task = prepare(self._state.table.current(call.op).spec, call, self.device)
        task.records = encode_records(task, self._backend.tile_elements)
        return task

    def submit(self, tasks: Sequence[Prepared]) -> Batch:
        """Enqueue prepared tasks as one batch, resolving each operator to the physical slot of
        its current version now. Blocks only while a swap holds submissions (milliseconds)."""
        counts = [len(t.records) for t in tasks]
        records = np.concatenate([t.records for t in tasks])
        owners = np.repeat(np.arange(len(tasks), dtype=np.int32), counts)
        with self._submit_lock:
            if self._closed:
                raise RuntimeClosedError("submit() after close()")
            state = self._state
            slots = [state.aliases[t.op] for t in tasks]
            records["op_slot"] = np.repeat(slots, counts)
            batch = Batch(tasks, records, owners, [state.image.slots[s].version for s in slots])
            self._backend.launch(batch)  # may raise (ring too small, stalled): nothing in flight
            self._inflight.add(batch)
            batch.add_done_callback(self._inflight.discard)
        return batch

    def run(self, op: str, *inputs: torch.Tensor, out: torch.Tensor | None = None,
            timeout: float | None = 30.0, **scalars: float) -> torch.Tensor:
        """Convenience: one task, submitted alone, waited for (tests, scripts, benchmarks)."""
        task = self.prepare(OpCall(op, tuple(inputs), out, scalars))
        return self.submit([task]).wait(timeout).result(0)

    # -- operator changes ----------------------------------------------------------------------
    def register(self, name: str, expression: str, arity: int | None = None) -> OpVersion:
        """Add a new elementwise operator from an expression (version 1)."""
        with self._change_lock:
            table, made = self._state.table.added(expression_spec(name, expression, arity))
            self._activate(table)
            return made

    def swap(self, name: str, expression: str) -> OpVersion:
        """Make a new version of `name` current; the version it replaces stays loaded (previous)."""
        with self._change_lock:
            spec = new_version(self._state.table.current(name).spec, expression)
            table, made = self._state.table.swapped(spec)
            self._activate(table)
            return made

    def rollback(self, name: str) -> OpVersion:
        """Make the version active before the last change of `name` current again."""
        with self._change_lock:
            state = self._state
            table, made = state.table.rolled_back(name)
            if state.image.slot_of(made) is None:
                self._activate(table)  # not loaded any more (rolled back twice): new image
            else:  # dual slot: a host-side alias flip, no device traffic
                self._state = _State(table, state.image, state.image.aliases(table))
            log.info("rolled back %s to v%d", name, made.version)
            return made

    def history(self, name: str) -> tuple[OpVersion, ...]:
        """Every version ever made of `name`, oldest first."""
        self._state.table.current(name)  # UnknownOperatorError for unknown names
        return self._state.table.history[name]

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish in-flight batches and release the backend; later submits raise."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._drain()
        self._backend.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _activate(self, table: OpTable, compile_new: bool = True) -> None:
        """Build the image for `table` off the request path, then quiesce, load and publish."""
        slots = table.slots()
        build = self._build(slots, compile_new)
        paused = time.perf_counter()
        with self._submit_lock:
            self._drain()
            image = Image(self._state.image.generation + 1, slots)
            loading = time.perf_counter()
            self._backend.load(image, build.binary or None)
            loaded = time.perf_counter()
            self._state = _State(table, image, image.aliases(table))
        self.last_change = ChangeReport(image.generation, build.compile_ms, build.link_ms,
                                        1e3 * (time.perf_counter() - paused),
                                        1e3 * (loaded - loading))
        log.info("%s", self.last_change)

    def _build(self, slots: tuple[OpVersion, ...], compile_new: bool) -> ImageBuild:
        """The linked image where the backend runs one; elsewhere compile the versions the loaded
        image lacks, so an operator that would not build on a GPU replica is refused here too."""
        if self._backend.needs_image_binary:
            return build_image(slots, self._arch, self._cache)
        started = time.perf_counter()
        for v in slots if compile_new else ():
            if self._state.image.slot_of(v) is None:
                compile_version(v, self._arch, self._cache)
        return ImageBuild(b"", 1e3 * (time.perf_counter() - started), 0.0)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        for batch in list(self._inflight):
            batch.wait(max(0.0, deadline - time.monotonic()))


def encode_records(task: Prepared, tile_elements: int | None) -> np.ndarray:
    """The task's ABI records: one per tile of about `tile_elements` elements of work (one record
    when None), each covering a range of work items; op_slot is left for submit to resolve."""
    per_item = max(1, max(x.numel() for x in task.inputs) // max(task.items, 1))
    step = max(1, tile_elements // per_item) if tile_elements else max(task.items, 1)
    bounds = list(range(0, task.items, step)) or [0]
    records = np.zeros(len(bounds), dtype=TASK)
    first = records[0]
    first["num_inputs"] = len(task.inputs)
    first["reduce_mask"] = sum(1 << d for d in task.params.reduce_dims)
    first["scalars"][: len(task.params.scalars)] = task.params.scalars
    encode_tensor(first["out"], task.out_ref)
    for k, x in enumerate(task.inputs):
        encode_tensor(first["in"][k], x)
    records[1:] = first
    records["range_begin"] = bounds
    records["range_end"] = bounds[1:] + [task.items]
    return records
