"""Device programs: a dependency graph of tasks in one submission, resolved by the worker itself.

    build = rt.program()
    h = build.add(OpCall("mul", (a, b)))       # returns the task's output (allocated now)
    y = build.add(OpCall("relu", (h,)))        # reads h: runs after the mul, on the device
    prog = build.build()                       # edges, event plan and records, encoded once
    rt.submit(prog).wait()                     # one copy and one doorbell per run

Edges come from data flow: a task that reads memory an earlier task writes, or writes memory an
earlier task reads or writes, depends on it; `after=` adds any other order. Each task that others
depend on signals one event per record (its tiles); a dependent record waits for the event to
reach the producer's record count (gpuos_abi.h). Edges implied by others are dropped (waiting for
a task implies everything it waited for), so most tasks wait for one or two events; one that
still depends on more tasks than a record can wait for gets join records first (no operator,
they wait for a few events each and signal one the task then waits for).

A program is fixed; data moves. What changes between runs lives in the tensors its operators read
(index inputs for lengths and positions), so a program is built once and resubmitted, like a CUDA
graph with dynamic sizes. Operator versions resolve at each submit (a swap between runs takes
effect at the next run). Runs of one program never overlap: they share tensors and event
counters, so `Runtime.submit` waits for a program's previous run before publishing the next.
Where the tensors themselves change between runs (a traced region's arguments and results), a
`Binding` says where their addresses sit in the records and `Program.rebind` rewrites them all
with one numpy scatter, keeping the edges and the event plan.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .abi import (
    MAX_WAITS,
    NO_EVENT,
    OP_NOP,
    RAW_TASK,
    TASK,
    TASK_LOCAL,
    TENSOR_REF,
    field_offset,
    task_settled,
)
from .batch import Batch
from .calls import Empty, OpCall, Prepared
from .errors import ProgramError
from .tasklist import TaskList

Span = tuple[int, int, int]  # (storage address, first byte, one past the last byte)
# Byte offsets, within a TASK record, of the addresses of its output and of its input 0.
_OUT_DATA = field_offset(TASK, "out") + field_offset(TENSOR_REF, "data")
_IN_DATA = field_offset(TASK, "in") + field_offset(TENSOR_REF, "data")
_WORD = np.dtype(np.uint64).itemsize


@dataclass(frozen=True)
class Binding:
    """Where a program's rebindable tensors sit in its records: word `words[i]` of the records,
    viewed as uint64, holds the address of bound tensor `slots[i]` plus `deltas[i]` bytes (the
    view a task encodes, measured from that tensor's data_ptr)."""

    words: np.ndarray  # index into the records viewed as uint64
    slots: np.ndarray  # which bound tensor
    deltas: np.ndarray  # uint64, added modulo 2**64: a view may start before its tensor's data_ptr


@dataclass(eq=False)
class Program:
    """A built program: its records with the event plan, and the counters they use."""

    tasks: TaskList  # every record, joins included, encoded once
    deps: tuple[tuple[int, ...], ...]  # per task: the tasks it waits for (implied ones dropped)
    events: torch.Tensor | None  # one counter per event (int32 storage, read as uint32);
    # None when no task depends on another
    joins: int  # join records (no operator) in `tasks`
    last: Batch | None = field(default=None, repr=False)  # the latest run
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one submit at a time

    @property
    def outputs(self) -> tuple[torch.Tensor, ...]:
        """Each task's output, in the order tasks were added."""
        return tuple(t.out for t in self.tasks.tasks)

    def __len__(self) -> int:
        return len(self.tasks.tasks)

    def binding(self, uses: Sequence[tuple[int, int, int]], addresses: Sequence[int]) -> Binding:
        """The Binding of `uses`, each (task, operand, slot): the task's output (operand -1) or
        its input `operand` is a view of bound tensor `slot`, which lives at `addresses[slot]`
        now. Every record of the task (its tiles) is bound."""
        task, operand, slot = np.asarray(uses, dtype=np.int64).reshape(-1, 3).T
        tiles = np.array([len(t.records) for t in self.tasks.tasks])[task]
        # A task's tiles are its last records (its join records come first).
        ends = np.searchsorted(self.tasks.owners, task, side="right")
        within = np.arange(tiles.sum()) - np.repeat(np.cumsum(tiles) - tiles, tiles)
        records = np.repeat(ends - tiles, tiles) + within
        field = np.where(operand < 0, _OUT_DATA, _IN_DATA + operand * TENSOR_REF.itemsize)
        words = (records * TASK.itemsize + np.repeat(field, tiles)) // _WORD
        slots = np.repeat(slot, tiles)
        now = np.asarray(addresses, dtype=np.uint64)[slots]
        return Binding(words, slots, self._words()[words] - now)

    def rebind(self, binding: Binding, addresses: np.ndarray) -> None:
        """Point every use of `binding` at `addresses` (uint64, one per slot): the tensors of the
        next run. Waits for the previous run first (it reads these records); the caller keeps
        each rebind and the submit after it together, one run at a time."""
        with self.lock:
            if self.last is not None:
                self.last.wait()
            self._words()[binding.words] = addresses[binding.slots] + binding.deltas

    def _words(self) -> np.ndarray:
        return self.tasks.records.view(np.uint64)


class Arena:
    """Memory for the outputs of programs that never run at the same time (a step program of
    each layout, one arena per parity): each program's build takes its tensors from the start of
    one buffer, so programs overlay each other and cost the largest one's memory, not the sum of
    all (as CUDA graphs share one memory pool). A build that needs more than the buffer holds
    continues in a new, larger one; programs built earlier keep the buffer they use alive.
    Within a build, tensors never overlap, so the data flow between its tasks is unchanged."""

    ALIGN = 256  # bytes: every tensor starts at a multiple (vector loads, cp.async)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    @property
    def bytes(self) -> int:
        """Size of the buffer new builds take their outputs from."""
        return self._buffer.numel()

    def allocator(self) -> Empty:
        """A fresh allocator from the buffer's start: the outputs of one program's build."""
        used = 0

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nonlocal used
            size = torch.Size(shape).numel() * dtype.itemsize
            if size == 0:
                return torch.empty(shape, dtype=dtype, device=self.device)
            if used + size > self._buffer.numel():
                grown = max(2 * self._buffer.numel(), size, 1 << 20)
                self._buffer = torch.empty(grown, dtype=torch.uint8, device=self.device)
                used = 0  # this build goes on in the new buffer; its earlier outputs stay
            start, used = used, used + -(-size // self.ALIGN) * self.ALIGN
            return self._buffer[start : start + size].view(dtype).view(shape)

        return empty


class ProgramBuilder:
    """Collects tasks in order; `build()` derives the edges and encodes the program."""

    def __init__(
        self,
        prepare: Callable[[OpCall, Empty | None], Prepared],
        allocate: Callable[[int], np.ndarray],
        device: torch.device,
        arena: Arena | None = None,
    ) -> None:
        """Outputs come from `arena` (Runtime.program) when given, else from torch."""
        self._prepare, self._allocate, self._device = prepare, allocate, device
        self._empty = arena.allocator() if arena is not None else None
        self._tasks: list[Prepared] = []
        self._after: list[tuple[int, ...]] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor from where this program's outputs come from, for an `out=` of its own."""
        if self._empty is None:
            return torch.empty(shape, dtype=dtype, device=self._device)
        return self._empty(shape, dtype)

    def __len__(self) -> int:
        """Tasks added so far: the index the next `add` gets (what `after=` and
        `Program.binding` name tasks by)."""
        return len(self._tasks)

    def records_writing(self, t: torch.Tensor) -> int:
        """Records of the tasks last added that write `t` (the run of them that ends at the
        latest such task): its producers, where they were added last, as a step's lanes are."""
        target, count, found = span(t), 0, False
        for task in reversed(self._tasks):
            s = span(task.out_ref)
            if target and s and s[0] == target[0] and _meets(s[1], s[2], target):
                count, found = count + len(task.records), True
            elif found:
                break
        return count

    def add(self, call: OpCall, after: Iterable[int] = ()) -> torch.Tensor:
        """Append a task (validated now: TensorSpecError, UnknownOperatorError); it also runs
        after the tasks numbered in `after` (indices of earlier `add` calls). Returns its output."""
        order = tuple(after)
        index = len(self._tasks)
        bad = [a for a in order if not (isinstance(a, int) and 0 <= a < index)]
        if bad:
            raise ProgramError(
                f"task {index} ({call.op}): after={bad} must name earlier tasks (0..{index - 1})"
            )
        self._tasks.append(self._prepare(call, self._empty))
        self._after.append(order)
        return self._tasks[-1].out

    def build(self) -> Program:
        """The program of every task added so far (ProgramError when there is none)."""
        if not self._tasks:
            raise ProgramError("a program needs at least one task")
        found, settled = data_flow(self._tasks)
        deps = reduce_edges(found, self._after)
        return encode_program(self._tasks, deps, settled, self._allocate, self._device)


# -- edges ---------------------------------------------------------------------------------------
def span(t: torch.Tensor) -> Span | None:
    """The bytes a tensor view can touch, with its storage; None when it has no element."""
    if t.numel() == 0:
        return None
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return t.untyped_storage().data_ptr(), start, start + (last + 1) * t.element_size()


def _meets(lo: int, hi: int, s: Span) -> bool:
    """Whether bytes [lo, hi) of a storage meet span `s` of the same storage."""
    return lo < s[2] and s[1] < hi


class _Ranges:
    """Byte ranges (lo, hi, task) of one storage, sorted, and the widest range's length: the
    ranges that meet [a, b) start in (a - widest, b), a bisect away (a 1-tuple (x,) sorts before
    every range that starts at x). (A program's activations share one arena storage; scanning
    all its ranges at every access made data_flow quadratic in the tasks.)"""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, int]] = []
        self._widest = 0  # never shrinks: an upper bound is all `meeting` needs

    def meeting(self, s: Span) -> Iterator[int]:
        """Tasks of the ranges that meet span `s`."""
        first = bisect.bisect_left(self._ranges, (s[1] - self._widest + 1,))
        end = bisect.bisect_left(self._ranges, (s[2],))
        return (task for _, hi, task in self._ranges[first:end] if hi > s[1])

    def drop_within(self, s: Span) -> None:
        """Forget the ranges inside span `s`."""
        first = bisect.bisect_left(self._ranges, (s[1],))
        end = bisect.bisect_left(self._ranges, (s[2],))
        self._ranges[first:end] = [r for r in self._ranges[first:end] if r[1] > s[2]]

    def add(self, s: Span, task: int) -> None:
        bisect.insort(self._ranges, (s[1], s[2], task))
        self._widest = max(self._widest, s[2] - s[1])


