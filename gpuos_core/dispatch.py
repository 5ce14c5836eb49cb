"""Transparent PyTorch scheduler: unmodified torch code, small ops batched into runtime submissions.

    with gpuos_core.scheduler(size_threshold=16384, auto_flush_ms=2.0) as sched:
        y = torch.sigmoid(torch.relu(x * 2 + 1))   # queued, fused into one expression operator
        print(y.sum().item())                      # a read: pending work is flushed first

A TorchDispatchMode sees every aten op. Small (numel <= threshold) float elementwise catalogue ops,
softmax/log_softmax and sum/mean are queued as nodes whose result is a real, not yet written
tensor; everything else runs in torch. Pending work is flushed (submitted, waited for) before any
other op reads a pending result or its storage, before an op mutates a pending task's input, on
raw reads torch does not dispatch (printing, tolist, numpy: a small TorchFunctionMode), when the
auto-flush timer fires, and on leaving the context. Views of a pending result do not flush: they
pin it, so it is written even if its own tensor object dies.

At a flush, elementwise nodes are inlined into their consumers' expressions (fusion.py). Each
distinct fused expression is registered once (name from a hash of its canonical text). A flush is
one device program (program.py): the worker runs a task once the tasks whose results it reads are
done, so a chain of dependent tasks costs one submission and one wait.

A traced region (`Scheduler.trace`, tracing.py) records its queued ops once per guard signature
and replays the device program of its final flush afterwards, with no Python per op: the
recording runs the path above, with this mode telling the `Recording` what it cannot replay.

Here: the dispatch mode, the flush and traced regions. Which aten ops are queued and as what:
lowering.py; the queued nodes and the memory they touch: pending.py; guards, recordings and
replays: tracing.py.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from .abi import MAX_DIMS, MAX_SCALARS
from .calls import OpCall
from .catalogue import FLOAT_DTYPES
from .fusion import CATALOGUE_BY_TEXT, Form, constants, forms_of, inputs_of, needed
from .lowering import LOWERED, Lowered, MapOp, broadcast_shape
from .pending import Node, Operand, Pending
from .runtime import Runtime
from .threads import daemon
from .tracing import (
    FLUSH_TIMEOUT_S,
    PLAIN,
    Flushed,
    Guarded,
    Recording,
    Trace,
    TraceStats,
    guard,
)

P = ParamSpec("P")
R = TypeVar("R")
RAW_READS = frozenset(
    {
        "tolist",
        "numpy",
        "__repr__",
        "__str__",
        "__format__",
        "data_ptr",
        "untyped_storage",
        "storage",
        "__array__",
        "__dlpack__",
        "__reduce_ex__",
        "__deepcopy__",
    }
)


@dataclass
class SchedulerStats:
    """What the scheduler did (counters only grow)."""

    intercepted: int = 0  # aten ops queued as nodes
    tasks: int = 0  # runtime tasks submitted
    submissions: int = 0  # runtime.submit calls (one device program per flush)
    flushes: int = 0  # flushes that submitted work
    fused: int = 0  # elementwise ops computed inside another op's task, with no own task
    registered: int = 0  # fused operators this scheduler registered
    # aten op (str(func)) → how often torch ran it (unsupported, too large, or not ours)
    fallbacks: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of one scheduler, validated at construction."""

    size_threshold: int = 16384  # ops whose tensors have more elements run in torch
    auto_flush_ms: float | None = 2.0  # pending work is flushed this long after it was queued
    fuse: bool = True  # inline elementwise chains into one expression operator
    max_pending: int = 4096  # flush when this many nodes are queued

    def __post_init__(self) -> None:
        if self.size_threshold < 1 or self.max_pending < 1:
            raise ValueError("size_threshold and max_pending must be >= 1")
        if self.auto_flush_ms is not None and not self.auto_flush_ms > 0:
            raise ValueError(f"auto_flush_ms must be > 0 or None, got {self.auto_flush_ms}")


class _RawReads(TorchFunctionMode):
    """Flushes before reads torch performs without dispatching an aten op (printing, tolist)."""

    def __init__(self, owner: Scheduler) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        owner = self.owner
        if owner._pending.nodes or owner._recording is not None:  # runs for every torch call
            name = getattr(func, "__name__", "")
            if name in RAW_READS:
                owner._read_on_host(name)
        return func(*args, **(kwargs or {}))


