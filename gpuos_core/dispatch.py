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

At a flush, elementwise nodes are inlined into their consumers' expressions (at most 3 tensor
inputs, 4 scalar parameters; further scalars become constants): a node gets a task of its own
only if its tensor is still referenced, a reduction or row op reads it, or a consumer could not
inline it. Each distinct fused expression is registered once (name from a hash of its canonical
text). A flush is one device program (program.py): the worker runs a task once the tasks whose
results it reads are done, so a chain of dependent tasks costs one submission and one wait.
"""
from __future__ import annotations

import collections
import hashlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .abi import MAX_DIMS, MAX_SCALARS
from .calls import OpCall
from .catalogue import CATALOGUE, FLOAT_DTYPES
from .expr import INPUTS, MAX_EXPR_CHARS, BinOp, Call, Input, Neg, Num, Scalar, Node as ExprNode
from .runtime import Runtime

aten = torch.ops.aten
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data the runtime may read
Operand = Union[torch.Tensor, float, "Node"]
Build = Callable[[Sequence[ExprNode]], ExprNode]
MAX_PAREN_DEPTH = 28  # canonical parentheses; the parser also counts calls and unary minus
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


@dataclass(eq=False)
class Node:
    """One queued op. Holds its output only weakly (pinned: strongly) so that a result nobody can
    read is never written; its operands (tensors, numbers, other nodes) strongly."""

    operands: tuple[Operand, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    ref: weakref.ref[torch.Tensor]
    build: Build | None = None       # elementwise: expression over the operands' expressions
    op: str = ""                     # row/reduce: catalogue operator name
    device: torch.device = torch.device("cpu")
    dims: tuple[int, ...] | None = None  # sum/mean dims (None: all)
    keepdim: bool = False
    transpose: int | None = None     # softmax over this dim, via a view swapping it with the last
    pinned: torch.Tensor | None = None  # set when a view of the result escaped
    temp: torch.Tensor | None = None    # output allocated at flush when the result object died

    def alive(self) -> bool:
        return self.pinned is not None or self.ref() is not None

    def tensor(self) -> torch.Tensor:
        """The tensor this node writes: the caller's, or a temporary if that one died."""
        out = self.pinned if self.pinned is not None else self.ref()
        if out is None:
            if self.temp is None:
                self.temp = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            out = self.temp
        return out


@dataclass(frozen=True)
class Form:
    """An elementwise node as an expression over tensor leaves and scalar parameters."""

    tree: ExprNode
    leaves: tuple[Union[torch.Tensor, Node], ...]  # Input(k) reads leaves[k]
    scalars: tuple[float, ...]                       # Scalar(k) reads scalars[k]
    inlined: frozenset[int] = frozenset()            # ids of nodes computed inside this form


# -- lowering aten ops ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MapOp:
    """An aten op recognised as elementwise: operands and how to combine their expressions."""

    operands: tuple[Any, ...]   # tensors and python numbers, in the order `build` takes them
    build: Build
    dtype: torch.dtype          # result dtype, by torch's promotion


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        else:
            bound[a.name] = a.default_value if a.has_default_value() else None
    return bound


def _number(v: Any) -> bool:
    """A python number the runtime can carry as a float32 scalar."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) and abs(v) < 3.0e38


def _value(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or _number(v)


def _dtype(*values: Any) -> torch.dtype:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(values) == 1:
        return tensors[0].dtype
    return torch.result_type(values[0], values[1])


def _call(fn: str) -> Build:
    return lambda x: Call(fn, tuple(x))


def _unary(fn: str) -> Callable[[dict], MapOp | None]:
    return lambda p: MapOp((p["self"],), _call(fn), _dtype(p["self"]))


def _binop(sym: str, swap: bool = False) -> Callable[[dict], MapOp | None]:
    """self ∘ other (other ∘ self when `swap`); add/sub's alpha scales the second operand."""
    def lower(p: dict) -> MapOp | None:
        a, b = (p["other"], p["self"]) if swap else (p["self"], p["other"])
        alpha = p.get("alpha", 1)
        if not (_value(a) and _value(b) and (alpha is None or _number(alpha))):
            return None
        dtype = _dtype(p["self"], p["other"])
        if alpha in (None, 1):
            return MapOp((a, b), lambda x: BinOp(sym, x[0], x[1]), dtype)
        return MapOp((a, b, alpha), lambda x: BinOp(sym, x[0], BinOp("*", x[1], x[2])), dtype)
    return lower


