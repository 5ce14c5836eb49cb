"""Cross-request coalescer: many concurrent requests' tasks become one runtime submission.

    coalescer = Coalescer(runtime, CoalescerConfig(max_batch=64, window_us=200))
    out, version = await coalescer.submit(OpCall("softmax", (x,)))

The loop reads as three steps: `submit` validates a call in its own request (runtime.prepare: a bad
call fails only that request) and queues it; `_flush` hands the waiting tasks to one
`runtime.submit` when `max_batch` of them wait or `window_us` after the first; `_scatter` gives each
request its own result, or its own error, when the batch completes. Everything runs on one asyncio
loop, so the queue needs no lock. A full queue refuses the call (QueueFullError), a request not
answered within `deadline_ms` gets DeadlineExceededError, and every accepted call is answered.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from gpuos_core import Batch, OpCall, Prepared, Runtime, TaskFailedError

from .config import CoalescerConfig
from .errors import DeadlineExceededError, QueueFullError

log = logging.getLogger("gpuos.serving.coalescer")


class Completed(NamedTuple):
    """One request's answer."""

    out: torch.Tensor  # the task's output
    version: int  # operator version that computed it (resolved at submit)


class FlushObserver(Protocol):
    """Receives one call per runtime submission (the replica's metrics)."""

    def flushed(self, size: int, window_wait_s: float, queue_depth: int) -> None:
        """`size` tasks were submitted; the oldest had waited `window_wait_s`; `queue_depth`
        tasks still wait."""


@dataclass
class CoalescerStats:
    """Counters since start (monotonic, so a reader can take differences between two reads)."""

    requests: int = 0  # calls accepted into the queue
    batches: int = 0  # runtime submissions made
    tasks: int = 0  # tasks in those submissions
    max_batch_seen: int = 0
    rejected: int = 0  # calls refused because the queue was full
    expired: int = 0  # calls that passed their deadline
    sizes: dict[int, int] = field(default_factory=dict)  # batch size → submissions of that size

    @property
    def mean_batch_size(self) -> float:
        """Tasks per submission (0.0 before the first)."""
        return self.tasks / self.batches if self.batches else 0.0

    def record(self, size: int) -> None:
        self.batches += 1
        self.tasks += size
        self.max_batch_seen = max(self.max_batch_seen, size)
        self.sizes[size] = self.sizes.get(size, 0) + 1


@dataclass
class _Waiting:
    """A validated task and the request waiting for it."""

    task: Prepared
    future: asyncio.Future[Completed]
    queued_at: float  # time.perf_counter() when queued


class Coalescer:
    """Queues prepared tasks from concurrent requests and submits them in batches. Use from one
    event loop (the replica's); `reconfigure` takes effect for the next flush."""

    def __init__(
        self,
        runtime: Runtime,
        config: CoalescerConfig | None = None,
        observer: FlushObserver | None = None,
    ) -> None:
        self.runtime = runtime
        self.config = config or CoalescerConfig()
        self.stats = CoalescerStats()
        self._observer = observer
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def queue_depth(self) -> int:
        """Tasks waiting for a flush."""
        return len(self._queue)

    async def submit(self, call: OpCall) -> Completed:
        """Run `call` in the next batch and return its output and the version that computed it.

        Raises the runtime's TensorSpecError/UnknownOperatorError for a bad call (nothing queued),
        QueueFullError when `max_queue` tasks wait, DeadlineExceededError after `deadline_ms`,
        and TaskFailedError (or the submission's error) when the task itself failed.
        """
        return await self.submit_prepared(self.runtime.prepare(call))

    async def submit_prepared(self, task: Prepared) -> Completed:
        """`submit` for a task the caller prepared with this coalescer's runtime."""
        if len(self._queue) >= self.config.max_queue:
            self.stats.rejected += 1
            raise QueueFullError(
                f"{len(self._queue)} tasks are waiting (max_queue "
                f"{self.config.max_queue}); retry shortly"
            )
        future: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(task, future, time.perf_counter()))
        self.stats.requests += 1
        self._schedule()
        return await self._answer(future)

    def reconfigure(self, config: CoalescerConfig) -> None:
        """Apply new knobs; tasks already waiting are flushed if the new ones say so."""
        self.config = config
        if self._queue:
            self._schedule()

    def flush(self) -> None:
        """Submit everything waiting now, in batches of at most `max_batch`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            self._submit(self._take(self.config.max_batch))

    # -- internals -------------------------------------------------------------------------------
    async def _answer(self, future: asyncio.Future[Completed]) -> Completed:
        timeout = self.config.deadline_ms / 1e3
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:  # wait_for cancelled the future: a flush skips it
            self.stats.expired += 1
            raise DeadlineExceededError(f"no answer within the deadline of {timeout:g} s") from None

    def _schedule(self) -> None:
        """Flush now when coalescing is off or a batch is full, else arm the window timer once."""
        if not self.config.enabled or len(self._queue) >= self.config.max_batch:
            self.flush()
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.config.window_us / 1e6, self.flush)

    def _take(self, limit: int) -> list[_Waiting]:
        """Up to `limit` waiting entries whose requests still wait (expired ones are dropped)."""
        taken: list[_Waiting] = []
        while self._queue and len(taken) < limit:
            entry = self._queue.popleft()
            if not entry.future.done():
                taken.append(entry)
        return taken

    def _submit(self, entries: list[_Waiting]) -> None:
        """One runtime submission for `entries`; a refused submission fails just these requests."""
        if not entries:
            return
        try:
            batch = self.runtime.submit([e.task for e in entries])
        except Exception as exc:  # closed or stalled runtime: every request here learns why
            log.warning("submission of %d task(s) failed: %s", len(entries), exc)
            _fail(entries, exc)
            return
        self.stats.record(len(entries))
        if self._observer is not None:
            wait = time.perf_counter() - entries[0].queued_at
            self._observer.flushed(len(entries), wait, len(self._queue))
        loop = asyncio.get_running_loop()
        batch.add_done_callback(lambda b: loop.call_soon_threadsafe(_scatter, b, entries))


def _scatter(batch: Batch, entries: Sequence[_Waiting]) -> None:
    """Give each waiting request its own result or its own task's error."""
    versions = batch.versions
    for i, entry in enumerate(entries):
        if entry.future.done():  # its deadline passed or its client went away
            continue
        try:
            entry.future.set_result(Completed(batch.result(i), versions[i]))
        except TaskFailedError as exc:
            entry.future.set_exception(exc)


def _fail(entries: Sequence[_Waiting], exc: Exception) -> None:
    for entry in entries:
        if not entry.future.done():
            entry.future.set_exception(exc)
