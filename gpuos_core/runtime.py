"""The runtime API everything above builds on (usable without Ray).

    rt = Runtime("auto")                                   # CUDA when usable, else CPU; says which
    batch = rt.submit([rt.prepare(OpCall("mul", (a, b)))]) # a batch is the unit of work
    out = batch.wait(timeout=1.0).result(0)                # or: await batch
    rt.register("fma", "A * B + C"); rt.swap("fma", "A * B + C + 0"); rt.rollback("fma")

Operator versions are resolved to physical slots at submit, so tasks already submitted keep the
version that was active then. A swap compiles and links off the request path, then holds new
submissions, drains those in flight, loads the new image and releases them (docs/DESIGN.md,
runtime protocol 3). A rollback whose target is still loaded (dual slot) only flips the
host-side alias.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .abi import TASK, encode_task
from .backends.base import Backend
from .backends.cpu import CpuBackend
from .batch import Batch, Uploads
from .calls import Empty, LaidOut, OpCall, Prepared
from .canary import Comparison, compare_with_current, run_sandboxed
from .catalogue import OpSpec, expression_spec, new_version, prepare
from .config import RuntimeConfig
from .errors import BackendUnavailableError, RawCudaDisabledError, RuntimeClosedError
from .image import ImageBuild, build_image, compile_version
from .jit import JitCache, device_arch, supported_archs
from .optable import Image, OpTable, OpVersion, catalogue_table
from .program import Arena, Program, ProgramBuilder
from .tasklist import TaskList, encode_batch

log = logging.getLogger("gpuos.runtime")
BACKENDS = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class ChangeReport:
    """What the last image change cost (the swap breakdown the benchmarks report)."""

    generation: int  # image generation it loaded
    compile_ms: float  # compiling new versions (cache hits for the rest), off the request path
    canary_ms: float  # the sandboxed canary of the new version (GPU only), off the request path
    link_ms: float  # linking the image, off the request path
    pause_ms: float  # submissions held: drain in-flight batches, load, publish
    load_ms: float  # drain plus the backend's load (worker stop, module load), in the pause
    comparison: Comparison | None = None  # a swapped-in version beside the one it replaced


@dataclass(frozen=True)
class _State:
    """What submit reads, published as one object so a submit sees a consistent view."""

    table: OpTable
    image: Image
    aliases: dict[str, int]  # logical name → physical slot of its current version

    @classmethod
    def of(cls, table: OpTable, image: Image) -> _State:
        return cls(table, image, image.aliases(table))

    @functools.cached_property
    def slot_versions(self) -> np.ndarray:
        """Version number held by each physical slot."""
        return np.array([v.version for v in self.image.slots], dtype=np.int32)


def _device0() -> tuple[int, int] | str:
    """Device 0's (major, minor) compute capability, or why there is none to read."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"cuInit failed: {err.name}"
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count == 0:
            return "no CUDA device"
        return _capability(driver, 0)
    except Exception as exc:  # no driver library at all
        return f"no CUDA driver ({type(exc).__name__}: {exc})"


def local_arch() -> str | None:
    """The target the worker builds for on this machine's device 0; None without a usable one."""
    found = _device0()
    return None if isinstance(found, str) else device_arch(*found)


def cuda_unusable_reason() -> str | None:
    """None when a CUDA device can run the worker, else why not (for logs and errors)."""
    found = _device0()
    if isinstance(found, str):
        return found
    major, minor = found
    if device_arch(major, minor) is not None:
        return None
    reason = (
        f"device 0 is sm_{major}{minor}, which the device code cannot be built for (it "
        f"builds {', '.join(supported_archs())})"
    )
    log.warning("%s: the GPU is not used", reason)  # unlike a machine without one, a surprise
    return reason


def _capability(driver: Any, index: int) -> tuple[int, int]:
    """(major, minor) compute capability of a device, read from the driver (no context)."""
    attribute, device = driver.CUdevice_attribute, driver.cuDeviceGet(index)[1]
    major = driver.cuDeviceGetAttribute(
        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device
    )[1]
    minor = driver.cuDeviceGetAttribute(
        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device
    )[1]
    return major, minor


