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

Here: the dispatch mode and the flush. Which aten ops are queued and as what: lowering.py; the
queued nodes and the memory they touch: pending.py.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .abi import MAX_DIMS, MAX_SCALARS
from .calls import OpCall
from .catalogue import FLOAT_DTYPES
from .fusion import CATALOGUE_BY_TEXT, Form, constants, forms_of, needed
from .lowering import MAP_OPS, REDUCE_OPS, ROW_OPS, MapOp, bind, broadcast_shape
from .pending import Node, Operand, Pending
from .runtime import Runtime

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data the runtime may read
RAW_READS = frozenset({"tolist", "numpy", "__repr__", "__str__", "__format__", "data_ptr",
                       "untyped_storage", "storage", "__array__", "__dlpack__", "__reduce_ex__",
                       "__deepcopy__"})


@dataclass
class SchedulerStats:
    """What the scheduler did (counters only grow)."""

    intercepted: int = 0   # aten ops queued as nodes
    tasks: int = 0         # runtime tasks submitted
    submissions: int = 0   # runtime.submit calls (one device program per flush)
    flushes: int = 0       # flushes that submitted work
    fused: int = 0         # elementwise ops computed inside another op's task, with no own task
    registered: int = 0    # fused operators this scheduler registered
    # aten op (str(func)) → how often torch ran it (unsupported, too large, or not ours)
    fallbacks: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of one scheduler, validated at construction."""

    size_threshold: int = 16384    # ops whose tensors have more elements run in torch
    auto_flush_ms: float | None = 2.0  # pending work is flushed this long after it was queued
    fuse: bool = True              # inline elementwise chains into one expression operator
    max_pending: int = 4096        # flush when this many nodes are queued

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

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if self.owner._pending and getattr(func, "__name__", "") in RAW_READS:
            self.owner.flush()
        return func(*args, **(kwargs or {}))


class _Ticker:
    """One thread that calls `fire` once the armed deadline passes."""

    def __init__(self, period_s: float, fire: Callable[[], None]) -> None:
        self.period_s, self.fire = period_s, fire
        self.deadline: float | None = None
        self.closed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="gpuos-sched-ticker", daemon=True)
        self.thread.start()

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
                while not self.closed and (self.deadline is None
                                           or self.deadline > time.monotonic()):
                    self.cond.wait(None if self.deadline is None
                                   else self.deadline - time.monotonic())
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
        self.stats = SchedulerStats()
        self._lock = threading.RLock()
        self._pending = Pending()
        self._ops: dict[str, str] = {}                # canonical expression → operator name
        self._stream: Any = None                      # the CUDA stream pending work follows
        self._ticker: _Ticker | None = None
        self._raw = _RawReads(self)
        self._local = threading.local()

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> Scheduler:
        if self.config.auto_flush_ms is not None:
            self._ticker = _Ticker(self.config.auto_flush_ms / 1e3, self._timer_flush)
        self._raw.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._raw.__exit__(*exc)
        try:
            self.flush()
        finally:
            if self._ticker is not None:
                self._ticker.close()
                self._ticker = None

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(self._local, "inside", False):
            return func(*args, **kwargs)
        with self._lock:
            self._pending.reap()
            out = self._intercept(func, types, args, kwargs)
            if out is not None:
                return out
            self._before_fallback(func, args, kwargs)
        self.stats.fallbacks[str(func)] += 1
        return func(*args, **kwargs)

    def _intercept(self, func: Any, types: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """Queue the op and return its (unwritten) result, or None: torch runs it."""
        if func not in MAP_OPS and func not in ROW_OPS and func not in REDUCE_OPS:
            return None
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or not self._eligible(types, tensors):
            return None
        if any(self._pending.aliases(t) for t in tensors):
            self.flush()  # a view of a pending result is an input: compute it first
        self._follow_stream()
        p = bind(func, args, kwargs)
        return (self._map_node(MAP_OPS[func](p)) if func in MAP_OPS
                else self._row_node(ROW_OPS[func], p) if func in ROW_OPS
                else self._reduce_node(REDUCE_OPS[func], p))

    def _eligible(self, types: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Plain tensors the runtime takes: float, on its device, small, needing no autograd."""
        grad = torch.is_grad_enabled()
        return all(ty in _PLAIN for ty in types) and all(
            type(t) in _PLAIN and t.dtype in FLOAT_DTYPES and t.device == self.runtime.device
            and 0 < t.numel() <= self.config.size_threshold and t.dim() <= MAX_DIMS
            and not (grad and t.requires_grad) for t in tensors)

    def _follow_stream(self) -> None:
        """Pending work runs on one CUDA stream: flush it before queueing work of another."""
        if self.runtime.device.type == "cuda":
            stream = torch.cuda.current_stream(self.runtime.device)
            if self._pending and stream != self._stream:
                self.flush()
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
        return self._add(tuple(self._operand(x) for x in m.operands), shape, m.dtype,
                         build=m.build)

    def _row_node(self, op: str, p: dict) -> torch.Tensor | None:
        x, dim = p["self"], p["dim"]
        if p["half_to_float"] or x.dim() == 0:
            return None
        dim %= x.dim()
        return self._add((self._operand(x),), tuple(x.shape), x.dtype, op=op,
                         transpose=None if dim == x.dim() - 1 else dim)

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

    def _add(self, operands: tuple[Operand, ...], shape: tuple[int, ...], dtype: torch.dtype,
             **kind: Any) -> torch.Tensor:
        """Queue a node; its result, written at the next flush."""
        out = self._pending.add(operands, shape, dtype, self.runtime.device, **kind)
        self.stats.intercepted += 1
        if len(self._pending) >= self.config.max_pending:
            self.flush()
        elif self._ticker is not None:
            self._ticker.arm()
        return out

    def _before_fallback(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Flush if torch is about to read a pending result or write a pending task's input; pin
        results that a view op is about to alias."""
        if not self._pending:
            return
        mutates = func._schema.is_mutable
        for t in _tensors(args, kwargs):
            written = self._pending.writes(t)
            if written and func.is_view and not mutates:
                node = self._pending.node_of(t)
                if node is not None:
                    node.pinned = t
            elif written or (mutates and self._pending.reads(t)):
                self.flush()
                return

    # -- flush -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit every pending task and wait until all results are written."""
        with self._lock:
            if not self._pending:
                return
            nodes = self._pending.take()
            self._local.inside = True
            try:
                self._run(nodes)
            finally:
                self._local.inside = False

    def _timer_flush(self) -> None:
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self.flush()
        else:
            self.flush()

    def _run(self, nodes: list[Node]) -> None:
        """Every needed node as one device program: the worker orders dependent tasks itself."""
        forms = forms_of(nodes, self.config.fuse)
        tasks = needed(nodes, forms)
        if not tasks:
            return
        build = self.runtime.program()
        for n in tasks:  # queue order: producers first, as a program needs
            build.add(self._call(n, forms.get(id(n))))
        batch = self.runtime.submit(build.build())
        batch.wait(timeout=60.0).results()  # raises TaskFailedError for a failed task
        inlined = frozenset().union(*(forms[id(n)].inlined for n in tasks if id(n) in forms))
        self.stats.tasks += len(tasks)
        self.stats.submissions += 1
        self.stats.fused += len(inlined - {id(n) for n in tasks})
        self.stats.flushes += 1

    def _call(self, node: Node, form: Form | None) -> OpCall:
        out = node.tensor()
        if form is None:  # a row or reduce node: its one operand is a tensor or a node
            source = node.operands[0]
            assert not isinstance(source, float), "row and reduce nodes take a tensor"
            x = _tensor_of(source)
            if node.transpose is not None:
                x, out = x.transpose(node.transpose, -1), out.transpose(node.transpose, -1)
            return OpCall(node.op, (x,), out, dims=node.dims, keepdim=node.keepdim)
        tree = constants(form.tree, form.scalars)
        name = self._operator(tree.canonical(), len(form.leaves))
        names = [p.name for p in self.runtime.table.current(name).spec.scalars]
        scalars = dict(zip(names, form.scalars[:MAX_SCALARS]))
        return OpCall(name, tuple(_tensor_of(x) for x in form.leaves), out, scalars)

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


def _tensor_of(x: torch.Tensor | Node) -> torch.Tensor:
    return x.tensor() if isinstance(x, Node) else x


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def scheduler(runtime: Runtime | None = None, size_threshold: int = 16384,
              auto_flush_ms: float | None = 2.0, fuse: bool = True, max_pending: int = 4096
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