def _pair(fn: str, first: str, second: str) -> Callable[[dict], MapOp | None]:
    def lower(p: dict) -> MapOp | None:
        a, b = p[first], p[second]
        return MapOp((a, b), _call(fn), _dtype(a, b)) if _value(a) and _value(b) else None
    return lower


def _params(fn: str, *names: str) -> Callable[[dict], MapOp | None]:
    """fn(self, *scalar parameters)."""
    def lower(p: dict) -> MapOp | None:
        values = [p[n] for n in names]
        if not all(_number(v) for v in values):
            return None
        return MapOp((p["self"], *values), _call(fn), _dtype(p["self"]))
    return lower


def _gelu(p: dict) -> MapOp | None:
    fn = {"none": "gelu", "tanh": "gelu_tanh"}.get(p["approximate"])
    return None if fn is None else MapOp((p["self"],), _call(fn), _dtype(p["self"]))


def _elu(p: dict) -> MapOp | None:
    if p["scale"] != 1 or p["input_scale"] != 1:
        return None
    return _params("elu", "alpha")(p)


def _clamp(p: dict) -> MapOp | None:
    lo, hi = p["min"], p["max"]
    if lo is None and hi is None:
        return None
    if lo is None:
        return _params("clamp_max", "max")(p)
    return _params("clamp_min", "min")(p) if hi is None else _params("clamp", "min", "max")(p)


def _div_mode(p: dict) -> MapOp | None:
    return _binop("/")(p) if p["rounding_mode"] is None else None


def _to_copy(p: dict) -> MapOp | None:
    """A dtype conversion on the same device: identity, cast at the store."""
    x, dtype = p["self"], p["dtype"] or p["self"].dtype
    if (p["layout"] not in (None, torch.strided) or p["pin_memory"]
            or p["device"] not in (None, x.device) or dtype not in FLOAT_DTYPES
            or p["memory_format"] not in (None, torch.preserve_format, torch.contiguous_format)):
        return None
    return MapOp((x,), lambda e: e[0], dtype)


MAP_OPS: dict[Any, Callable[[dict], MapOp | None]] = {
    aten.add.Tensor: _binop("+"), aten.add.Scalar: _binop("+"),
    aten.sub.Tensor: _binop("-"), aten.sub.Scalar: _binop("-"),
    aten.rsub.Tensor: _binop("-", swap=True), aten.rsub.Scalar: _binop("-", swap=True),
    aten.mul.Tensor: _binop("*"), aten.mul.Scalar: _binop("*"),
    aten.div.Tensor: _binop("/"), aten.div.Scalar: _binop("/"), aten.div.Tensor_mode: _div_mode,
    aten.maximum.default: _pair("max", "self", "other"),
    aten.minimum.default: _pair("min", "self", "other"),
    aten.pow.Tensor_Tensor: _pair("pow", "self", "exponent"),
    aten.pow.Tensor_Scalar: _pair("pow", "self", "exponent"),
    aten.pow.Scalar: _pair("pow", "self", "exponent"),
    aten.neg.default: lambda p: MapOp((p["self"],), lambda x: Neg(x[0]), _dtype(p["self"])),
    aten.reciprocal.default: lambda p: MapOp((p["self"],), lambda x: BinOp("/", Num(1.0), x[0]),
                                             _dtype(p["self"])),
    **{getattr(aten, fn).default: _unary(fn) for fn in (
        "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos", "silu",
        "hardsigmoid", "hardswish")},
    aten.gelu.default: _gelu,
    aten.leaky_relu.default: _params("leaky_relu", "negative_slope"),
    aten.hardtanh.default: _params("hardtanh", "min_val", "max_val"),
    aten.elu.default: _elu,
    aten.softplus.default: _params("softplus", "beta", "threshold"),
    aten.clamp.default: _clamp,
    aten.clamp_min.default: _params("clamp_min", "min"),
    aten.clamp_max.default: _params("clamp_max", "max"),
    aten._to_copy.default: _to_copy,
}
ROW_OPS = {aten._softmax.default: "softmax", aten._log_softmax.default: "log_softmax"}
REDUCE_OPS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean",
              aten.mean.dim: "mean"}