def select_backend(config: RuntimeConfig) -> tuple[Backend, str]:
    """The backend `config.backend` names and a sentence saying why it was chosen."""
    choice = config.backend
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    reason = None if choice == "cpu" else cuda_unusable_reason()
    if choice == "cuda" and reason:
        raise BackendUnavailableError(f"backend 'cuda' requested but {reason}")
    if choice == "cpu" or reason:
        return CpuBackend(), "cpu backend (" + (
            "requested" if choice == "cpu" else f"auto: {reason}"
        ) + ")"
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
        self._activate(catalogue_table(), compile_new=False)  # the test suite compiles it

    # -- introspection -------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def backend(self) -> Backend:
        """The backend object (for its counters and knobs; submit through the runtime)."""
        return self._backend

    @property
    def broken(self) -> str | None:
        """Why the backend refuses work (a stalled worker, a device fault), or None."""
        return self._backend.broken

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
    def prepare(self, call: OpCall, empty: Empty | None = None) -> Prepared:
        """Validate one call against its operator, allocate its output (with `empty` when given)
        and encode its records (TensorSpecError, UnknownOperatorError). Costs the caller, not the
        flush: no device work."""
        task = prepare(self._state.table.current(call.op).spec, call, self.device, empty)
        return Prepared.encoded(task, encode_records(task, self._backend.tile_elements))

    def submit(
        self, tasks: Sequence[Prepared] | TaskList | Program, uploads: Uploads = ()
    ) -> Batch:
        """Enqueue tasks as one batch, resolving each operator to the physical slot of its current
        version now. Blocks only while a swap holds submissions (milliseconds). A TaskList (see
        `encode`) can be submitted again and again without re-encoding. A Program runs its whole
        dependency graph on the device; submitting it first waits for its previous run.
        `uploads`, (device tensor, host tensor) pairs of equal bytes, are copied in order before
        any task runs (on CUDA the host side must be pinned and unchanged until completion): a
        step's inputs ride its submission instead of a torch copy of their own."""
        if isinstance(tasks, Program):
            return self._run_program(tasks, uploads)
        work = tasks if isinstance(tasks, TaskList) else self.encode(tasks)
        return self._launch(work, uploads=uploads)

    def read(self, src: torch.Tensor, dst: np.ndarray) -> None:
        """Copy contiguous `src`, written by a completed submission, into `dst` (host memory of
        the same bytes, pinned on CUDA); returns once `dst` holds it. Cheaper for a thread that
        competes for the GIL than `src.cpu()` (see HeldDriver)."""
        self._backend.read(src, dst)

    def program(self, arena: Arena | None = None) -> ProgramBuilder:
        """A builder of a device program: `add` calls in order, then `build()` (see program.py).
        Its tasks' outputs come from `arena` when given (programs that never run at once share
        its memory), else each from torch."""
        return ProgramBuilder(self.prepare, self._backend.host_records, self.device, arena)

    def _run_program(self, program: Program, uploads: Uploads) -> Batch:
        with program.lock:
            if program.last is not None:  # runs share tensors and counters: never overlap
                program.last.wait()
            program.last = self._launch(program.tasks, program.events, idle=True, uploads=uploads)
            return program.last

    def _launch(
        self,
        work: TaskList,
        events: torch.Tensor | None = None,
        idle: bool = False,
        uploads: Uploads = (),
    ) -> Batch:
        """Resolve and launch; `idle`: no submission of `work` can still be copying its records."""
        with self._submit_lock:
            if self._closed:
                raise RuntimeClosedError("submit() after close()")
            versions = work.resolve(self._state, idle)
            batch = Batch(
                work.tasks, work.records, work.owners, versions, work.pinned, events, uploads
            )
            self._backend.launch(batch)  # may raise (ring too small, stalled): nothing in flight
            self._inflight.add(batch)
            batch.add_done_callback(self._inflight.discard)
        return batch

    def encode(self, tasks: Sequence[Prepared]) -> TaskList:
        """Encode tasks for `submit` once, to submit them many times (a benchmark, a replayed
        step). Several tasks are concatenated into memory the backend copies from directly."""
        if len(tasks) == 1:  # the latency path: no page-locked allocation for one task
            return TaskList.alone(tasks[0])
        return encode_batch(tasks, self._backend.host_records)

    def run(
        self,
        op: str,
        *inputs: torch.Tensor,
        out: torch.Tensor | None = None,
        timeout: float | None = 30.0,
        **scalars: float,
    ) -> torch.Tensor:
        """Convenience: one task, submitted alone, waited for (tests, scripts, benchmarks)."""
        task = self.prepare(OpCall(op, tuple(inputs), out, scalars))
        return self.submit([task]).wait(timeout).result(0)

    # -- operator changes ----------------------------------------------------------------------
    def register(
        self,
        name: str,
        expression: str,
        arity: int | None = None,
        cuda: str | None = None,
        canary: bool = True,
    ) -> OpVersion:
        """Add a new elementwise operator (version 1) from an expression, or from raw CUDA (the
        body of its functor, where the configuration allows it) with the expression as its
        reference. Compiled, canary-checked on a GPU, then activated. `canary=False` only for a
        version that already passed its canary elsewhere (a replica replaying a registry)."""
        with self._change_lock:
            spec = expression_spec(name, expression, arity, cuda=self._allowed(cuda))
            table, made = self._state.table.added(spec)
            self._activate(table, candidate=spec if canary else None)
            return made

    def swap(
        self,
        name: str,
        expression: str,
        cuda: str | None = None,
        canary: bool = True,
        allow_nonfinite: bool = False,
    ) -> OpVersion:
        """Make a new version of `name` current; the version it replaces stays loaded (previous).
        A version that fails to compile or fails its canary raises and changes nothing;
        `canary` as for `register`. With `canary`, the new version first runs beside the current
        one on the canary inputs (`last_change.comparison`): NonFiniteOutputError where it is
        NaN or infinite and the current one is finite, unless `allow_nonfinite`."""
        with self._change_lock:
            current = self._state.table.current(name).spec
            spec = new_version(current, expression, self._allowed(cuda))
            compared = (
                compare_with_current(current, spec, secrets.randbits(31), allow_nonfinite)
                if canary
                else None
            )
            table, made = self._state.table.swapped(spec)
            self._activate(table, candidate=spec if canary else None, comparison=compared)
            return made

    def rollback(self, name: str) -> OpVersion:
        """Make the version active before the last change of `name` current again."""
        with self._change_lock:
            state = self._state
            table, made = state.table.rolled_back(name)
            slot = state.image.slot_of(made)
            if slot is None:
                self._activate(table)  # not loaded any more (rolled back twice): new image
            else:  # dual slot: a host-side alias flip, no device traffic
                self._state = _State(table, state.image, {**state.aliases, name: slot})
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

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _activate(
        self,
        table: OpTable,
        compile_new: bool = True,
        candidate: OpSpec | None = None,
        comparison: Comparison | None = None,
    ) -> None:
        """Compile what is new, canary-check `candidate`, link the image (all off the request
        path), then quiesce, load and publish."""
        slots = table.slots()
        started = time.perf_counter()
        for v in slots if compile_new else ():
            if self._state.image.slot_of(v) is None:  # CompileError (with NVRTC's log) here
                compile_version(v, self._arch, self._cache)
        compiled = time.perf_counter()
        self._canary(candidate)
        checked = time.perf_counter()
        traced = self.config.cuda.trace
        build = (
            build_image(slots, self._arch, self._cache, traced)
            if self._backend.needs_image_binary
            else ImageBuild(b"", 0.0, 0.0)
        )
        paused = time.perf_counter()
        with self._submit_lock:
            self._drain()
            image = Image(self._state.image.generation + 1, slots)
            self._backend.load(image, build.binary or None)
            loaded = time.perf_counter()
            self._state = _State.of(table, image)
        self.last_change = ChangeReport(
            image.generation,
            1e3 * (compiled - started) + build.compile_ms,
            1e3 * (checked - compiled),
            build.link_ms,
            1e3 * (time.perf_counter() - paused),
            1e3 * (loaded - paused),
            comparison,
        )
        log.info("%s", self.last_change)

    def _canary(self, candidate: OpSpec | None) -> None:
        """Run `candidate` against its reference in a sandboxed child on the GPU (the CPU backend
        executes a version's own reference, so there is nothing to check there)."""
        if candidate is None or not self.config.canary or self._backend.name != "cuda":
            return
        run_sandboxed(candidate, secrets.randbits(31), self.config.canary_timeout_s)

    def _allowed(self, cuda: str | None) -> str | None:
        if cuda is not None and not self.config.allow_raw_cuda:
            raise RawCudaDisabledError(
                "raw CUDA operators are disabled in this deployment; "
                "send an expression, or enable allow_raw_cuda"
            )
        return cuda

    def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        for batch in list(self._inflight):
            batch.wait(max(0.0, deadline - time.monotonic()))


def encode_records(task: LaidOut, tile_elements: int | None) -> np.ndarray:
    """The task's ABI records: one per range of work items its family chooses for tiles of about
    `tile_elements` elements of work (one record when None); op_slot is left for submit to
    resolve."""
    ranges = task.kind.ranges(task, tile_elements)
    records = np.empty(len(ranges), dtype=TASK)
    mask = sum(1 << d for d in task.params.reduce_dims)
    scalars = task.params.scalars
    encode_task(records, ranges, task.out_ref, task.inputs, scalars, mask)
    return records
