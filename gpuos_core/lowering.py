"""Lowering aten ops for the scheduler: which ops it may queue, and as what.

An elementwise op becomes a `MapOp`: its operands and a function building its expression from
theirs (expr.py nodes), so that chains can be fused into one operator (fusion.py). Softmax-like
row ops and sum/mean map to catalogue operators by name. A lowering returns None where the op's
arguments are outside what the runtime computes exactly as torch does; torch then runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .catalogue import FLOAT_DTYPES
from .expr import BinOp, Call, Neg, Node as ExprNode, Num

aten = torch.ops.aten
Build = Callable[[Sequence[ExprNode]], ExprNode]


class MapOp(NamedTuple):
    """An aten op recognised as elementwise: operands and how to combine their expressions (a
    NamedTuple: made for every queued op, and a frozen dataclass takes three times as long)."""

    operands: tuple[Any, ...]  # tensors and python numbers, in the order `build` takes them
    build: Build
    dtype: torch.dtype  # result dtype, by torch's promotion


@dataclass(frozen=True)
class Lowered:
    """An aten op the scheduler may queue: its schema's argument names and defaults (read once:
    a schema's `arguments` costs a microsecond a call) and what the op becomes."""

    names: tuple[str, ...]
    defaults: tuple[Any, ...]
    elementwise: Callable[[dict], MapOp | None] | None  # its MapOp (None: torch runs the op)
    row: str  # else a row operator (softmax)
    reduce: str  # or a reduction (sum, mean)

    @classmethod
    def of(
        cls,
        func: torch._ops.OpOverload,
        elementwise: Callable[[dict], MapOp | None] | None = None,
        row: str = "",
        reduce: str = "",
    ) -> Lowered:
        arguments = func._schema.arguments
        defaults = (a.default_value if a.has_default_value() else None for a in arguments)
        return cls(tuple(a.name for a in arguments), tuple(defaults), elementwise, row, reduce)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The op's arguments by schema name, defaults filled in."""
        bound = dict(zip(self.names, self.defaults))
        bound.update(zip(self.names, args))
        bound.update(kwargs)
        return bound


def _number(v: Any) -> bool:
    """A python number the runtime can carry as a float32 scalar."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) and abs(v) < 3.0e38


def _value(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or _number(v)


def _dtype(*values: Any) -> torch.dtype:
    """torch's result dtype of one or two values (tensors, python numbers)."""
    if len(values) == 1:
        return values[0].dtype
    a, b = values
    if (
        type(a) is torch.Tensor
        and a.dtype in FLOAT_DTYPES
        and (type(b) in (int, float) or (type(b) is torch.Tensor and b.dtype == a.dtype))
    ):
        return a.dtype  # what result_type says for these, without its microsecond
    return torch.result_type(a, b)


def _call(fn: str) -> Build:
    return lambda x: Call(fn, tuple(x))


def _unary(fn: str) -> Callable[[dict], MapOp | None]:
    build = _call(fn)
    return lambda p: MapOp((p["self"],), build, _dtype(p["self"]))


def _binop(sym: str, swap: bool = False) -> Callable[[dict], MapOp | None]:
    """self ∘ other (other ∘ self when `swap`); add/sub's alpha scales the second operand."""

    def plain(x: Sequence[ExprNode]) -> ExprNode:
        return BinOp(sym, x[0], x[1])

    def scaled(x: Sequence[ExprNode]) -> ExprNode:
        return BinOp(sym, x[0], BinOp("*", x[1], x[2]))

    def lower(p: dict) -> MapOp | None:
        a, b = (p["other"], p["self"]) if swap else (p["self"], p["other"])
        alpha = p.get("alpha", 1)
        if not (_value(a) and _value(b) and (alpha is None or _number(alpha))):
            return None
        dtype = _dtype(p["self"], p["other"])
        if alpha in (None, 1):
            return MapOp((a, b), plain, dtype)
        return MapOp((a, b, alpha), scaled, dtype)

    return lower