class _Accesses:
    """Accesses so far, per storage, reads and writes apart (a read conflicts only with writes:
    many tasks reading views of one storage, like rows of a batch, cost no scan of each other);
    an access that a later write covers is dropped (whoever touches it later overlaps that
    write, which already depends on it)."""

    def __init__(self) -> None:
        self._reads: defaultdict[int, _Ranges] = defaultdict(_Ranges)
        self._writes: defaultdict[int, _Ranges] = defaultdict(_Ranges)

    def conflicts(self, s: Span, write: bool) -> set[int]:
        """Tasks whose accesses conflict with reading (or writing) span `s`."""
        found = set(self._writes[s[0]].meeting(s))
        if write:
            found.update(self._reads[s[0]].meeting(s))
        return found

    def record(self, s: Span, task: int, write: bool) -> None:
        if write:
            self._reads[s[0]].drop_within(s)
            self._writes[s[0]].drop_within(s)
        (self._writes if write else self._reads)[s[0]].add(s, task)


def data_flow(tasks: Sequence[Prepared]) -> tuple[list[set[int]], list[int]]:
    """Per task, the earlier tasks it must follow (read after write, write after read or write),
    and its TASK_SETTLED bits: the inputs it only reads that no earlier task writes."""
    seen, deps, settled = _Accesses(), [], []
    for i, task in enumerate(tasks):
        writes = [task.out_ref] + [task.inputs[k] for k in task.inputs_written]
        reads = {k: span(x) for k, x in enumerate(task.inputs) if k not in task.inputs_written}
        beside = [s for s in map(span, task.reads) if s]  # read through its workspace
        wspans = [s for s in map(span, writes) if s]
        producers = {k: seen.conflicts(s, False) if s else set() for k, s in reads.items()}
        found = set().union(
            *(seen.conflicts(s, True) for s in wspans),
            *producers.values(),
            *(seen.conflicts(s, False) for s in beside),
        )
        for s in [*reads.values(), *beside]:
            if s:
                seen.record(s, i, False)
        for s in wspans:
            seen.record(s, i, True)
        deps.append(found)
        settled.append(sum(task_settled(k) for k, p in producers.items() if not p))
    return deps, settled