# -- expressions ---------------------------------------------------------------------------------
def _rewrite(tree: ExprNode, leaf: Callable[[ExprNode], ExprNode]) -> ExprNode:
    """`tree` with every leaf (input, scalar, number) replaced by `leaf(it)`."""
    if isinstance(tree, Neg):
        return Neg(_rewrite(tree.operand, leaf))
    if isinstance(tree, BinOp):
        return BinOp(tree.op, _rewrite(tree.left, leaf), _rewrite(tree.right, leaf))
    if isinstance(tree, Call):
        return Call(tree.fn, tuple(_rewrite(a, leaf) for a in tree.args))
    return leaf(tree)


def _remap(tree: ExprNode, inputs: Sequence[int], scalars: Sequence[int]) -> ExprNode:
    """`tree` with Input(k) → Input(inputs[k]) and Scalar(k) → Scalar(scalars[k])."""
    return _rewrite(tree, lambda n: Input(inputs[n.index]) if isinstance(n, Input)
                    else Scalar(scalars[n.index]) if isinstance(n, Scalar) else n)


def _constants(tree: ExprNode, scalars: Sequence[float]) -> ExprNode:
    """Scalars past the task's MAX_SCALARS become constants of the expression."""
    return _rewrite(tree, lambda n: Num(float(scalars[n.index]))
                    if isinstance(n, Scalar) and n.index >= MAX_SCALARS else n)


def _combine(parts: Sequence[Form], build: Build) -> Form:
    """`build` applied to the parts; leaves (by identity) and scalars deduplicated."""
    leaves: list[Any] = []
    scalars: list[float] = []
    trees = []
    for part in parts:
        lmap = [_index_of(leaves, leaf) for leaf in part.leaves]
        smap = [_index_eq(scalars, s) for s in part.scalars]
        trees.append(_remap(part.tree, lmap, smap))
    inlined = frozenset().union(*(p.inlined for p in parts))
    return Form(build(trees), tuple(leaves), tuple(scalars), inlined)


def _index_of(items: list[Any], item: Any) -> int:
    for i, x in enumerate(items):
        if x is item:
            return i
    items.append(item)
    return len(items) - 1


def _index_eq(items: list[float], value: float) -> int:
    if value in items:
        return items.index(value)
    items.append(value)
    return len(items) - 1


def _fits(form: Form) -> bool:
    """Whether the form can be one task: few enough inputs, text and nesting the parser takes."""
    if len(form.leaves) > len(INPUTS):
        return False
    text = _constants(form.tree, form.scalars).canonical()
    depth = best = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        best = max(best, depth)
    return len(text) <= MAX_EXPR_CHARS - 64 and best <= MAX_PAREN_DEPTH


