"""Operator families: how the tasks of one kind of operator are validated, laid out and computed.

A family knows the shapes its kernels accept, the layout the device code expects (DESIGN.md
"Operators"; cuda/ops/*.cuh state the same contract), how many work items a task has (elements or
rows, which tiles split), and which CUDA macro instantiates a version of it. Every operator of the
catalogue belongs to exactly one family.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .abi import MAX_DIMS
from .calls import Params
from .errors import TensorSpecError
from .expr import Expr, evaluate

Tensors = Sequence[torch.Tensor]
RowFn = Callable[[Tensors, tuple[float, ...]], torch.Tensor]
MAX_HEAD_DIM = 256  # attention decode keeps one head's output in static shared memory


@dataclass(frozen=True)
class Layout:
    """What a family decided for one call: encoded views, output shape and work items."""

    inputs: tuple[torch.Tensor, ...]   # views as encoded (broadcasts expanded)
    out_shape: tuple[int, ...]         # shape of the caller's output
    ref_shape: tuple[int, ...]         # shape of the encoded output (keepdim layout for reductions)
    items: int                         # work items of the whole task
    reduce_dims: tuple[int, ...] = ()  # reductions only


class Family:
    """Base: subclasses define `layout`, `compute` and the CUDA instantiation."""

    name: str = ""
    header: str = ""  # cuda/ header defining the macro
    macro: str = ""   # GPUOS_DEFINE_* macro taking the version's symbol
    rows_are_items = False  # work items: rows of the last dim (True) or output elements (False)

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        """Validate input shapes and decide the encoded layout; TensorSpecError says what to fix."""
        raise NotImplementedError

    def derived_scalar(self, name: str, inputs: Tensors) -> float | None:
        """Value of a parameter the caller left out and that has no default, if the family has one."""
        return None

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        """Torch implementation over `xs` as laid out (fp32 or wider); returns the encoded output's
        shape. `expr` is the version's expression (map operators only)."""
        raise NotImplementedError


