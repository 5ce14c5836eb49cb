"""Handle of one submission: completion that can be waited on from threads or awaited."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Sequence

import numpy as np
import torch

from .calls import Prepared
from .errors import TaskFailedError, WaitTimeoutError

# (device tensor, host tensor of the same bytes) pairs: what a submission copies to the device
Uploads = tuple[tuple[torch.Tensor, torch.Tensor], ...]
STATUS_PENDING = 0
STATUS_DONE = 1


class Batch:
    """The unit of work: tasks encoded as ABI records, executed by a backend, completed once.

    Keeps every task's tensors alive until completion (a device may still read or write them).
    """

    def __init__(
        self,
        tasks: Sequence[Prepared],
        records: np.ndarray,
        owners: np.ndarray,
        versions: np.ndarray | Sequence[int],
        pinned: bool = False,
        events: torch.Tensor | None = None,
        uploads: Uploads = (),
    ) -> None:
        self.tasks = tuple(tasks)  # validated tasks, with their outputs
        self.records = records  # ABI records as submitted (TASK dtype), tiles included
        self.owners = owners  # record index → index of the task it belongs to
        self._versions = versions  # operator version of each task, resolved at submit
        self.pinned = pinned  # records are in Backend.host_records memory
        self.events = events  # a program's event counters: the backend zeroes
        # them before publishing any record
        self.uploads = uploads  # copied before any record runs (Runtime.submit)
        self.status = np.zeros(len(tasks), dtype=np.int32)  # STATUS_PENDING (0), _DONE, < 0: error
        self.errors: dict[int, str] = {}  # task index → message, for failed tasks
        # Completion latch: held from creation until complete(). A Lock, not an Event, because
        # creating an Event costs microseconds of the one-task round trip.
        self._latch = threading.Lock()
        self._latch.acquire()
        self._complete = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._callbacks: list[Callable[[Batch], object]] = []
        self._poll: Callable[[], object] | None = None  # backend hook: reap completions now
        self._spin_s = 0.0

    def set_poller(self, poll: Callable[[], object], spin_s: float) -> None:
        """Let `wait()` call `poll` itself for up to `spin_s` before sleeping: a waiting thread
        then sees completion within microseconds instead of a poller thread's period."""
        self._poll, self._spin_s = poll, spin_s

    @property
    def versions(self) -> tuple[int, ...]:
        """The operator version each task ran with (resolved when it was submitted)."""
        return tuple(int(v) for v in self._versions)

    def __len__(self) -> int:
        return len(self.tasks)

    def done(self) -> bool:
        return self._complete

    def wait(self, timeout: float | None = None) -> Batch:
        """Block until every task completed; WaitTimeoutError after `timeout` seconds."""
        if self._poll is not None:
            deadline = time.perf_counter() + min(self._spin_s, timeout if timeout else self._spin_s)
            while not self._complete and time.perf_counter() < deadline:
                self._poll()
        if not self._complete:
            if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
                raise WaitTimeoutError(
                    f"batch of {len(self)} task(s) not complete after {timeout} s"
                )
            self._latch.release()  # pass the latch on to the next waiter
        return self

    def __await__(self) -> Generator[None, None, Batch]:
        """`await batch`: completes without blocking the event loop."""
        return self._wait_async().__await__()

    async def _wait_async(self) -> Batch:
        with self._lock:
            if self._complete:
                return self
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        await future
        return self

    def result(self, i: int) -> torch.Tensor:
        """Output of task `i`; TaskFailedError if that task failed. Call after completion."""
        assert self.done(), "result() before the batch completed"
        if self.status[i] != STATUS_DONE:
            raise TaskFailedError(
                self.errors.get(i, f"task {i} failed with status {self.status[i]}")
            )
        return self.tasks[i].out

    def check(self) -> Batch:
        """Raise TaskFailedError for the first failed task, if any (call after completion)."""
        if self.errors or not self._complete:  # complete() names every failed task there
            self.results()
        return self

    def results(self) -> list[torch.Tensor]:
        """Every output, raising for the first failed task."""
        return [self.result(i) for i in range(len(self))]

    def add_done_callback(self, fn: Callable[[Batch], object]) -> None:
        """Call `fn(batch)` on completion (from the completing thread), or now if complete."""
        with self._lock:
            if not self._complete:
                self._callbacks.append(fn)
                return
        fn(self)

    def complete(self, errors: dict[int, str] | None = None) -> None:
        """Called by the backend once every record ran: `errors` maps failed *record* indices to
        messages; a task fails when any of its records did. Later calls are ignored."""
        with self._lock:
            if self._complete:
                return
            self.status[:] = STATUS_DONE
            for r, message in (errors or {}).items():
                task = int(self.owners[r])
                self.status[task], self.errors[task] = -1, message
            self._complete = True
            self._latch.release()
            waiters, self._waiters = self._waiters, []
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # the awaiting task may have been cancelled
        future.set_result(None)