def _pair(fn: str, first: str, second: str) -> Callable[[dict], MapOp | None]:
    build = _call(fn)

    def lower(p: dict) -> MapOp | None:
        a, b = p[first], p[second]
        return MapOp((a, b), build, _dtype(a, b)) if _value(a) and _value(b) else None

    return lower


def _params(fn: str, *names: str) -> Callable[[dict], MapOp | None]:
    """fn(self, *scalar parameters)."""
    build = _call(fn)

    def lower(p: dict) -> MapOp | None:
        values = [p[n] for n in names]
        if not all(_number(v) for v in values):
            return None
        return MapOp((p["self"], *values), build, _dtype(p["self"]))

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
    if (
        p["layout"] not in (None, torch.strided)
        or p["pin_memory"]
        or p["device"] not in (None, x.device)
        or dtype not in FLOAT_DTYPES
        or p["memory_format"] not in (None, torch.preserve_format, torch.contiguous_format)
    ):
        return None
    return MapOp((x,), lambda e: e[0], dtype)


MAP_OPS: dict[Any, Callable[[dict], MapOp | None]] = {
    aten.add.Tensor: _binop("+"),
    aten.add.Scalar: _binop("+"),
    aten.sub.Tensor: _binop("-"),
    aten.sub.Scalar: _binop("-"),
    aten.rsub.Tensor: _binop("-", swap=True),
    aten.rsub.Scalar: _binop("-", swap=True),
    aten.mul.Tensor: _binop("*"),
    aten.mul.Scalar: _binop("*"),
    aten.div.Tensor: _binop("/"),
    aten.div.Scalar: _binop("/"),
    aten.div.Tensor_mode: _div_mode,
    aten.maximum.default: _pair("max", "self", "other"),
    aten.minimum.default: _pair("min", "self", "other"),
    aten.pow.Tensor_Tensor: _pair("pow", "self", "exponent"),
    aten.pow.Tensor_Scalar: _pair("pow", "self", "exponent"),
    aten.pow.Scalar: _pair("pow", "self", "exponent"),
    aten.neg.default: lambda p: MapOp((p["self"],), lambda x: Neg(x[0]), _dtype(p["self"])),
    aten.reciprocal.default: lambda p: MapOp(
        (p["self"],), lambda x: BinOp("/", Num(1.0), x[0]), _dtype(p["self"])
    ),
    **{
        getattr(aten, fn).default: _unary(fn)
        for fn in (
            "relu",
            "sigmoid",
            "tanh",
            "exp",
            "log",
            "sqrt",
            "rsqrt",
            "abs",
            "sin",
            "cos",
            "silu",
            "hardsigmoid",
            "hardswish",
        )
    },
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
REDUCE_OPS = {
    aten.sum.default: "sum",
    aten.sum.dim_IntList: "sum",
    aten.mean.default: "mean",
    aten.mean.dim: "mean",
}
# Every op above by id: an OpOverload hashes in Python, an id in C (they live as long as torch).
LOWERED: dict[int, Lowered] = {
    **{id(f): Lowered.of(f, elementwise=fn) for f, fn in MAP_OPS.items()},
    **{id(f): Lowered.of(f, row=op) for f, op in ROW_OPS.items()},
    **{id(f): Lowered.of(f, reduce=op) for f, op in REDUCE_OPS.items()},
}


def broadcast_shape(shapes: list[torch.Size]) -> tuple[int, ...] | None:
    """The broadcast shape, or None where torch would raise (it then raises for the caller).
    Plain python: torch.broadcast_shapes costs tens of microseconds a call."""
    first = shapes[0]
    if shapes.count(first) == len(shapes):  # the usual case, without the loops below
        return tuple(first)
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, start=ndim - len(shape)):
            if n != out[i] and 1 not in (n, out[i]):
                return None
            out[i] = n if n != 1 else out[i]
    return tuple(out)