def reduce_edges(
    found: Sequence[set[int]], after: Sequence[tuple[int, ...]]
) -> tuple[tuple[int, ...], ...]:
    """Direct dependencies without those another dependency implies (transitive reduction over
    ancestor bitsets: Python ints, one bit per task)."""
    ancestors: list[int] = []
    out = []
    for flow, extra in zip(found, after):
        direct = sorted(flow.union(extra))
        reach = 0
        for d in direct:
            reach |= ancestors[d] | (1 << d)
        implied = 0
        for d in direct:
            implied |= ancestors[d]
        out.append(tuple(d for d in direct if not implied >> d & 1))
        ancestors.append(reach)
    return tuple(out)


# -- encoding ------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """Per-record dependency fields, filled task by task."""

    signal: list[int] = field(default_factory=list)
    # runs of records that wait alike: ((event, count) pairs, records); a task's tiles are one run
    waits: list[tuple[tuple[tuple[int, int], ...], int]] = field(default_factory=list)
    joins: list[int] = field(default_factory=list)  # per task: join records before its tiles
    events: int = 0

    def event(self) -> int:
        self.events += 1
        return self.events - 1


def plan_events(tasks: Sequence[Prepared], deps: Sequence[tuple[int, ...]]) -> _Plan:
    """Events of producers, waits of consumers, join records where a task has more producers than
    a record can wait for. Records of a task: its joins, then its tiles."""
    producers = {d for ds in deps for d in ds}
    plan, event_of = _Plan(), dict[int, int]()
    for i, (task, ds) in enumerate(zip(tasks, deps)):
        waits = tuple((event_of[d], len(tasks[d].records)) for d in ds)
        joins = 0
        if len(waits) > MAX_WAITS:
            join = plan.event()
            for k in range(0, len(waits), MAX_WAITS):
                plan.signal.append(join)
                plan.waits.append((waits[k : k + MAX_WAITS], 1))
                joins += 1
            waits = ((join, joins),)
        if i in producers:
            event_of[i] = plan.event()
        tiles = len(task.records)
        plan.signal += [event_of.get(i, NO_EVENT)] * tiles
        plan.waits.append((waits, tiles))
        plan.joins.append(joins)
    return plan