class _Ticker:
    """One thread that calls `fire` once the armed deadline passes."""

    def __init__(self, period_s: float, fire: Callable[[], None]) -> None:
        self.period_s, self.fire = period_s, fire
        self.deadline: float | None = None
        self.closed = False
        self.cond = threading.Condition()
        self.thread = daemon(self._loop, "gpuos-sched-ticker")

    def arm(self) -> None:
        with self.cond:
            if self.deadline is None:
                self.deadline = time.monotonic() + self.period_s
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (
                    self.deadline is None or self.deadline > time.monotonic()
                ):
                    self.cond.wait(
                        None if self.deadline is None else self.deadline - time.monotonic()
                    )
                if self.closed:
                    return
                self.deadline = None
            self.fire()


class Scheduler(TorchDispatchMode):
    """Intercepts small torch ops under `with`, batching them into runtime submissions (see the
    module docstring). `flush()` forces pending work out; `stats` counts what happened. One
    thread's torch code at a time (dispatch modes are per thread); the auto-flush timer runs on
    a thread of its own, on the CUDA stream that was current when the work was queued."""

    def __init__(self, runtime: Runtime, config: SchedulerConfig | None = None) -> None:
        super().__init__()
        self.config = config or SchedulerConfig()
        self.runtime = runtime
        self._device = runtime.device  # read for every op
        self._cuda = self._device.type == "cuda"
        self.stats = SchedulerStats()
        self._lock = threading.RLock()
        self._pending = Pending()
        self._ops: dict[str, str] = {}  # canonical expression → operator name
        self._stream: Any = None  # the CUDA stream pending work follows
        self._ticker: _Ticker | None = None
        self._raw = _RawReads(self)
        self._local = threading.local()
        self._recording: Recording | None = None  # the traced call recording now, if any

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> Scheduler:
        if self.config.auto_flush_ms is not None:
            self._ticker = _Ticker(self.config.auto_flush_ms / 1e3, self._timer_flush)
        self._raw.__enter__()
        self._local.entered = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._raw.__exit__(*exc)
        self._local.entered = False
        try:
            self.flush()
        finally:
            if self._ticker is not None:
                self._ticker.close()
                self._ticker = None

    @contextlib.contextmanager
    def _entered(self) -> Iterator[None]:
        """This scheduler active on this thread for the block: entered here (and left, flushing)
        unless the caller is inside it already."""
        if getattr(self._local, "entered", False):
            yield
        else:
            with self:
                yield

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        with self._lock:
            self._pending.reap()
            lowered = LOWERED.get(id(func))
            out = None if lowered is None else self._intercept(func, lowered, types, args, kwargs)
            if out is not None:
                return out
            of_pending = self._before_fallback(func, args, kwargs)
            recording = self._recording
        self.stats.fallbacks[str(func)] += 1
        result = func(*args, **kwargs)
        if recording is not None:
            recording.ran_in_torch(func, args, result, of_pending)
        return result

    def _intercept(
        self, func: Any, lowered: Lowered, types: Any, args: tuple, kwargs: dict
    ) -> torch.Tensor | None:
        """Queue the op and return its (unwritten) result, or None: torch runs it."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        # Pending results are eligible and alias nothing: only other tensors need the checks.
        others = [t for t in tensors if self._pending.node_of(t) is None]
        if not tensors or not self._eligible(types, others):
            return None
        if any(self._pending.writes(t) for t in others):
            self._flush(f"{func} reads a view of a pending result")  # compute it first
        if self._cuda:
            self._follow_stream()
        p = lowered.bind(args, kwargs)
        return (
            self._map_node(lowered.elementwise(p))
            if lowered.elementwise is not None
            else self._row_node(lowered.row, p)
            if lowered.row
            else self._reduce_node(lowered.reduce, p)
        )

    def _eligible(self, types: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Plain tensors the runtime takes: float, on its device, small, needing no autograd."""
        grad, device, most = torch.is_grad_enabled(), self._device, self.config.size_threshold
        for t in tensors:  # one loop, no generators: this runs for every op
            if (
                type(t) not in PLAIN
                or t.dtype not in FLOAT_DTYPES
                or t.device != device
                or not 0 < t.numel() <= most
                or t.dim() > MAX_DIMS
                or (grad and t.requires_grad)
            ):
                return False
        return all(ty in PLAIN for ty in types)

    def _follow_stream(self) -> None:
        """Pending work runs on one CUDA stream: flush it before queueing work of another."""
        stream = torch.cuda.current_stream(self._device)
        if self._pending and stream != self._stream:
            self._flush("the CUDA stream changed")
        self._stream = stream

    def _operand(self, x: Any) -> Operand:
        if isinstance(x, torch.Tensor):
            return self._pending.node_of(x) or x
        return float(x)

    def _map_node(self, m: MapOp | None) -> torch.Tensor | None:
        if m is None or m.dtype not in FLOAT_DTYPES:
            return None
        shape = broadcast_shape([x.shape for x in m.operands if isinstance(x, torch.Tensor)])
        if shape is None or math.prod(shape) > self.config.size_threshold or len(shape) > MAX_DIMS:
            return None
        return self._add(
            tuple([self._operand(x) for x in m.operands]), shape, m.dtype, build=m.build
        )

    def _row_node(self, op: str, p: dict) -> torch.Tensor | None:
        x, dim = p["self"], p["dim"]
        if p["half_to_float"] or x.dim() == 0:
            return None
        dim %= x.dim()
        return self._add(
            (self._operand(x),),
            tuple(x.shape),
            x.dtype,
            op=op,
            transpose=None if dim == x.dim() - 1 else dim,
        )

    def _reduce_node(self, op: str, p: dict) -> torch.Tensor | None:
        x, dims, keepdim = p["self"], p.get("dim"), bool(p.get("keepdim"))
        if (p["dtype"] not in (None, x.dtype)) or x.dim() == 0:
            return None
        dims = None if not dims else tuple(sorted({d % x.dim() for d in dims}))
        if dims is not None and len(dims) != len(p["dim"]):
            return None
        shape = tuple(1 if dims is None or d in dims else n for d, n in enumerate(x.shape))
        if not keepdim:
            shape = tuple(n for d, n in enumerate(x.shape) if dims is not None and d not in dims)
        return self._add((self._operand(x),), shape, x.dtype, op=op, dims=dims, keepdim=keepdim)

    def _add(
        self, operands: tuple[Operand, ...], shape: tuple[int, ...], dtype: torch.dtype, **kind: Any
    ) -> torch.Tensor:
        """Queue a node; its result, written at the next flush."""
        out = self._pending.add(operands, shape, dtype, self._device, **kind)
        self.stats.intercepted += 1
        if len(self._pending.nodes) >= self.config.max_pending and self._recording is None:
            self._flush(f"{self.config.max_pending} ops pending")  # a region flushes at its end
        elif self._ticker is not None:
            self._ticker.arm()
        return out

    def _before_fallback(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Flush if torch is about to read a pending result or write a pending task's input; pin
        results that a view op is about to alias. Whether it is such a view."""
        if not self._pending:
            return False
        mutates, viewed = func._schema.is_mutable, False
        for t in _tensors(args, kwargs):
            written = self._pending.writes(t)
            if written and func.is_view and not mutates:
                node = self._pending.node_of(t)
                if node is not None:
                    node.pinned = t
                viewed = True
            elif written or (mutates and self._pending.reads(t)):
                what = "reads a pending result" if written else "writes a pending task's input"
                self._flush(f"torch {what} ({func})")
                return False
        return viewed

    # -- flush -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit every pending task and wait until all results are written."""
        self._flush("flush()")

    def _flush(self, why: str) -> Flushed | None:
        """`flush`, saying why (a traced call recording now cannot be replayed: it flushed
        before its end); what ran, if anything did."""
        with self._lock:
            if self._recording is not None:
                self._recording.refuse(f"a flush inside the region: {why}")
            if not self._pending:
                return None
            nodes = self._pending.take()
            with _bare():  # the flush's own tensor calls are not the user's ops
                return self._run(nodes)

    def _read_on_host(self, name: str) -> None:
        """Torch is about to read tensor memory without dispatching (printing, tolist, numpy)."""
        with self._lock:
            if self._recording is not None:
                self._recording.refuse(f"reads tensor values on the host ({name})")
            if self._pending:
                self._flush(name)

    def _timer_flush(self) -> None:
        with self._lock:
            if self._recording is not None:
                return  # a recording region flushes at its end
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self.flush()
            else:
                self.flush()

    def _run(self, nodes: list[Node]) -> Flushed | None:
        """Every needed node as one device program: the worker orders dependent tasks itself."""
        forms = forms_of(nodes, self.config.fuse)
        tasks = needed(nodes, forms)
        if not tasks:
            return None
        build = self.runtime.program()
        for n in tasks:  # queue order: producers first, as a program needs
            build.add(self._call(n, forms.get(id(n))))
        program = build.build()
        batch = self.runtime.submit(program)
        batch.wait(timeout=FLUSH_TIMEOUT_S).check()  # raises TaskFailedError for a failed task
        inlined = frozenset().union(*(forms[id(n)].inlined for n in tasks if id(n) in forms))
        self.stats.tasks += len(tasks)
        self.stats.submissions += 1
        self.stats.fused += len(inlined - {id(n) for n in tasks})
        self.stats.flushes += 1
        return Flushed(tasks, forms, program)

    def _call(self, node: Node, form: Form | None) -> OpCall:
        out = node.tensor()
        inputs = tuple(_tensor_of(x) for x in inputs_of(node, form))
        if form is None:  # a row or reduce node: its one input is a tensor or a node's result
            x = inputs[0]
            if node.transpose is not None:
                x, out = x.transpose(node.transpose, -1), out.transpose(node.transpose, -1)
            return OpCall(node.op, (x,), out, dims=node.dims, keepdim=node.keepdim)
        tree = constants(form.tree, form.scalars)
        name = self._operator(tree.canonical(), len(form.leaves))
        names = [p.name for p in self.runtime.table.current(name).spec.scalars]
        scalars = dict(zip(names, form.scalars[:MAX_SCALARS]))
        return OpCall(name, inputs, out, scalars)

    def _operator(self, canonical: str, arity: int) -> str:
        """The operator computing `canonical`: a catalogue one, or one registered (once) for it."""
        name = self._ops.get(canonical)
        if name is None:
            name = CATALOGUE_BY_TEXT.get((canonical, arity))
        if name is None:
            name = "fx_" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
            if name not in self.runtime.table.names():
                self.runtime.register(name, canonical, arity)
                self.stats.registered += 1
        self._ops[canonical] = name
        return name

    # -- traced regions ----------------------------------------------------------------------
    def trace(self, fn: Callable[P, R], cache_size: int = 8) -> Traced[P, R]:
        """`fn` as a traced region of this scheduler (usable as `@sched.trace`). Its first call
        with new guards records a trace; later calls whose guards match replay it (see
        `Traced`). Keeps at most `cache_size` traces, dropping the least recently used."""
        return Traced(self, fn, cache_size)

    def _record(
        self, recording: Recording, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Any, Flushed | None]:
        """Run fn as usual under this scheduler while `recording` notes what it cannot replay;
        the call's result and its final flush (every result written)."""
        with self._entered():
            with self._lock:
                self._recording = recording
            try:
                returned = fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._recording = None
            return returned, self._flush("")

    def _scheduled(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """fn run as usual under this scheduler (flushed at its end unless already inside)."""
        with self._entered():
            return fn(*args, **kwargs)


class Traced(Generic[P, R]):
    """A function traced by a scheduler (`Scheduler.trace`): called like it, faster when its
    guards repeat.

    A call first flushes pending work (an argument may be a pending result of this scheduler or
    of another one active on the thread), then checks its guards (tracing.py `guard`). The first
    call with a new signature runs the scheduler's usual path (inside the scheduler, or entering
    it for the call) and records: its queued ops, fused, become one device program. Later calls
    with the same signature skip the Python per op: they bind the new arguments and fresh result
    tensors into that program, submit it and wait, and return results already written. Results
    are new tensors every call. A trace that cannot be replayed (an op torch runs other than a
    view, a value read on the host such as .item() or printing, a flush inside the region, a
    result kept other than by returning it) is remembered with its reason and calls with its
    guards run the usual path; `stats` counts all of it. Calls of one traced function run one at
    a time.

    Like a CUDA graph, a replay runs none of the function's Python: side effects other than the
    returned tensors happen only when it records, python values it reads that are not arguments
    (globals, closures, attributes) keep their recorded values, and tensors it reads that are not
    arguments are read in place, as they are at each run.
    """

    def __init__(self, sched: Scheduler, fn: Callable[P, R], cache_size: int) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        functools.update_wrapper(self, fn)
        self.scheduler, self.fn, self.cache_size = sched, fn, cache_size
        self.stats = TraceStats()
        self._cache: collections.OrderedDict[Hashable, Trace | str] = collections.OrderedDict()
        self._lock = threading.RLock()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            self.stats.calls += 1
            active = _active_schedulers()
            outer = next((m for m in active if m._recording is not None), None)
            if outer is not None:
                return self._inside(outer, args, kwargs)
            for sched in {*active, self.scheduler}:
                sched.flush()  # an argument may be a pending result: written first
            with _bare():
                call = guard(args, kwargs)
                entry = self._lookup(call)
                if isinstance(entry, Trace):
                    return entry.replay(call.leaves, call.addresses)
            if entry is None:
                return self._record(call, args, kwargs)
            return self._scheduled(entry, args, kwargs)

    def _lookup(self, call: Guarded) -> Trace | str | None:
        """The trace for `call`'s guards (counted as a replay), why it cannot have one, or None:
        a miss."""
        if call.key is None:
            return call.why
        entry = self._cache.get(call.key)
        if entry is not None:
            self._cache.move_to_end(call.key)
        if isinstance(entry, Trace):
            self.stats.replayed += 1
        return entry

    def _inside(self, outer: Scheduler, args: tuple, kwargs: dict[str, Any]) -> R:
        """A call while a region records: with the same scheduler its ops join that recording.
        Another scheduler's work would be invisible to the recording, so it cannot replay: it
        flushes (its results may be our arguments) and this call runs as usual."""
        if outer is not self.scheduler:
            outer._flush("it calls a function traced by another scheduler")
        return self._scheduled(
            "called while a region records (its ops run in that region)", args, kwargs
        )

    def _record(self, call: Guarded, args: tuple, kwargs: dict[str, Any]) -> R:
        self.stats.misses += 1
        recording = Recording(call)
        returned, flushed = self.scheduler._record(recording, self.fn, args, kwargs)
        entry = recording.finish(returned, flushed, self.scheduler.runtime)
        self._cache[call.key] = entry
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
            self.stats.evicted += 1
        if isinstance(entry, Trace):
            self.stats.recorded += 1
        else:
            self.stats.not_replayable[entry] += 1
        return returned

    def _scheduled(self, why: str, args: tuple, kwargs: dict[str, Any]) -> R:
        """The scheduler's usual path, counted under `why`."""
        self.stats.not_replayable[why] += 1
        return self.scheduler._scheduled(self.fn, *args, **kwargs)


def _active_schedulers() -> list[Scheduler]:
    """The schedulers active on this thread."""
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, Scheduler)]