# -- the scheduler -------------------------------------------------------------------------------
class _RawReads(TorchFunctionMode):
    """Flushes before reads torch performs without dispatching an aten op (printing, tolist)."""

    def __init__(self, owner: "Scheduler") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if self.owner._nodes and getattr(func, "__name__", "") in RAW_READS:
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

    def __init__(self, runtime: Runtime | None = None, config: SchedulerConfig | None = None
                 ) -> None:
        super().__init__()
        self.config = config or SchedulerConfig()
        self._given = runtime
        self.runtime: Runtime | None = runtime
        self.stats = SchedulerStats()
        self._lock = threading.RLock()
        self._nodes: list[Node] = []
        self._by_id: dict[int, Node] = {}             # id(result tensor) → node
        self._out_storages: collections.Counter[int] = collections.Counter()
        self._in_storages: collections.Counter[int] = collections.Counter()
        self._dead: collections.deque[tuple[int, int, int]] = collections.deque()
        self._epoch = 0
        self._ops: dict[str, str] = {}                # canonical expression → operator name
        self._stream: Any = None
        self._ticker: _Ticker | None = None
        self._raw = _RawReads(self)
        self._local = threading.local()

    # -- context -----------------------------------------------------------------------------
    def __enter__(self) -> "Scheduler":
        if self.runtime is None:
            self.runtime = Runtime("auto")
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
            if self._given is None and self.runtime is not None:
                self.runtime.close()
                self.runtime = None

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(self._local, "inside", False):
            return func(*args, **kwargs)
        with self._lock:
            self._reap()
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
        if any(self._aliases_pending(t) for t in tensors):
            self.flush()  # a view of a pending result is an input: compute it first
        p = _bind(func, args, kwargs)
        made = (self._map_node(MAP_OPS[func](p)) if func in MAP_OPS
                else self._row_node(ROW_OPS[func], p) if func in ROW_OPS
                else self._reduce_node(REDUCE_OPS[func], p))
        return None if made is None else self._queue(made)

    def _eligible(self, types: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Plain tensors the runtime takes: float, on its device, small, needing no autograd."""
        grad = torch.is_grad_enabled()
        return all(ty in _PLAIN for ty in types) and all(
            type(t) in _PLAIN and t.dtype in FLOAT_DTYPES and t.device == self.runtime.device
            and 0 < t.numel() <= self.config.size_threshold and t.dim() <= MAX_DIMS
            and not (grad and t.requires_grad) for t in tensors)

    def _aliases_pending(self, t: torch.Tensor) -> bool:
        node = self._by_id.get(id(t))
        if node is not None and node.ref() is t:
            return False
        return self._out_storages[_storage(t)] > 0

    def _operand(self, x: Any) -> Operand:
        if isinstance(x, torch.Tensor):
            node = self._by_id.get(id(x))
            return node if node is not None and node.ref() is x else x
        return float(x)

    def _map_node(self, m: MapOp | None) -> tuple[Node, torch.Tensor] | None:
        if m is None or m.dtype not in FLOAT_DTYPES:
            return None
        shape = _broadcast([x.shape for x in m.operands if isinstance(x, torch.Tensor)])
        if shape is None or math.prod(shape) > self.config.size_threshold or len(shape) > MAX_DIMS:
            return None
        return self._node(tuple(self._operand(x) for x in m.operands), shape, m.dtype,
                          build=m.build)

    def _row_node(self, op: str, p: dict) -> tuple[Node, torch.Tensor] | None:
        x, dim = p["self"], p["dim"]
        if p["half_to_float"] or x.dim() == 0:
            return None
        dim %= x.dim()
        return self._node((self._operand(x),), tuple(x.shape), x.dtype, op=op,
                          transpose=None if dim == x.dim() - 1 else dim)

    def _reduce_node(self, op: str, p: dict) -> tuple[Node, torch.Tensor] | None:
        x, dims, keepdim = p["self"], p.get("dim"), bool(p.get("keepdim"))
        if (p["dtype"] not in (None, x.dtype)) or x.dim() == 0:
            return None
        dims = None if not dims else tuple(sorted({d % x.dim() for d in dims}))
        if dims is not None and len(dims) != len(p["dim"]):
            return None
        shape = tuple(1 if dims is None or d in dims else n for d, n in enumerate(x.shape))
        if not keepdim:
            shape = tuple(n for d, n in enumerate(x.shape) if dims is not None and d not in dims)
        return self._node((self._operand(x),), shape, x.dtype, op=op, dims=dims, keepdim=keepdim)

    def _node(self, operands: tuple[Operand, ...], shape: tuple[int, ...], dtype: torch.dtype,
              **kind: Any) -> tuple[Node, torch.Tensor]:
        out = torch.empty(shape, dtype=dtype, device=self.runtime.device)
        storage, dead = _storage(out), self._dead
        # Called when the result dies (any thread): queued, applied under the lock by _reap.
        ref = weakref.ref(out, lambda _, e=self._epoch, k=id(out): dead.append((e, k, storage)))
        node = Node(operands, shape, dtype, ref, device=self.runtime.device, **kind)
        self._by_id[id(out)] = node
        self._out_storages[storage] += 1
        return node, out

    def _queue(self, made: tuple[Node, torch.Tensor]) -> torch.Tensor:
        node, out = made
        if self.runtime.device.type == "cuda":
            stream = torch.cuda.current_stream(self.runtime.device)
            if self._nodes and stream != self._stream:
                self.flush()
            self._stream = stream
        for x in node.operands:
            if isinstance(x, torch.Tensor):
                self._in_storages[_storage(x)] += 1
        self._nodes.append(node)
        self.stats.intercepted += 1
        if len(self._nodes) >= self.config.max_pending:
            self.flush()
        elif self._ticker is not None:
            self._ticker.arm()
        return out

    def _reap(self) -> None:
        """Forget results that died (weakref callbacks queue them; processed under the lock)."""
        while self._dead:
            epoch, key, storage = self._dead.popleft()
            if epoch == self._epoch:
                self._out_storages[storage] -= 1
                node = self._by_id.get(key)
                if node is not None and node.ref() is None:  # not a newer result at that id
                    del self._by_id[key]

    def _before_fallback(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Flush if torch is about to read a pending result or write a pending task's input; pin
        results that a view op is about to alias."""
        if not self._nodes:
            return
        mutates = func._schema.is_mutable
        for t in _tensors(args, kwargs):
            s = _storage(t)
            if self._out_storages[s] > 0 and func.is_view and not mutates:
                node = self._by_id.get(id(t))
                if node is not None and node.ref() is t:
                    node.pinned = t
            elif self._out_storages[s] > 0 or (mutates and self._in_storages[s] > 0):
                self.flush()
                return

    # -- flush -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit every pending task and wait until all results are written."""
        with self._lock:
            if not self._nodes:
                return
            nodes, self._nodes = self._nodes, []
            self._by_id.clear()
            self._out_storages.clear()
            self._in_storages.clear()
            self._epoch += 1
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
        forms = self._forms(nodes)
        needed = _needed(nodes, forms)
        if not needed:
            return
        build = self.runtime.program()
        for n in needed:  # queue order: producers first, as a program needs
            build.add(self._call(n, forms.get(id(n))))
        batch = self.runtime.submit(build.build())
        batch.wait(timeout=60.0).results()  # raises TaskFailedError for a failed task
        inlined = frozenset().union(*(forms[id(n)].inlined for n in needed if id(n) in forms))
        self.stats.tasks += len(needed)
        self.stats.submissions += 1
        self.stats.fused += len(inlined - {id(n) for n in needed})
        self.stats.flushes += 1

    def _forms(self, nodes: Sequence[Node]) -> dict[int, Form]:
        """Expression forms of the elementwise nodes, in queue order (producers first)."""
        forms: dict[int, Form] = {}
        for n in nodes:
            if n.build is None:
                continue
            parts = [self._part(x, forms) for x in n.operands]
            form = _combine(parts, n.build)
            while not _fits(form):  # materialise the widest inlined producer instead
                k = max((i for i, x in enumerate(n.operands) if isinstance(x, Node)
                         and parts[i].leaves != (x,)), key=lambda i: len(parts[i].leaves))
                parts[k] = Form(Input(0), (n.operands[k],), ())
                form = _combine(parts, n.build)
            forms[id(n)] = form
        return forms

    def _part(self, x: Operand, forms: dict[int, Form]) -> Form:
        if isinstance(x, Node) and self.config.fuse and id(x) in forms:
            f = forms[id(x)]
            return Form(f.tree, f.leaves, f.scalars, f.inlined | {id(x)})
        if isinstance(x, float):
            return Form(Scalar(0), (), (x,))
        return Form(Input(0), (x,), ())

    def _call(self, node: Node, form: Form | None) -> OpCall:
        out = node.tensor()
        if form is None:
            x = _tensor_of(node.operands[0])
            if node.transpose is not None:
                x, out = x.transpose(node.transpose, -1), out.transpose(node.transpose, -1)
            return OpCall(node.op, (x,), out, dims=node.dims, keepdim=node.keepdim)
        tree = _constants(form.tree, form.scalars)
        name = self._operator(tree.canonical(), len(form.leaves))
        names = [p.name for p in self.runtime.table.current(name).spec.scalars]
        scalars = dict(zip(names, form.scalars[:MAX_SCALARS]))
        return OpCall(name, tuple(_tensor_of(x) for x in form.leaves), out, scalars)

    def _operator(self, canonical: str, arity: int) -> str:
        """The operator computing `canonical`: a catalogue one, or one registered (once) for it."""
        name = self._ops.get(canonical)
        if name is None:
            name = _CATALOGUE_BY_TEXT.get((canonical, arity))
        if name is None:
            name = "fx_" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
            if name not in self.runtime.table.names():
                self.runtime.register(name, canonical, arity)
                self.stats.registered += 1
        self._ops[canonical] = name
        return name


def _needed(nodes: Sequence[Node], forms: dict[int, Form]) -> list[Node]:
    """Nodes that must be written: live results and what those read, in queue order."""
    need: set[int] = set()
    for n in reversed(nodes):
        if n.alive() or id(n) in need:
            need.add(id(n))
            need.update(id(d) for d in _deps(n, forms))
    return [n for n in nodes if id(n) in need]


def _deps(n: Node, forms: dict[int, Form]) -> list[Node]:
    sources = forms[id(n)].leaves if id(n) in forms else n.operands
    return [x for x in sources if isinstance(x, Node)]


def _broadcast(shapes: Sequence[torch.Size]) -> tuple[int, ...] | None:
    """The broadcast shape, or None where torch would raise (it then raises for the caller).
    Plain python: torch.broadcast_shapes costs tens of microseconds a call."""
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, start=ndim - len(shape)):
            if n != out[i] and 1 not in (n, out[i]):
                return None
            out[i] = n if n != 1 else out[i]
    return tuple(out)


def _tensor_of(x: Union[torch.Tensor, Node]) -> torch.Tensor:
    return x.tensor() if isinstance(x, Node) else x


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


_CATALOGUE_BY_TEXT: dict[tuple[str, int], str] = {
    (spec.expression.canonical, spec.arity): name
    for name, spec in CATALOGUE.items() if spec.expression is not None}


def scheduler(runtime: Runtime | None = None, size_threshold: int = 16384,
              auto_flush_ms: float | None = 2.0, fuse: bool = True, max_pending: int = 4096
              ) -> Scheduler:
    """A scheduler to use as `with scheduler(...) as sched:`. Without `runtime` it makes its own
    (backend "auto") at entry and closes it at exit; `auto_flush_ms=None` turns the timer off;
    `max_pending` queued ops force a flush (ValueError for out-of-range knobs)."""
    return Scheduler(runtime, SchedulerConfig(size_threshold, auto_flush_ms, fuse, max_pending))
