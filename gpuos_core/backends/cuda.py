"""CUDA backend: a leased persistent worker draining a device-memory ring (docs/DESIGN.md,
runtime protocol).

Submission: a batch's records are staged in pinned host memory at their ring positions, copied to
the device ring with one async copy (two when it wraps), and the new tail is written after them in
the same stream (cuStreamWriteValue64, or a one-thread kernel where stream memory operations are
unsupported). Worker blocks take records by tickets (an atomic add on the queue's head) and write
completions to mapped host memory; a poller thread (and any thread waiting on a batch) reaps them.
The worker is leased: it exits when idle or when its lease ends, and is relaunched when records are
pending, by submit or by the poller's watchdog. A record slot is reused only after its previous
record completed.

Ordering with torch: a batch runs after the work queued before its submit on the submitting
thread's current torch stream (it usually produced the inputs); inputs written on other streams
must be synchronised by the caller first. Results are ready when the batch completes.

What callers must not do while a runtime with this backend lives (each can deadlock or stall it):
device-wide synchronisation from another thread is safe only because the worker's lease bounds it;
never unload modules, free memory the worker may read (keep task tensors alive until completion: the
Batch does) or change context limits (cuCtxSetLimit) yourself.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from cuda.bindings import driver as cu

from ..abi import DYNAMIC_SMEM, QUEUE, RAW_TASK, TASK, field_offset
from ..batch import Batch
from ..config import CudaConfig
from ..errors import StalledWorkerError
from ..jit import device_arch
from ..optable import Image
from ..threads import daemon
from .base import Backend
from .cudadrv import (
    NOT_READY,
    CudaError,
    HeldDriver,
    PinnedBuffer,
    check,
    held_check,
    kernel_params,
)

log = logging.getLogger("gpuos.cuda")
_NON_BLOCKING = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
MAX_CLAIM = 16  # GPUOS_MAX_CLAIM in gpuos_worker.cu: records a worker block can hold at once
# Worker grids kept launched: the running one and its successor, queued behind it on the worker
# stream. An implicit device-wide sync may so wait for two leases (CudaConfig.lease_ms each).
WORKER_GRIDS = 2
POLLER_THREAD = "gpuos-cuda-poller"  # the thread that completes batches (bench/host_phases.py)
REAP_WINDOW = 1024  # completions a poll reads first (then twice as many while all are done)
READ_SPIN_S = 2e-4  # `read` spins, GIL held, this long for its copy (a few KB take ~10 µs)


@dataclass
class _Pending:
    """A launched batch: where its completions appear and how far they are known to have come."""

    batch: Batch
    first: int  # ticket of its first record
    count: int  # records
    mask: int  # ring capacity - 1
    published: int = 0  # records published so far (a batch larger than the ring goes in parts)
    reaped: int = 0  # records from the first known complete, in ticket order
    failures: list[int] = field(default_factory=list)  # failed record indices among those

    @property
    def oldest(self) -> int:
        """Ticket of its oldest record not known complete: ring slots before it are free."""
        return self.first + self.reaped

    def advance(self, done: np.ndarray, thorough: bool) -> bool:
        """Reap completions in ticket order as far as they are written; True once every record
        completed. Only published records are read, and none of them can have been overwritten:
        a slot is reused only once the oldest record before it is reaped. Unless `thorough`, a
        batch whose last record is not done yet is not looked at further: the reaping that
        frees ring slots and shows the watchdog progress waits for the batch's end, or for a
        poll that needs it (CudaBackend._thorough)."""
        last = self.first + self.count - 1
        word = int(done[last & self.mask]) if self.published == self.count else 0
        if self.count == 1:  # a lone record in plain Python: the one-task round trip
            if abs(word) != last + 1:
                return False
            self.failures, self.reaped = ([0] if word < 0 else []), 1
            return True
        if word == last + 1 and self._all_done(done):
            self.reaped = self.count
            return True
        if abs(word) != last + 1 and not thorough:
            return False
        # From the oldest record on, in windows that double while they complete: a poll costs
        # its news, not the batch's length; failures are found here.
        begin, end, window = self.first + self.reaped, self.first + self.published, REAP_WINDOW
        while begin < end and abs(int(done[begin & self.mask])) == begin + 1:
            tickets = np.arange(begin, min(end, begin + window), dtype=np.int64)
            values = done[tickets & self.mask]
            ok = np.abs(values) == tickets + 1
            n = len(ok) if ok.all() else int(ok.argmin())
            if values[:n].min() < 0:
                self.failures += (tickets[:n][values[:n] < 0] - self.first).tolist()
            self.reaped += n
            if n < len(ok):
                break
            begin, window = begin + n, 2 * window
        return self.reaped == self.count

    def _all_done(self, done: np.ndarray) -> bool:
        """Whether every record not reaped yet completed without failure: their completion words
        against the tickets + 1 they hold then, compared as bytes (memcmp, the GIL kept). The
        windows' numpy calls each let the GIL go above 500 elements: in the LLM engine on the
        H200 they took 0.06-0.38 ms to find a one-row GPT-2 step (2,520 records) done and
        0.13-0.48 ms a 64-row one (7,251), where alone they take 0.02 (bench/NOTES.md)."""
        begin, n = self.first + self.reaped, self.count - self.reaped
        lo = begin & self.mask
        head = min(n, self.mask + 1 - lo)
        got = done[lo : lo + head].tobytes()
        if head < n:  # the batch wraps past the ring's end
            got += done[: n - head].tobytes()
        return got == np.arange(begin + 1, begin + n + 1, dtype=np.int64).tobytes()


class CudaBackend(Backend):
    """Runs batches on one CUDA device through the leased worker of the loaded image."""

    name = "cuda"
    needs_image_binary = True

    def __init__(self, config: CudaConfig | None = None, device_index: int = 0) -> None:
        self.config = config or CudaConfig()
        assert self.config.capacity & (self.config.capacity - 1) == 0, "capacity: a power of two"
        assert all(
            1 <= n <= MAX_CLAIM for n in (self.config.max_claim, self.config.program_claim)
        ), f"max_claim and program_claim: 1 to {MAX_CLAIM}"
        self.tile_elements = self.config.tile_elements
        self.device = torch.device("cuda", device_index)
        # The caller's current torch stream as a raw handle. torch's private getter (the one its
        # generated code uses) skips building a Stream object, which costs microseconds a submit.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._current_stream: Callable[[], int] = (
            (lambda: raw(device_index))
            if raw is not None
            else (lambda: torch.cuda.current_stream(self.device).cuda_stream)
        )
        torch.empty(1, device=self.device)  # torch creates (and owns) the primary context first
        self._threads = threading.local()  # which threads have our context current
        self._open_context(device_index)
        self._held = HeldDriver()  # the submit path's calls, keeping the GIL
        self._allocate()
        self._publish_lock = threading.Lock()  # held by one launch while it publishes
        self._lock = threading.Lock()  # ring, tail and pending batches
        self._wake = threading.Condition(self._lock)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._tail = 0
        self._modules: list[object] = []
        self._worker_fn = self._write_fn = None
        self._dynamic_smem = 0  # bytes granted to the loaded worker (_grant_smem)
        self._last_progress = time.monotonic()
        self._space_wanted = False  # a publish waits for ring slots (_wait_for_space)
        self.broken: str | None = None  # why the backend refuses work, once stalled
        self.launches = 0  # worker launches so far (each lease is one)
        self._closed = False
        self._parked = False  # the poller blocks on _wake (see _park_when_idle)
        self._poller = daemon(self._poll_loop, POLLER_THREAD)

    # -- setup ---------------------------------------------------------------------------------
    def _open_context(self, index: int) -> None:
        check(cu.cuInit(0), "cuInit")
        self._dev = check(cu.cuDeviceGet(index), "cuDeviceGet")
        self._ctx = check(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._use_context()
        # Before our first launch, never again: changing it later blocks on running kernels.
        check(
            cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, self.config.stack_bytes),
            "cuCtxSetLimit(stack)",
        )
        major, minor = (self._attribute(f"COMPUTE_CAPABILITY_{p}") for p in ("MAJOR", "MINOR"))
        self.arch = device_arch(major, minor)  # the runtime starts this backend only where known
        self.blocks = self._attribute("MULTIPROCESSOR_COUNT") * self.config.blocks_per_sm
        self._worker_stream = check(cu.cuStreamCreate(_NON_BLOCKING), "cuStreamCreate(worker)")
        self._copy_stream = check(cu.cuStreamCreate(_NON_BLOCKING), "cuStreamCreate(copy)")
        self._read_stream = check(cu.cuStreamCreate(_NON_BLOCKING), "cuStreamCreate(read)")
        # one event per worker grid launched and not yet seen done (at most WORKER_GRIDS)
        self._grids: collections.deque[cu.CUevent] = collections.deque()
        self._free_events = [
            check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            for _ in range(WORKER_GRIDS)
        ]
        self._inputs_ready = check(
            cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"
        )
        self._copy_raw = int(self._copy_stream)  # raw handles, for HeldDriver
        self._read_raw = int(self._read_stream)
        self._inputs_ready_raw = int(self._inputs_ready)

    def _attribute(self, name: str) -> int:
        attribute = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return int(check(cu.cuDeviceGetAttribute(attribute, self._dev), name))

    def _use_context(self) -> None:
        """Make our context current in the calling thread (once per thread: it stays current,
        and setting it costs a microsecond of every submit)."""
        if getattr(self._threads, "ctx", None) is not self._ctx:
            check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._threads.ctx = self._ctx

    def _allocate(self) -> None:
        ring_bytes = self.config.capacity * TASK.itemsize
        self._queue = int(check(cu.cuMemAlloc(QUEUE.itemsize), "cuMemAlloc(queue)"))
        self._tail_address = self._queue + field_offset(QUEUE, "tail")
        self._ring = int(check(cu.cuMemAlloc(ring_bytes), "cuMemAlloc(ring)"))
        self._staging = PinnedBuffer(ring_bytes, mapped=False)
        self._stage_raw = self._staging.view(RAW_TASK)
        self._done_buf = PinnedBuffer(self.config.capacity * 8, mapped=True)
        self._done = self._done_buf.view(np.int64)
        self._done[:] = 0
        self._claim_address = self._queue + field_offset(QUEUE, "claim")
        self._claim = self.config.max_claim  # the queue's claim limit as last written
        control = np.zeros(1, dtype=QUEUE)
        control["claim"] = self._claim
        check(cu.cuMemcpyHtoD(self._queue, control.ctypes.data, QUEUE.itemsize), "init queue")
        self._stream_writes = self._try_stream_write()

    def _try_stream_write(self) -> bool:
        """Whether cuStreamWriteValue64 works here (else the doorbell kernel writes the tail)."""
        (status,) = cu.cuStreamWriteValue64(self._copy_stream, self._queue, 0, 0)
        if status != cu.CUresult.CUDA_SUCCESS:
            log.info("cuStreamWriteValue64 unavailable (%s): using the doorbell kernel", status)
            return False
        check(cu.cuStreamSynchronize(self._copy_stream), "cuStreamSynchronize(copy)")
        return True

    # -- Backend -------------------------------------------------------------------------------
    def host_records(self, n: int) -> np.ndarray:
        """Page-locked records from torch's caching host allocator. A Batch keeps its records
        alive until it completes, by which time the worker has read them (the copy is done)."""
        block = torch.empty(n * TASK.itemsize, dtype=torch.uint8, pin_memory=True)
        return block.numpy().view(TASK)  # the array's base keeps `block` alive

    def load(self, image: Image, binary: bytes | None) -> None:
        """Quiesced by the runtime: stop the worker, load the new image, keep the previous one."""
        assert binary is not None, "the CUDA backend loads linked images"
        self._use_context()
        with self._lock:
            assert not self._pending, "load() with batches in flight"
            self._stop_worker()
            module = check(
                cu.cuModuleLoadData(binary), f"cuModuleLoadData(image {image.generation})"
            )
            self._worker_fn = check(cu.cuModuleGetFunction(module, b"gpuos_worker"), "gpuos_worker")
            self._dynamic_smem = self._grant_smem(self._worker_fn)
            self._write_fn = check(cu.cuModuleGetFunction(module, b"gpuos_write_u64"), "write_u64")
            self._modules.append(module)
            if len(self._modules) > 2:  # nothing references the one before the previous image
                check(cu.cuModuleUnload(self._modules.pop(0)), "cuModuleUnload")
            self._write_u64(self._queue + field_offset(QUEUE, "stop"), 0)
            check(cu.cuStreamSynchronize(self._copy_stream), "cuStreamSynchronize(copy)")

    def _grant_smem(self, fn: object) -> int:
        """Let the worker `fn` have DYNAMIC_SMEM bytes of dynamic shared memory, or as much as
        the device gives a block beside the worker's static shared memory with blocks_per_sm
        blocks resident on an SM (operators that need more fall back to slower paths:
        gpuos_abi.h)."""
        optin = self._attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        per_sm = (
            self._attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR") // self.config.blocks_per_sm
        )
        static = check(
            cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn),
            "cuFuncGetAttribute(shared)",
        )
        # the driver keeps 1 KB of an SM's shared memory per resident block (sm_80 and later)
        grant = max(0, min(DYNAMIC_SMEM, optin - static, per_sm - static - 1024))
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(fn, attribute, grant), "cuFuncSetAttribute(dynamic shared)")
        if grant < DYNAMIC_SMEM:
            log.warning("worker: %d of %d bytes of dynamic shared memory", grant, DYNAMIC_SMEM)
        return grant

    def launch(self, batch: Batch) -> None:
        """Publish the batch's records in parts (`_part`). Each part waits for ring slots whose
        records completed (records only ever wait for earlier ones, so the published ones always
        finish and free their slots)."""
        self._use_context()  # any thread may submit; the driver needs the context current in it
        records = batch.records.view(RAW_TASK)
        with self._publish_lock, self._lock:  # one launch at a time: its tickets are contiguous
            if self.broken:
                raise StalledWorkerError(self.broken)
            self._after_producer()
            if batch.events is not None:  # stream-ordered before every record of the batch
                held_check(
                    self._held.memset_d32_async(
                        batch.events.data_ptr(), 0, batch.events.numel(), self._copy_raw
                    ),
                    "zero the program's events",
                )
            for dst, src in batch.uploads:  # so are the uploads
                held_check(
                    self._held.memcpy_htod_async(
                        dst.data_ptr(), src.data_ptr(), src.nbytes, self._copy_raw
                    ),
                    "upload",
                )
            claim = self.config.program_claim if batch.events is not None else self.config.max_claim
            if claim != self._claim:  # a hint: records claimed under the old one are just as valid
                self._write_u64(self._claim_address, claim)
                self._claim = claim
            behind = bool(self._pending)
            if not behind:  # stall detection counts from the first pending batch
                self._last_progress = time.monotonic()
            pending = _Pending(batch, self._tail, len(records), self.config.capacity - 1)
            self._pending.append(pending)
            begin = 0
            while begin < len(records):
                part = self._part(len(records) - begin, behind, begin)
                self._publish(records[begin : begin + part], batch.pinned, pending)
                begin += part
        batch.set_poller(self.poll, self.config.spin_s)

    def _part(self, left: int, behind: bool, sent: int) -> int:
        """Records to publish next of `left`, `sent` of the batch having gone before. On an idle
        ring the first part is publish_chunk, so the worker starts before the whole copy lands,
        and each later part at most twice what went before it: a record's copy takes a fraction
        of its run, so a part lands before the worker is through the parts before it (at one
        part of publish_chunk each, a 64-row GPT-2 step took 8 parts on an idle ring, ~18 µs
        of the host's each, just where the host, not the device, bounds the steps). Behind
        pending work the copy overlaps that work, so a part takes all the ring has free and
        never waits for more. Lock held."""
        cap = self.config.capacity
        chunk = min(cap, self.config.publish_chunk)
        if not behind:
            return min(left, max(chunk, 2 * sent), cap)
        free = cap - (self._tail - self._pending[0].oldest)
        return min(left, max(chunk, free))

    def read(self, src: torch.Tensor, dst: np.ndarray) -> None:
        """Copy on a stream of its own (the copy stream may wait for a producer) and spin, GIL
        held, for the few microseconds a small copy takes; a longer one waits with it let go."""
        self._use_context()
        held, stream = self._held, self._read_raw
        held_check(
            held.memcpy_dtoh_async(dst.ctypes.data, src.data_ptr(), src.nbytes, stream), "read"
        )
        deadline = time.perf_counter() + READ_SPIN_S
        while (status := held.stream_query(stream)) == NOT_READY:
            if time.perf_counter() > deadline:
                check(cu.cuStreamSynchronize(self._read_stream), "read")
                return
        held_check(status, "read")

    def trace(self) -> np.ndarray:
        """The worker's per-record times (CudaConfig.trace; cuda/gpuos_device.cuh): one row per
        ticket modulo the table's length, [(SM << 48) | (ticket + 1), claimed, ready, done,
        mark 0, ..., mark 7] in globaltimer ns (zero: never written). Read after the records of
        interest completed."""
        assert self.config.trace, "trace() needs CudaConfig(trace=True)"
        self._use_context()
        with self._lock:
            module = self._modules[-1]
        times = self._read_global(module, b"gpuos_trace").reshape(-1, 4)
        marks = self._read_global(module, b"gpuos_trace_marks").reshape(len(times), -1)
        return np.concatenate([times, marks], axis=1)

    def _read_global(self, module: object, name: bytes) -> np.ndarray:
        """A uint64 table of the image, copied to the host (flat)."""
        address, size = check(cu.cuModuleGetGlobal(module, name), name.decode())
        words = np.empty(size // 8, dtype=np.uint64)
        check(cu.cuMemcpyDtoH(words.ctypes.data, int(address), size), f"read {name.decode()}")
        return words

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._poller.join()
        self._use_context()
        with self._lock:
            self._stop_worker()
        for module in self._modules:
            check(cu.cuModuleUnload(module), "cuModuleUnload")
        check(cu.cuMemFree(self._ring), "cuMemFree(ring)")
        check(cu.cuMemFree(self._queue), "cuMemFree(queue)")
        self._staging.free()
        self._done_buf.free()
        check(cu.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")

    # -- submission ----------------------------------------------------------------------------
    def _after_producer(self) -> None:
        """Order the records after the work queued so far on the caller's current torch stream,
        which typically produced their inputs (and may still read their outputs): the tail is
        written on the copy stream, which now waits for that work."""
        producer, held = self._current_stream(), self._held
        if held.stream_query(producer) != NOT_READY:
            return  # nothing pending there: a device-side wait would only add latency
        held_check(held.event_record(self._inputs_ready_raw, producer), "cuEventRecord(inputs)")
        held_check(
            held.stream_wait_event(self._copy_raw, self._inputs_ready_raw, 0), "cuStreamWaitEvent"
        )

    def _publish(self, records: np.ndarray, pinned: bool, pending: _Pending) -> None:
        """Copy records to the ring once their slots are free, then write the tail after them, so
        the worker starts on one part while later ones are still being copied. Pinned records
        (from host_records) are copied as they lie; others are staged first. Lock held."""
        self._wait_for_space(len(records))
        cap = self.config.capacity
        slot = self._tail & (cap - 1)
        split = min(len(records), cap - slot)
        for at, piece in ((slot, records[:split]), (0, records[split:])):
            if len(piece):
                self._copy_to_ring(at, piece, pinned)
        self._tail += len(records)
        self._write_u64(self._tail_address, self._tail)
        pending.published += len(records)
        self._ensure_worker()
        if self._parked:
            self._wake.notify_all()

    def _copy_to_ring(self, at: int, piece: np.ndarray, pinned: bool) -> None:
        """Async copy of contiguous records to ring slots at.., from where they lie when pinned,
        else through the staging buffer (a pageable source would make the copy synchronous)."""
        size = TASK.itemsize
        if pinned:
            source = piece.ctypes.data
        else:
            self._stage_raw[at : at + len(piece)] = piece
            source = self._staging.host + at * size
        held_check(
            self._held.memcpy_htod_async(
                self._ring + at * size, source, len(piece) * size, self._copy_raw
            ),
            "copy to ring",
        )

    def _write_u64(self, address: int, value: int) -> None:
        """Stream-ordered store into device memory, after everything queued on the copy stream."""
        if self._stream_writes:
            held_check(
                self._held.stream_write_value64(self._copy_raw, address, value, 0),
                "cuStreamWriteValue64",
            )
            return
        params, _args = kernel_params(address, value)
        check(
            cu.cuLaunchKernel(self._write_fn, 1, 1, 1, 1, 1, 1, 0, self._copy_stream, params, 0),
            "doorbell launch",
        )

    def _wait_for_space(self, n: int) -> None:
        """Backpressure: wait (lock released) until n ring slots hold only completed records."""
        while not self.broken and self._tail + n - self._pending[0].oldest > self.config.capacity:
            self._space_wanted = True
            self._wake.wait(0.01)
        self._space_wanted = False
        if self.broken:  # the watchdog failed every pending batch, this one included
            raise StalledWorkerError(self.broken)

    def _ensure_worker(self) -> None:
        """Keep WORKER_GRIDS worker launches queued on the worker stream: the one running and
        the next, which starts the moment the running one's lease ends (waiting for the poller
        to notice the exit and relaunch left a ~0.5 ms hole in whatever was running then)."""
        while self._grids:
            status = self._held.event_query(int(self._grids[0]))
            if status == NOT_READY:
                break
            held_check(status, "the previous worker launch")  # a sticky fault surfaces here
            self._free_events.append(self._grids.popleft())
        if not self._free_events:
            return
        c = self.config
        params, _args = kernel_params(
            self._queue,
            self._ring,
            c.capacity - 1,
            self._done_buf.device,
            c.idle_us * 1000,
            c.lease_ms * 1_000_000,
        )
        check(
            cu.cuLaunchKernel(
                self._worker_fn,
                self.blocks,
                1,
                1,
                c.block_threads,
                1,
                1,
                self._dynamic_smem,
                self._worker_stream,
                params,
                0,
            ),
            "worker launch",
        )
        done = self._free_events.pop()
        check(cu.cuEventRecord(done, self._worker_stream), "cuEventRecord")
        self._grids.append(done)
        self.launches += 1

    def _stop_worker(self) -> None:
        """Ask the worker to exit once the queue is empty and wait for it (lock held)."""
        if self._worker_fn is None:
            return
        self._write_u64(self._queue + field_offset(QUEUE, "stop"), 1)
        check(cu.cuStreamSynchronize(self._worker_stream), "cuStreamSynchronize(worker)")

    # -- completion ----------------------------------------------------------------------------
    def poll(self) -> bool:
        """Reap completions; complete every batch whose records all finished. True when any
        record completed (progress, for the watchdog)."""
        finished, progressed = [], False
        with self._lock:
            thorough = self._thorough()
            for pending in list(self._pending):
                reaped = pending.reaped
                if pending.advance(self._done, thorough):
                    self._pending.remove(pending)
                    finished.append(pending)
                progressed = progressed or pending.reaped != reaped
            if progressed:
                self._last_progress = time.monotonic()
                self._wake.notify_all()
        for pending in finished:
            pending.batch.complete(
                {r: "operator slot not in the loaded image" for r in pending.failures}
            )
        return progressed

    def _thorough(self) -> bool:
        """Whether polls reap batches still running: while a publish waits for ring slots, and
        once no completion was seen for a quarter of the stall timeout (so a long batch that
        progresses is not taken for a stalled worker). Lock held."""
        quiet = time.monotonic() - self._last_progress
        return self._space_wanted or quiet > self.config.stall_timeout_s / 4

    def _poll_loop(self) -> None:
        """Reap completions nobody spins on and run the watchdog. It sleeps before each poll, so a
        thread spinning in Batch.wait reaps its own batch without contending for the GIL, and
        parks only after lingering idle, so a stream of submits need not wake it each time."""
        self._use_context()
        busy_at = time.monotonic()
        while self._park_when_idle(busy_at):
            time.sleep(self.config.poll_sleep_s)
            if self._pending:  # an unlocked peek: a miss only delays to the next round
                busy_at = time.monotonic()
                if not self.poll():
                    self._watchdog()

    def _park_when_idle(self, busy_at: float) -> bool:
        """Block while nothing is pending, once idle for poller_linger_s; False when closed."""
        with self._lock:
            if not self._pending and time.monotonic() - busy_at > self.config.poller_linger_s:
                self._parked = True
                while not self._pending and not self._closed:
                    self._wake.wait(0.1)
                self._parked = False
            return not self._closed

    def _watchdog(self) -> None:
        """Relaunch an exited worker while records are pending; fail everything when the worker
        stalled or the device faulted (a fault is sticky: the context is lost)."""
        with self._lock:
            if not self._pending or self.broken:
                return
            try:
                self._ensure_worker()
                waited = time.monotonic() - self._last_progress
                if waited < self.config.stall_timeout_s:
                    return
                self.broken = (
                    f"worker stalled: {len(self._pending)} batch(es) pending, no "
                    f"completion for {waited:.1f} s; restart the replica"
                )
            except CudaError as exc:
                self.broken = f"the device faulted ({exc}); restart the replica"
            failed, self._pending = list(self._pending), collections.deque()
        log.error(self.broken)
        for pending in failed:
            pending.batch.complete({r: self.broken for r in range(pending.count)})