def encode_program(
    tasks: Sequence[Prepared],
    deps: tuple[tuple[int, ...], ...],
    settled: Sequence[int],
    allocate: Callable[[int], np.ndarray],
    device: torch.device,
) -> Program:
    """Records of every task (joins before their task's tiles) in `allocate`d memory, with the
    event plan and each task's `settled` flags (data_flow) written in; the counters live on
    `device`."""
    plan = plan_events(tasks, deps)
    nop = np.zeros(1, dtype=TASK)
    nop["op_slot"] = OP_NOP
    parts = []
    for task, joins in zip(tasks, plan.joins):
        parts += [nop.view(RAW_TASK)] * joins + [task.records.view(RAW_TASK)]
    records = allocate(len(plan.signal))
    np.concatenate(parts, out=records.view(RAW_TASK))
    events = torch.zeros(plan.events, dtype=torch.int32, device=device) if plan.events else None
    _write_plan(records, plan, 0 if events is None else events.data_ptr())
    _check_plan(records)
    # a record some later record waits for is published to the host by that one's completion
    waited = records["wait"][records["wait"] != NO_EVENT]
    records["flags"][np.isin(records["signal"], waited)] |= TASK_LOCAL
    tiles = np.array([len(t.records) for t in tasks])
    runs = np.column_stack([plan.joins, tiles]).ravel()  # joins, then tiles, task by task
    flags = np.column_stack([np.zeros(len(tasks), dtype=np.int64), settled]).ravel()
    records["flags"] |= np.repeat(flags, runs).astype(records["flags"].dtype)
    names: dict[str, int] = {}
    op_of_task = np.array([names.setdefault(t.op, len(names)) for t in tasks], dtype=np.int32)
    counts = tiles + np.array(plan.joins)
    owners = np.repeat(np.arange(len(tasks), dtype=np.int32), counts)
    op_of_record = op_of_task[owners]
    op_of_record[records["op_slot"] == OP_NOP] = -1
    listed = TaskList(
        tuple(tasks), records, owners, tuple(names), op_of_task, op_of_record, pinned=True
    )
    return Program(listed, deps, events, sum(plan.joins))


def _write_plan(records: np.ndarray, plan: _Plan, events: int) -> None:
    """Write signal, wait and wait_count of every record; `events` only where one is used."""
    wait = np.full((len(plan.waits), MAX_WAITS), NO_EVENT, dtype=np.int32)
    count = np.zeros((len(plan.waits), MAX_WAITS), dtype=np.uint32)
    for run, (pairs, _) in enumerate(plan.waits):  # per run of records, not per record
        for k, (event, n) in enumerate(pairs):
            wait[run, k], count[run, k] = event, n
    lengths = [n for _, n in plan.waits]
    wait, count = np.repeat(wait, lengths, axis=0), np.repeat(count, lengths, axis=0)
    signal = np.array(plan.signal, dtype=np.int32)
    records["signal"] = signal
    records["wait"] = wait
    records["wait_count"] = count
    records["events"] = np.where((signal != NO_EVENT) | (wait[:, 0] != NO_EVENT), events, 0)


def _check_plan(records: np.ndarray) -> None:
    """The invariant the worker's deadlock freedom rests on (gpuos_worker.cu): every event a
    record waits for is signalled only by earlier records, exactly as many times as it waits for."""
    signal = records["signal"]
    used = signal != NO_EVENT
    last = np.full(int(signal.max(initial=0)) + 1, -1)
    np.maximum.at(last, signal[used], np.flatnonzero(used))
    total = np.bincount(signal[used], minlength=len(last))
    for k in range(MAX_WAITS):
        wait, count = records["wait"][:, k], records["wait_count"][:, k]
        waiting = np.flatnonzero(wait != NO_EVENT)
        bad = (last[wait[waiting]] >= waiting) | (total[wait[waiting]] != count[waiting])
        assert not bad.any(), f"program plan broken at records {waiting[bad][:5].tolist()}"