@contextlib.contextmanager
def _bare() -> Iterator[None]:
    """No torch function or dispatch mode sees the block: the scheduler's own tensor calls (a
    flush's allocations and views, a guard check's metadata reads, a replay's allocations) are
    not ops of the user's code, and cost no interception."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


def _tensor_of(x: Operand) -> torch.Tensor:
    """The tensor a task reads for input `x`: a node's result (or its stand-in), or `x`."""
    if isinstance(x, Node):
        return x.tensor()
    assert isinstance(x, torch.Tensor), "numbers are scalars of a form, not task inputs"
    return x


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def trace(
    fn: Callable[P, R],
    runtime: Runtime,
    cache_size: int = 8,
    size_threshold: int = 16384,
    fuse: bool = True,
) -> Traced[P, R]:
    """`fn` traced by a scheduler of its own over `runtime` (see `Scheduler.trace`); it has no
    auto-flush timer, since a region flushes at its end."""
    config = SchedulerConfig(size_threshold=size_threshold, auto_flush_ms=None, fuse=fuse)
    return Scheduler(runtime, config).trace(fn, cache_size)


def scheduler(
    runtime: Runtime | None = None,
    size_threshold: int = 16384,
    auto_flush_ms: float | None = 2.0,
    fuse: bool = True,
    max_pending: int = 4096,
) -> contextlib.AbstractContextManager[Scheduler]:
    """A scheduler to use as `with scheduler(...) as sched:`. Without `runtime` it makes its own
    (backend "auto") at entry and closes it at exit; `auto_flush_ms=None` turns the timer off;
    `max_pending` queued ops force a flush (ValueError for out-of-range knobs)."""
    config = SchedulerConfig(size_threshold, auto_flush_ms, fuse, max_pending)
    return Scheduler(runtime, config) if runtime is not None else _with_own_runtime(config)


@contextlib.contextmanager
def _with_own_runtime(config: SchedulerConfig) -> Iterator[Scheduler]:
    """A scheduler over a runtime made at entry and closed at exit, after the last flush."""
    with Runtime("auto") as runtime, Scheduler(runtime, config) as sched:
        yield sched