def _broadcast(shapes: Sequence[Sequence[int]], what: str) -> tuple[int, ...]:
    """The broadcast of `shapes` (numpy rules). Plain Python: torch.broadcast_shapes costs tens of
    microseconds a call, which every prepared task paid."""
    width = max(map(len, shapes), default=0)
    out: list[int] = []
    for sizes in zip(*(((1,) * (width - len(s)) + tuple(s)) for s in shapes)):
        wide = {n for n in sizes if n != 1}
        if len(wide) > 1:
            raise TensorSpecError(f"{what}: shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(wide.pop() if wide else 1)
    return tuple(out)


def _check_ndim(shape: Sequence[int], what: str, least: int = 0) -> None:
    if not least <= len(shape) <= MAX_DIMS:
        raise TensorSpecError(f"{what} must have {least} to {MAX_DIMS} dims, got shape {tuple(shape)}")


def _rows(shape: Sequence[int]) -> int:
    return math.prod(shape[:-1]) if shape else 1


class MapFamily(Family):
    """Elementwise: out = f(A, B, C) with broadcasting; items are output elements."""

    name, header, macro = "map", "ops/map.cuh", "GPUOS_DEFINE_MAP"

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        shape = _broadcast([x.shape for x in inputs], "elementwise inputs")
        _check_ndim(shape, "the broadcast output")
        views = tuple(x if x.shape == shape else x.expand(shape) for x in inputs)
        return Layout(views, shape, shape, math.prod(shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        assert expr is not None, "a map operator version always has an expression"
        return evaluate(expr, xs, p.scalars)


class RowFamily(Family):
    """One row (the last dim) at a time: softmax, norms; trailing 1-D parameters over the row."""

    header = "ops/rows.cuh"
    rows_are_items = True

    def __init__(self, name: str, macro: str, fn: RowFn) -> None:
        self.name, self.macro, self._fn = name, macro, fn

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        x = inputs[0]
        _check_ndim(x.shape, f"{self.name} input", least=1)
        for i, w in enumerate(inputs[1:], start=1):
            if tuple(w.shape) != (x.shape[-1],):
                raise TensorSpecError(
                    f"{self.name} input {i} must have shape ({x.shape[-1]},) to match the last dim "
                    f"of input 0 {tuple(x.shape)}, got {tuple(w.shape)}")
        return Layout(tuple(inputs), tuple(x.shape), tuple(x.shape), _rows(x.shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        return self._fn(xs, p.scalars)


def _layernorm(xs: Tensors, s: tuple[float, ...]) -> torch.Tensor:
    n = xs[0].shape[-1]
    w, b = (list(xs[1:]) + [None, None])[:2]
    return torch.nn.functional.layer_norm(xs[0], (n,), w, b, eps=s[0])


def _rmsnorm(xs: Tensors, s: tuple[float, ...]) -> torch.Tensor:
    x = xs[0]
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + s[0])
    return y * xs[1] if len(xs) > 1 else y


class ReduceFamily(Family):
    """sum/mean over chosen dims; items are output elements; encoded output keeps reduced dims."""

    header = "ops/reduce.cuh"

    def __init__(self, name: str, macro: str, mean: bool) -> None:
        self.name, self.macro, self._mean = name, macro, mean

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        x = inputs[0]
        _check_ndim(x.shape, f"{self.name} input")
        rdims = self._dims(dims, x.dim())
        ref = tuple(1 if d in rdims else n for d, n in enumerate(x.shape))
        out = ref if keepdim else tuple(n for d, n in enumerate(x.shape) if d not in rdims)
        return Layout((x,), out, ref, math.prod(ref), rdims)

    def _dims(self, dims: tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
        if dims is None:
            return tuple(range(ndim))
        if any(not -max(ndim, 1) <= d < max(ndim, 1) for d in dims):
            raise TensorSpecError(f"{self.name}: dims {dims} out of range for a {ndim}-dim input")
        norm = tuple(sorted({d % max(ndim, 1) for d in dims}))
        if len(norm) != len(dims):
            raise TensorSpecError(f"{self.name}: dims {dims} name a dim twice")
        return norm

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        if not p.reduce_dims:
            return xs[0].clone()
        fn = torch.mean if self._mean else torch.sum
        return fn(xs[0], dim=p.reduce_dims, keepdim=True)


class RotaryFamily(Family):
    """Rotary embedding, rotate-half form, over rows of even length D with cos/sin of length D/2."""

    name, header, macro = "rotary", "ops/rotary.cuh", "GPUOS_DEFINE_ROTARY"
    rows_are_items = True

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        x, cos, sin = inputs
        _check_ndim(x.shape, "rotary input 0", least=1)
        if x.shape[-1] % 2:
            raise TensorSpecError(f"rotary: the last dim of input 0 must be even, got {tuple(x.shape)}")
        half = tuple(x.shape[:-1]) + (x.shape[-1] // 2,)
        for name, t in (("cos", cos), ("sin", sin)):
            if _broadcast([t.shape, half], f"rotary {name}") != half:
                raise TensorSpecError(f"rotary: {name} {tuple(t.shape)} must broadcast to {half}")
        return Layout((x, cos.expand(half), sin.expand(half)), tuple(x.shape), tuple(x.shape),
                      _rows(x.shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        x, c, s = xs
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class AttentionFamily(Family):
    """Single-query attention decode: per row, softmax(scale · K q) · V over that row's own L keys."""

    name, header, macro = "attention_decode", "ops/attention.cuh", "GPUOS_DEFINE_ATTENTION_DECODE"
    rows_are_items = True

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        q, k, v = inputs
        _check_ndim(q.shape, "attention q", least=1)
        _check_ndim(k.shape, "attention K", least=2)
        d = q.shape[-1]
        if k.shape[-1] != d or tuple(v.shape[-2:]) != tuple(k.shape[-2:]):
            raise TensorSpecError(
                f"attention: q [..., D], K and V [..., L, D] must agree, got q {tuple(q.shape)}, "
                f"K {tuple(k.shape)}, V {tuple(v.shape)}")
        if not 1 <= d <= MAX_HEAD_DIM or k.shape[-2] < 1:
            raise TensorSpecError(f"attention: need 1 <= D <= {MAX_HEAD_DIM} and L >= 1, got "
                                  f"D={d}, L={k.shape[-2]}")
        lead = _broadcast([q.shape[:-1], k.shape[:-2], v.shape[:-2]], "attention leading dims")
        kv = lead + tuple(k.shape[-2:])
        _check_ndim(kv, "attention K")
        return Layout((q.expand(lead + (d,)), k.expand(kv), v.expand(kv)), lead + (d,),
                      lead + (d,), math.prod(lead))

    def derived_scalar(self, name: str, inputs: Tensors) -> float | None:
        return 1.0 / math.sqrt(inputs[0].shape[-1]) if name == "scale" else None

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        q, k, v = xs
        scores = torch.einsum("...d,...ld->...l", q, k) * p.scalars[0]
        return torch.einsum("...l,...ld->...d", torch.softmax(scores, dim=-1), v)


@functools.cache
def family(name: str) -> Family:
    """The family object of that name (one instance each)."""
    return {f.name: f for f in _FAMILIES}[name]


_FAMILIES: tuple[Family, ...] = (
    MapFamily(),
    RowFamily("softmax", "GPUOS_DEFINE_SOFTMAX", lambda xs, s: torch.softmax(xs[0], dim=-1)),
    RowFamily("log_softmax", "GPUOS_DEFINE_LOG_SOFTMAX",
              lambda xs, s: torch.log_softmax(xs[0], dim=-1)),
    RowFamily("layernorm", "GPUOS_DEFINE_LAYERNORM", _layernorm),
    RowFamily("rmsnorm", "GPUOS_DEFINE_RMSNORM", _rmsnorm),
    ReduceFamily("sum", "GPUOS_DEFINE_SUM", mean=False),
    ReduceFamily("mean", "GPUOS_DEFINE_MEAN", mean=True),
    RotaryFamily(),
    AttentionFamily(),
)
