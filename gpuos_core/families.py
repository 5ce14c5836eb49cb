"""Operator families: how the tasks of one kind of operator are validated, laid out and computed.

A family knows the shapes its kernels accept, the layout the device code expects (docs/DESIGN.md
"Operators"; cuda/ops/*.cuh state the same contract), how many work items a task has (elements or
rows, which tiles split), and which CUDA macro instantiates a version of it. Every operator of the
catalogue belongs to exactly one family.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .abi import MAX_DIMS, TENSOR_REF, decode_ref, encode_ref
from .calls import LaidOut, Params
from .errors import TensorSpecError
from .expr import Expr, evaluate
from .mathlib import FUNCTIONS
from .sampler import sample_rows

Tensors = Sequence[torch.Tensor]
RowFn = Callable[[Tensors, tuple[float, ...]], torch.Tensor]
MAX_HEAD_DIM = 256  # attention decode keeps one head's output in static shared memory
# Least work a record is cut to (elements of its largest input) when a task is spread over the
# multiprocessors: one round of loads of a 256-thread block (GPUOS_ILP = 4 each). A record's
# time is about its rounds of dependent loads (H200 trace, bench/step_trace.py: 16 rounds of
# 16384 elements took 14 us, one round 2 us), so a task of a few rounds finishes sooner spread.
MIN_RECORD_ELEMENTS = 1024
# sum/mean: reductions at most this long take a thread each, longer ones a block each
# (GPUOS_REDUCE_SERIAL_MAX, cuda/ops/reduce.cuh)
REDUCE_SERIAL_MAX = 64
# scatter_rows: a record per row up to SCATTER_SPREAD rows (keys and values then take at most
# a quarter of the SMs), else at least SCATTER_RECORD_ROWS rows a record (a warp each:
# gpuos_for_rows). A decode step stores every layer's keys and values between its LM head and
# its sampling in claim order: at 32 rows a row a record made 768 GPT-2 store records, and the
# sampling was claimed ~10 us after the head's end (Llama-3.2-1B: 1,024, ~18 us; H200, s315).
SCATTER_SPREAD = 16
SCATTER_RECORD_ROWS = 8
# add_layernorm / add_rmsnorm sharing the machine (OpCall.share): records of ADDNORM_PAIR_ROWS
# rows of at most ADDNORM_PAIR_MAX elements, side by side a pair of warps a row (addnorm.cuh;
# four at once on the worker's 256 threads).
ADDNORM_PAIR_ROWS = 4
ADDNORM_PAIR_MAX = 768


@dataclass(frozen=True)
class Layout:
    """What a family decided for one call: encoded views, output shape and work items."""

    inputs: tuple[torch.Tensor, ...]  # views as encoded (broadcasts expanded)
    out_shape: tuple[int, ...]  # shape of the caller's output (Family.fit_out may set it)
    ref_shape: tuple[int, ...]  # shape of the encoded output (keepdim layout for reductions)
    items: int  # work items of the whole task
    reduce_dims: tuple[int, ...] = ()  # reductions only
    reads: tuple[torch.Tensor, ...] = ()  # tensors read through its workspace, not its inputs


class Family:
    """Base: subclasses define `layout`, `compute` and the CUDA instantiation."""

    name: str = ""
    header: str = ""  # cuda/ header defining the macro
    macro: str = ""  # GPUOS_DEFINE_* macro taking the version's symbol
    rows_are_items = False  # work items: rows of the last dim (True) or output elements (False)
    inputs_written: tuple[int, ...] = ()  # inputs its operators also write (in place), beside out
    # Inputs read as GPUOS_DTYPE_I32 indices (position: name for messages); all others are floats.
    index_inputs: Mapping[int, str] = {}
    # Operators write only the items of the caller's `out` an index names (a scatter): the
    # reference then takes that `out` as a last input and returns its new contents.
    updates_out = False
    out_dtype: torch.dtype | None = None  # the output's fixed dtype; None: a float the caller picks
    internal = False  # the runtime's own machinery (the LLM engine's): not served over HTTP

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        """Validate input shapes and decide the encoded layout; TensorSpecError says what to fix."""
        raise NotImplementedError

    def derived_scalar(self, name: str, inputs: Tensors) -> float | None:
        """Value of a parameter the caller left out and that has no default, if the family has
        one."""
        return None

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        """Torch implementation over `xs` as laid out (fp32 or wider; index inputs integral or
        float); returns the encoded output's shape. `expr` is the version's expression (map
        operators only)."""
        raise NotImplementedError

    def fit_out(self, lay: Layout, out: torch.Tensor | None) -> Layout:
        """`lay` once the caller's `out` (None: one is allocated) is known. The default keeps it:
        the catalogue checks `out` against lay.out_shape. Families that update `out` take its
        shape here."""
        return lay

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        """What the CPU backend runs for one record: work items [begin, end) computed from the
        decoded views `xs` (in their own dtypes) and stored through `out`. Families whose
        operators write elsewhere too (an input updated in place, a scatter) override it."""
        value = self.compute([x.float() if x.is_floating_point() else x for x in xs], p, expr)
        write_items(out, value, begin, end, self.rows_are_items)

    def ranges(self, task: LaidOut, tile_elements: int | None) -> list[tuple[int, int]]:
        """The work items [begin, end) of each of the task's records, in order: one record when
        `tile_elements` is None, else as `cut` says."""
        return self.cut(task, tile_elements) if tile_elements else [(0, task.items)]

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """Records of at most `tile_elements` elements of work each (counted in its largest
        input), fewer when that leaves multiprocessors idle (down to MIN_RECORD_ELEMENTS).
        Families whose kernels need a plan of their own override it."""
        total = max(x.numel() for x in task.inputs)
        spread = -(-total // sm_count(task.inputs[0].device))
        tile = min(tile_elements, max(MIN_RECORD_ELEMENTS, spread))
        per = max(1, total // max(task.items, 1))
        # A tile that spreads the task over the SMs takes whole items rounded up: one wave of
        # records (512 rows on 132 SMs: 128 records of 4, where 171 records of 3 took two).
        step = max(1, -(-tile // per) if tile == spread else tile // per)
        return _stepped(task.items, step)


def _stepped(items: int, step: int) -> list[tuple[int, int]]:
    """Records of `step` items each (the last takes the rest); one for no items."""
    bounds = list(range(0, items, step)) or [0]
    return list(zip(bounds, bounds[1:] + [items]))


def _even(items: int, records: int) -> list[tuple[int, int]]:
    """`records` records (at least one, at most one an item) of neighbouring items, their sizes
    differing by one at most."""
    records = max(1, min(items, records))
    bounds = [r * items // records for r in range(records + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _side_by_side(task: LaidOut) -> list[tuple[int, int]]:
    """A record an item up to the multiprocessors, else the items spread evenly over the fewest
    records that the busiest one's count of items allows: for items that a block takes each, a
    record's time their latency more than their bytes (cut by elements, a step's 8 rows of 256
    logits were 2 records that took 4 rows one after the other: 15-16 us, where a record of one
    row took 6-8). The blocks left free claim the next stage's records while these run
    (Llama-3.2-1B's up projection, 256 items: 132 records of one or two left one to the block
    of the norm before it, claimed after that norm; as 128 of two its stage took 2.5 us less
    at one row, s204)."""
    rounds = _ceil_div(task.items, sm_count(task.inputs[0].device))
    return _even(task.items, _ceil_div(task.items, max(rounds, 1)))


def write_items(
    out: torch.Tensor, value: torch.Tensor, begin: int, end: int, row_items: bool
) -> None:
    """Store `value` (shaped like `out`) into `out` for work items [begin, end): output elements
    in row-major order, or whole rows of the last dim when `row_items`."""
    width = out.shape[-1] if row_items and out.dim() else 1
    if begin == 0 and end * width == out.numel():
        out.copy_(value)
        return
    index = torch.arange(begin * width, end * width)
    offsets = torch.zeros_like(index)
    for size, stride in zip(reversed(out.shape), reversed(out.stride())):
        offsets += (index % size) * stride
        index //= size
    flat = out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,), 0)
    rows = value.reshape(-1)[begin * width : end * width]
    flat[offsets + out.storage_offset()] = rows.to(out.dtype)


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


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether `shape` broadcasts to exactly `target` (numpy rules)."""
    return len(shape) <= len(target) and all(
        n in (1, t) for n, t in zip(reversed(tuple(shape)), reversed(tuple(target)))
    )


def _check_ndim(shape: Sequence[int], what: str, least: int = 0) -> None:
    if not least <= len(shape) <= MAX_DIMS:
        raise TensorSpecError(
            f"{what} must have {least} to {MAX_DIMS} dims, got shape {tuple(shape)}"
        )


def _rows(shape: Sequence[int]) -> int:
    return math.prod(shape[:-1]) if shape else 1


def _index(t: torch.Tensor, rows: tuple[int, ...], what: str) -> torch.Tensor:
    """Index input `t` expanded to the leading dims `rows` it gives one value for (stride 0 where
    broadcast), as encoded."""
    if _broadcast([t.shape, rows], what) != rows:
        raise TensorSpecError(f"{what} {tuple(t.shape)} must broadcast to the leading dims {rows}")
    return t.expand(rows)


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
        self._check_params(x, inputs, first=1)
        return Layout(tuple(inputs), tuple(x.shape), tuple(x.shape), _rows(x.shape))

    def _check_params(self, x: torch.Tensor, inputs: Tensors, first: int) -> None:
        """inputs[first:] are 1-D parameters over the last dim of x (weight, bias)."""
        for i, w in enumerate(inputs[first:], start=first):
            if tuple(w.shape) != (x.shape[-1],):
                raise TensorSpecError(
                    f"{self.name} input {i} must have shape ({x.shape[-1]},) to match the last dim "
                    f"of input 0 {tuple(x.shape)}, got {tuple(w.shape)}"
                )

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        return self._fn(xs, p.scalars)


def _residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y, or the sum of its partial sums y[0] + y[1] + ... in that order when it has a dim more
    than x (as addnorm.cuh adds them)."""
    if y.dim() == x.dim():
        return y
    total = y[0].clone()
    for part in y[1:]:
        total += part
    return total


def _layernorm(xs: Tensors, s: tuple[float, ...]) -> torch.Tensor:
    n = xs[0].shape[-1]
    w, b = (list(xs[1:]) + [None, None])[:2]
    return torch.nn.functional.layer_norm(xs[0], (n,), w, b, eps=s[0])


def _rmsnorm(xs: Tensors, s: tuple[float, ...]) -> torch.Tensor:
    x = xs[0]
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + s[0])
    return y * xs[1] if len(xs) > 1 else y


class AddNormFamily(RowFamily):
    """Fused residual add + norm (vLLM's fused_add_rms_norm), inputs (x, y, weight?, bias?): per
    row, x = (x + y) rounded to x's dtype, in place, and out = norm(x) with the row's 1-D
    parameters. y may also be [S, *x.shape], the S partial sums of a linear_parts, standing for
    their sum in split order (fp32). The reference (`compute`) returns out only, rounding the sum
    to x's dtype as it is given (none when the inputs are widened, as the tests' float64
    references are)."""

    header = "ops/addnorm.cuh"
    inputs_written = (0,)

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        x, y = inputs[:2]
        _check_ndim(x.shape, f"{self.name} input 0 (x)", least=1)
        parts = y.dim() == x.dim() + 1 and y.shape[1:] == x.shape
        if y.shape != x.shape and not (parts and 1 <= y.shape[0] <= LINEAR_MAX_PARTS):
            raise TensorSpecError(
                f"{self.name}: input 1 (the residual y) must have the shape of "
                f"input 0 (x) {tuple(x.shape)}, or be [S, *that] with 1 <= S <= "
                f"{LINEAR_MAX_PARTS} partial sums, got {tuple(y.shape)}"
            )
        if any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride())):
            raise TensorSpecError(
                f"{self.name}: input 0 (x) is updated in place, so it must not "
                f"be an expanded view (a dim of stride 0), got strides "
                f"{x.stride()}"
            )
        self._check_params(x, inputs, first=2)
        return Layout(tuple(inputs), tuple(x.shape), tuple(x.shape), _rows(x.shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        x = xs[0]
        return self._fn([(x + _residual(x, xs[1])).to(x.dtype), *xs[2:]], p.scalars)

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """As rows are cut by elements; but a task that shares the machine takes rows that
        pairs of warps hold at least ADDNORM_PAIR_ROWS a record. A record a row spreads the
        row's bytes over the most SMs (4 rows a record made GPT-2's 8- to 32-row steps 3-11%
        longer), but each record claimed holds a block while it waits for its producer: the
        norm of a 32-row lane of a 64-row step was 32 records, and the next stages' records,
        claimed behind both lanes' stages, started late (4 a record: the step 1.5% shorter,
        its up projections 20-40 µs; H200, bench/NOTES.md s327)."""
        records = super().cut(task, tile_elements)
        paired = task.share is not None and task.inputs[0].shape[-1] <= ADDNORM_PAIR_MAX
        if not paired or records[0][1] - records[0][0] >= ADDNORM_PAIR_ROWS:
            return records
        return _stepped(task.items, ADDNORM_PAIR_ROWS)

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        x, y, params = xs[0], xs[1], xs[2:]
        summed = (x.float() + _residual(x, y.float())).to(x.dtype)  # torch's (x + y).to(x.dtype)
        write_items(x, summed, begin, end, True)
        value = self._fn([summed.float(), *(w.float() for w in params)], p.scalars)
        write_items(out, value, begin, end, True)


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

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """Outputs of more than REDUCE_SERIAL_MAX elements each go a block each (the step's
        finiteness sums of the logits' rows): side by side. Shorter ones a thread each, cut by
        elements."""
        if task.inputs[0].numel() > REDUCE_SERIAL_MAX * task.items:
            return _side_by_side(task)
        return super().cut(task, tile_elements)


# rotary_parts' smallest record of whole passes: rotary.cuh packs rows side by side from
# GPUOS_ROTARY_PACKED (4) rows a warp of the block's 8 on, a pass of 32 rows of 64 (8 lanes a row).
ROTARY_PASS_ROWS = 32


class RotaryFamily(Family):
    """Rotary embedding, rotate-half form, over rows of even length D with cos/sin of length D/2:
    broadcast to the rows, or tables [P, D/2] whose row positions[r] (int32, clamped into
    [0, P - 1]) row r uses.

    `parts` (rotary_parts): input 0 is [S, *out.shape], the S partial sums of a linear_parts
    viewed as rows of heads [..., H, D], and out holds their sum in split order (fp32), rotated
    where the row's index along dim -2 of out is below the scalar `rotated` (every row when it
    is left out) and only summed from there on: an attention's fused q, k, v projection, its q
    and k heads rotated and its v heads passed on, in one stage, with no combine of the
    projection's splits."""

    header, rows_are_items = "ops/rotary.cuh", True
    index_inputs = {3: "positions"}

    def __init__(self, parts: bool = False) -> None:
        self.parts = parts
        self.name = "rotary_parts" if parts else "rotary"
        self.macro = "GPUOS_DEFINE_" + self.name.upper()

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        x, cos, sin = inputs[:3]
        _check_ndim(x.shape, f"{self.name} input 0", least=2 if self.parts else 1)
        if self.parts and not 1 <= x.shape[0] <= LINEAR_MAX_PARTS:
            raise TensorSpecError(
                f"rotary_parts: input 0 must be [S, ..., D], the S partial sums of a "
                f"linear_parts with 1 <= S <= {LINEAR_MAX_PARTS}, got {tuple(x.shape)}"
            )
        shape = tuple(x.shape[1:]) if self.parts else tuple(x.shape)
        if shape[-1] % 2:
            raise TensorSpecError(
                f"{self.name}: the last dim of input 0 must be even, got {tuple(x.shape)}"
            )
        lead, h = shape[:-1], shape[-1] // 2
        views: tuple[torch.Tensor, ...]
        if len(inputs) > 3:
            if cos.dim() != 2 or cos.shape[0] < 1 or cos.shape[1] != h or sin.shape != cos.shape:
                raise TensorSpecError(
                    f"{self.name} with positions: cos and sin must be tables [P, {h}] with "
                    f"P >= 1, got {tuple(cos.shape)} and {tuple(sin.shape)}"
                )
            views = (x, cos, sin, _index(inputs[3], lead, f"{self.name} positions"))
        else:
            half = lead + (h,)
            for name, t in (("cos", cos), ("sin", sin)):
                if _broadcast([t.shape, half], f"{self.name} {name}") != half:
                    raise TensorSpecError(
                        f"{self.name}: {name} {tuple(t.shape)} must broadcast to {half}"
                    )
            views = (x, cos.expand(half), sin.expand(half))
        return Layout(views, shape, shape, _rows(shape))

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """rotary_parts: records of ROTARY_PASS_ROWS rows or more where the task has rows for
        two, on at most half the multiprocessors, so that the other blocks claim the
        attention's records while these run. Cut by elements, 8 rows of Llama-3.2-1B's heads
        were 48 records of 8 rows beside the projection's 96, and the attention's were claimed
        only as those ended (~5 us a layer later); 64 rows took 128 records, one an SM."""
        records = super().cut(task, tile_elements)
        if not self.parts:
            return records
        half = max(1, sm_count(task.inputs[0].device) // 2)
        if task.items >= 2 * ROTARY_PASS_ROWS:
            passes = task.items // ROTARY_PASS_ROWS
            return _even(task.items, min(len(records), passes, half))
        return _even(task.items, half) if len(records) > half else records

    def derived_scalar(self, name: str, inputs: Tensors) -> float | None:
        """`rotated` left out: every row (more than any index along dim -2)."""
        return float(inputs[0].shape[-2]) if name == "rotated" else None

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        x, c, s = xs[:3]
        if self.parts:
            x = _residual(x[0], x)
        if len(xs) > 3:  # each row's table row, clamped as the kernel does
            at = xs[3].long().clamp(0, c.shape[0] - 1)
            c, s = c[at], s[at]
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        if self.parts and x.dim() > 1 and p.scalars[0] < x.shape[-2]:
            kept = max(0, math.ceil(p.scalars[0]))  # rows from this index on are only summed
            out[..., kept:, :] = x[..., kept:, :]
        return out


class AttentionFamily(Family):
    """Single-query attention decode: per row, softmax(scale · K q) · V over that row's own L keys,
    or over its first n = min(lengths[r], L) keys (int32; zeros when <= 0) when lengths is given.
    With new_k and new_v ([..., D] over q's leading dims, after the lengths), each row's key and
    value at n - 1 (its newest) are read from those instead of K and V, which need not hold them
    yet: a decode step stores them after the attention, off its path. The layout adds the lengths
    (L when none) as input 3, [..., 1], carrying the workspace of an AttentionPlan
    (cuda/ops/attention.cuh states the encoding), which also carries new_k's and new_v's refs;
    items are the plan's (group, split) pairs. Before its wait, a record warms its first keys
    and values while q is produced."""

    name, header, macro = "attention_decode", "ops/attention.cuh", "GPUOS_DEFINE_ATTENTION_DECODE"
    index_inputs = {3: "lengths"}

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        q, k, v = inputs[:3]
        _check_ndim(q.shape, "attention q", least=1)
        _check_ndim(k.shape, "attention K", least=2)
        d = q.shape[-1]
        if k.shape[-1] != d or tuple(v.shape[-2:]) != tuple(k.shape[-2:]):
            raise TensorSpecError(
                f"attention: q [..., D], K and V [..., L, D] must agree, got q {tuple(q.shape)}, "
                f"K {tuple(k.shape)}, V {tuple(v.shape)}"
            )
        if not 1 <= d <= MAX_HEAD_DIM or k.shape[-2] < 1:
            raise TensorSpecError(
                f"attention: need 1 <= D <= {MAX_HEAD_DIM} and L >= 1, got D={d}, L={k.shape[-2]}"
            )
        lead = _broadcast([q.shape[:-1], k.shape[:-2], v.shape[:-2]], "attention leading dims")
        kv = lead + tuple(k.shape[-2:])
        _check_ndim(kv, "attention K")
        if len(inputs) > 3:
            lengths = _index(inputs[3], lead, "attention lengths")
        else:  # every row attends over all L keys
            lengths = torch.full((), k.shape[-2], dtype=torch.int32, device=q.device).expand(lead)
        views = (q.expand(lead + (d,)), k.expand(kv), v.expand(kv))
        newest = _newest(inputs[4:], views[1:], lead)
        plan = AttentionPlan.of(*views, lengths, newest=bool(newest))
        control = _carrying(lengths, plan.workspace(q.device, newest))
        return Layout(views + (control,), lead + (d,), lead + (d,), plan.items, reads=newest)

    def derived_scalar(self, name: str, inputs: Tensors) -> float | None:
        return 1.0 / math.sqrt(inputs[0].shape[-1]) if name == "scale" else None

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        """Over the caller's inputs or the encoded ones (lengths [..., 1] then, and the newest
        keys and values after them where the workspace carries some)."""
        q, k, v = xs[:3]
        if len(xs) == 3:
            scores = torch.einsum("...d,...ld->...l", q, k) * p.scalars[0]
            return torch.einsum("...l,...ld->...d", torch.softmax(scores, dim=-1), v)
        n = xs[3].reshape(xs[3].shape[: q.dim() - 1])  # drops the encoded trailing dim
        if len(xs) > 4:  # key n - 1 (the last one read) from new_k, its value from new_v
            last = n.clamp(max=k.shape[-2])[..., None] - 1
            at = (torch.arange(k.shape[-2], device=k.device) == last)[..., None]
            k, v = (torch.where(at, new[..., None, :], m) for m, new in zip((k, v), xs[4:]))
        scores = torch.einsum("...d,...ld->...l", q, k) * p.scalars[0]
        # Keys at or past a row's length are never read (the cache may hold anything there).
        keep = torch.arange(k.shape[-2], device=k.device) < n[..., None]
        probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
        probs = torch.where(keep.any(dim=-1, keepdim=True), probs, 0.0)  # no key: zeros, not NaN
        return torch.einsum("...l,...ld->...d", probs, v.masked_fill(~keep[..., None], 0.0))

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        """The rows of the groups whose split 0 is among items [begin, end): each row once,
        whichever records the items form (the device combines the splits instead)."""
        newest = _carried_newest(xs[3])
        q, k, v, control = xs[:4]
        rows = AttentionPlan.of(q, k, v, control, newest=bool(newest)).owned_rows(begin, end)
        if rows.numel() == 0:
            return
        xs = (*xs, *newest)
        at = torch.unravel_index(rows, out.shape[:-1])
        picked = [x[at].float() if x.is_floating_point() else x[at] for x in xs]
        out[at] = self.compute(picked, p, expr).to(out.dtype)

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """Records of neighbouring items, ATTENTION_RECORDS_PER_SM per multiprocessor at most (so
        that blocks claiming them even out ragged rows); in warp mode an item per warp where the
        SMs allow, never a record with fewer items than warps: the SMs it leaves free claim the
        next stage's records while it runs (a GPT-2 step's 64 rows were 132 records of ~6 items,
        and the output projection after them waited ~5 us a layer to be claimed); past that,
        records of about ATTENTION_WARPS groups each. Multiprocessors as the plan is cut for,
        given the call's share (AttentionPlan.sms, OpCall.share). A task the call says shares
        the machine takes a record per SM of its share at most: a record costs its block ~7 us
        of claim, fetch and warm-up before its items, which the 32 chunks of a 512-row prefill
        step paid ~6 times a block a layer as 768 records of 8 items (GPT-2: 70 us a layer where
        the items took ~4 us a wave, s245)."""
        q, k, v, control = task.inputs
        plan = AttentionPlan.of(q, k, v, control, newest=bool(task.reads))
        sms = plan.sms(q.device, task.share)
        alone = task.share is None or task.share == 1
        if plan.warps:
            per_warp = min(_ceil_div(plan.items, ATTENTION_WARPS), sms)
            records = max(_ceil_div(plan.groups, ATTENTION_WARPS), per_warp) if alone else per_warp
        else:
            records = ATTENTION_RECORDS_PER_SM * sms if alone else sms
        return _even(task.items, records)


class ScatterRowsFamily(Family):
    """out row index[r] = src row r (int32 index; out of range: skipped), in place in the caller's
    `out` (a KV cache), rows numbered row-major over all dims but the last; items are src rows."""

    name, header, macro = "scatter_rows", "ops/scatter.cuh", "GPUOS_DEFINE_SCATTER_ROWS"
    rows_are_items = True
    index_inputs = {1: "index"}
    updates_out = True

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        src, index = inputs
        _check_ndim(src.shape, "scatter_rows src", least=1)
        if src.shape[-1] < 1:
            raise TensorSpecError(
                f"scatter_rows: src rows must not be empty, got {tuple(src.shape)}"
            )
        views = (src, _index(index, tuple(src.shape[:-1]), "scatter_rows index"))
        return Layout(views, (), (), _rows(src.shape))  # out's shape: fit_out

    def fit_out(self, lay: Layout, out: torch.Tensor | None) -> Layout:
        if out is None:
            raise TensorSpecError(
                "scatter_rows writes into the tensor given as out= (the cache it "
                "updates in place): pass one"
            )
        _check_ndim(out.shape, "scatter_rows out", least=1)
        d = lay.inputs[0].shape[-1]
        if out.shape[-1] != d:
            raise TensorSpecError(
                f"scatter_rows: out's last dim must be src's ({d}), got out {tuple(out.shape)}"
            )
        return replace(lay, out_shape=tuple(out.shape), ref_shape=tuple(out.shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        src, index, out = xs
        new = out.clone()
        _scatter_rows(new, src.reshape(-1, src.shape[-1]), index.reshape(-1))
        return new

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        src, index = xs
        _scatter_rows(out, src.reshape(-1, src.shape[-1])[begin:end], index.reshape(-1)[begin:end])

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """A record per row up to SCATTER_SPREAD rows, else records of SCATTER_RECORD_ROWS rows
        (a warp a row) or more, as `tile_elements` allows, in one wave. A step's KV append is a
        few KB and a record's time its latency: cut a row a record at 64 decode rows (for keys
        and for values) it held 128 SMs, and attention's records, claimed behind it, started
        5-7 us after it instead of 1; records of 8 rows take ~6 us against ~2 for one row, so
        fewer rows keep a record each."""
        step = 1
        if task.items > SCATTER_SPREAD:
            fits = max(1, tile_elements // max(1, task.inputs[0].shape[-1]))
            spread = -(-task.items // sm_count(task.inputs[0].device))
            step = min(max(SCATTER_RECORD_ROWS, spread), fits)
        return _stepped(task.items, step)


def _scatter_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """out row index[i] = src[i] for each row i of src [N, D] whose index lies in out's rows."""
    rows = out if out.dim() > 1 else out.unsqueeze(0)  # a view: writes reach `out`
    n = index.long()
    keep = (n >= 0) & (n < math.prod(rows.shape[:-1]))
    rows[torch.unravel_index(n[keep], rows.shape[:-1])] = src[keep].to(out.dtype)


class GatherRowsFamily(Family):
    """out row r = table row index[r] (int32; out of range: zeros), rows numbered row-major over
    all dims but the last (an embedding lookup); out is index's dims then the table's last.
    Items are out rows."""

    name, header, macro = "gather_rows", "ops/scatter.cuh", "GPUOS_DEFINE_GATHER_ROWS"
    rows_are_items = True
    index_inputs = {1: "index"}

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        table, index = inputs
        _check_ndim(table.shape, "gather_rows table", least=1)
        out = (*index.shape, table.shape[-1])
        _check_ndim(out, "gather_rows out (index dims, then the table's row)")
        if table.shape[-1] < 1:
            raise TensorSpecError(
                f"gather_rows: table rows must not be empty, got {tuple(table.shape)}"
            )
        return Layout((table, index), out, out, math.prod(index.shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        table, index = xs
        rows, n = table.reshape(-1, table.shape[-1]), index.long()
        keep = (n >= 0) & (n < rows.shape[0])
        return torch.where(keep[..., None], rows[n.clamp(0, rows.shape[0] - 1)], 0.0)


class SampleFamily(Family):
    """Next-token choice on the device: one int32 token id per row of logits [..., V] from the
    row's params (float32 [..., 3]: temperature, top_p, top_k) and rng (int32 [..., 3]: seed low
    and high words, step), tensors because they change every step. The rule is stated in
    cuda/ops/sample.cuh and run in torch by sampler.sample_rows. Items are rows (output
    elements)."""

    name, header, macro = "sample_tokens", "ops/sample.cuh", "GPUOS_DEFINE_SAMPLE_TOKENS"
    index_inputs = {2: "rng"}
    out_dtype = torch.int32

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        logits, params, rng = inputs
        _check_ndim(logits.shape, "sample_tokens logits", least=1)
        if logits.shape[-1] < 1:
            raise TensorSpecError(
                f"sample_tokens: logits rows must not be empty, got {tuple(logits.shape)}"
            )
        if params.dtype != torch.float32:
            raise TensorSpecError(
                f"sample_tokens input 1 (params: temperature, top_p, top_k) must "
                f"be float32 so that top_k is exact, got {params.dtype}"
            )
        lead = tuple(logits.shape[:-1])
        per_row = lead + (3,)
        for what, t in (
            ("params (temperature, top_p, top_k)", params),
            ("rng (seed low word, seed high word, step)", rng),
        ):
            if not _broadcasts_to(t.shape, per_row):
                raise TensorSpecError(
                    f"sample_tokens: {what} {tuple(t.shape)} must broadcast to "
                    f"{per_row}, three values per row of logits"
                )
        views = (logits, params.expand(per_row), rng.expand(per_row))
        return Layout(views, lead, lead, _rows(logits.shape))

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        rows = [x.reshape(-1, x.shape[-1]) for x in xs]
        return sample_rows(*rows).reshape(xs[0].shape[:-1])

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        value = torch.zeros(out.numel(), dtype=torch.int32)
        value[begin:end] = sample_rows(*(x.reshape(-1, x.shape[-1])[begin:end] for x in xs))
        write_items(out, value.reshape(out.shape), begin, end, False)

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """Rows side by side (a block a row)."""
        return _side_by_side(task)


class FeedTokensFamily(Family):
    """The tokens a decode step embeds (cuda/ops/steps.cuh): tokens [N] int32, each a token id,
    -1 (idle row) or -(2 + p), the token the previous step sampled for its logits row p, which
    `sampled` [P] holds; taken once `clock` [1] has reached `expect` [1] (the previous step's
    tick). One record; items are rows."""

    name, header, macro = "feed_tokens", "ops/steps.cuh", "GPUOS_DEFINE_FEED_TOKENS"
    index_inputs = {0: "tokens", 1: "sampled", 2: "clock", 3: "expect"}
    out_dtype = torch.int32
    internal = True

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        tokens, sampled, clock, expect = inputs
        for what, t, n in (("clock", clock, 1), ("expect", expect, 1)):
            if tuple(t.shape) != (n,):
                raise TensorSpecError(f"feed_tokens: {what} must have shape (1,), got {t.shape}")
        for what, t in (("tokens", tokens), ("sampled", sampled)):
            if t.dim() != 1 or not t.is_contiguous():
                raise TensorSpecError(
                    f"feed_tokens: {what} must be a contiguous 1-D tensor, got {tuple(t.shape)}"
                )
        return Layout(tuple(inputs), tuple(tokens.shape), tuple(tokens.shape), tokens.numel())

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        tokens, sampled = xs[0].long(), xs[1].long()
        pick = -2 - tokens
        fed = (tokens <= -2) & (pick < sampled.numel())
        taken = sampled[pick.clamp(0, max(sampled.numel() - 1, 0))] if sampled.numel() else pick
        return torch.where(tokens >= -1, tokens, torch.where(fed, taken, -1)).int()

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        clock, expect = int(xs[2][0]), int(xs[3][0])
        if (clock - expect + 2**31) % 2**32 - 2**31 < 0:  # int32 serial arithmetic
            # batches run in order here: a step that has not ticked never will
            raise RuntimeError(
                f"feed_tokens: the clock is at {clock}, the previous step should have taken it "
                f"to {expect}: it failed"
            )
        write_items(out, self.compute(xs, p, expr), begin, end, False)

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        return [(0, task.items)]  # one wait for the clock


class TickFamily(Family):
    """clock [1] int32 += 1 in place, after the task that writes its input (cuda/ops/steps.cuh):
    the end of a decode step, which the next step's feed_tokens waits for. One record."""

    name, header, macro = "tick", "ops/steps.cuh", "GPUOS_DEFINE_TICK"
    index_inputs = {0: "after"}
    updates_out = True
    out_dtype = torch.int32
    internal = True

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        return Layout(tuple(inputs), (1,), (1,), 1)

    def fit_out(self, lay: Layout, out: torch.Tensor | None) -> Layout:
        if out is None:
            raise TensorSpecError("tick advances the clock given as out= (int32, shape (1,))")
        return lay

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        return xs[-1] + 1

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        out += 1


# The tiling of cuda/ops/linear.cuh (its GPUOS_LINEAR_* constants; tests/unit/test_linear.py
# checks that they agree).
LINEAR_ROWS = 64  # rows of x per m-block (BM)
LINEAR_COLS = 64  # outputs per n-tile (BN)
LINEAR_WIDE = 128  # rows and outputs of a wide plan's tile (prefill rows, warpgroup products)
LINEAR_KSTEP = 32  # k per step
LINEAR_STEP_ALIGN = 8  # a split's steps come in multiples of this
LINEAR_PART_ROWS = 16  # rows of a partial block are rounded up to this
LINEAR_MAX_SPLITS = 64
# linear_parts hands its consumer at most this many partial sums (parts.cuh's GPUOS_MAX_PARTS:
# the loads of an element's parts are issued together).
LINEAR_MAX_PARTS = 6
LINEAR_ITEM_COST = 4  # what starting an item costs, in steps of one tile (plan's cost model)
# What a wide tile's step costs in the same steps: it reads twice the bytes (128 rows of W and of
# x, where a 64 x 64 tile reads 64 of each) for four times the products, and the prefill's
# matmuls are bounded by what L2 delivers to the SMs.
LINEAR_WIDE_STEP_COST = 2
# What splitting K costs on top of the partials' bytes, in the same steps: the count-in and the
# last split's round trips to L2 for the partials (traced on the H200: ~3.5 us at 1 row, ~7 us
# at 64 rows, against ~0.1-0.4 us a step).
LINEAR_SPLIT_COST = 16
# What a record claimed only as its producer's blocks finish costs its stage, in the same steps:
# its claim, plan and weight prologue after the others' (traced on the H200: ~3-5 us at 1-8
# rows; Llama-3.2-1B's output projection at one row, 128 records after 8 of attention: 7.2 us
# where 96 took 4.9; its down projection at 8 rows, 128 records after 64 of swiglu: 13.6 us
# where 64 took 16.6; s204-s207).
LINEAR_LATE_COST = 16
GATED = "silu_glu"  # the activation of linear_silu_glu: out pairs of W's rows, silu(gate) * up
DEFAULT_SMS = 132  # multiprocessors assumed off a GPU (an H100 or H200), so plans agree


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def wide_tiles(device: torch.device) -> bool:
    """Whether the worker on `device` runs wide tiles on tensor cores: warpgroup products, the
    sm_90a image that jit.device_arch builds for compute capability 9.0; off a GPU too, as on
    the H100 or H200 that DEFAULT_SMS assumes, so that plans agree. (A wide plan is correct
    anywhere: without warpgroup products it runs on CUDA cores.)"""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) == (9, 0)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device: the worker runs a block on each."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gate_up(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, ...]:
    """The gate and up halves (views) of `dim` of linear_silu_glu's pairs: its outputs before
    the gating (the last dim), its weight rows (0) or bias, a gate's then its up's in turn."""
    return t.unflatten(dim, (-1, 2)).unbind(dim + 1 if dim >= 0 else dim)


@dataclass(frozen=True)
class LinearPlan:
    """How a linear task's work is cut, as cuda/ops/linear.cuh states it: m-blocks of rows of x,
    n-tiles of outputs and `splits` ranges of K, one work item per (m-block, split, n-tile). The
    tiles are 64 x 64, or 128 x 128 in a wide plan (prefill rows: half the bytes from L2 per
    product)."""

    m: int  # rows of x
    n: int  # outputs
    k: int  # inner dim
    splits: int  # K splits (1: no workspace)
    parts: bool = False  # linear_parts: the splits' sums are the output, never combined
    wide: bool = False  # tiles of LINEAR_WIDE x LINEAR_WIDE

    @property
    def block_rows(self) -> int:
        """Rows of x of an m-block."""
        return LINEAR_WIDE if self.wide else LINEAR_ROWS

    @property
    def tile_cols(self) -> int:
        """Outputs of an n-tile."""
        return LINEAR_WIDE if self.wide else LINEAR_COLS

    @property
    def mblocks(self) -> int:
        return _ceil_div(self.m, self.block_rows)

    @property
    def ntiles(self) -> int:
        return _ceil_div(self.n, self.tile_cols)

    @property
    def tiles(self) -> int:
        return self.mblocks * self.ntiles

    @property
    def items(self) -> int:
        return self.tiles * self.splits

    @property
    def kch(self) -> int:
        """Steps of a split: the device derives it from `splits` the same way."""
        steps = _ceil_div(_ceil_div(self.k, LINEAR_KSTEP), self.splits)
        return _ceil_div(steps, LINEAR_STEP_ALIGN) * LINEAR_STEP_ALIGN

    @property
    def prows(self) -> int:
        """Rows of a partial block."""
        return _ceil_div(min(self.m, self.block_rows), LINEAR_PART_ROWS) * LINEAR_PART_ROWS

    @property
    def counters(self) -> int:
        """Workspace words of the tiles' arrival counters (partials start 16-byte aligned)."""
        return _ceil_div(self.tiles, 4) * 4

    @property
    def workspace_words(self) -> int:
        if self.splits == 1 or self.parts:
            return 0
        return self.counters + self.splits * self.tiles * self.prows * self.tile_cols

    def workspace(self, device: torch.device) -> torch.Tensor:
        """Input 3 as the device reads the plan from it: an empty [splits, 0] in parts mode,
        else the split-K workspace with its counters zeroed (partials are written before they
        are read); a wide plan's has a trailing dim of 1 more."""
        if self.parts:
            words = torch.empty((self.splits, 0), dtype=torch.int32, device=device)
        else:
            words = torch.empty(self.workspace_words, dtype=torch.int32, device=device)
            words[: self.counters].zero_()
        return words[..., None] if self.wide else words

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """The k range [k0, k1) of each split."""
        width = self.kch * LINEAR_KSTEP
        return [(s * width, min(self.k, (s + 1) * width)) for s in range(self.splits)]

    @staticmethod
    def dims(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
        """(M, N, K) of x [..., K] times w [N, K] transposed."""
        return _rows(x.shape), w.shape[0], x.shape[-1]

    @classmethod
    def splittings(
        cls, m: int, n: int, k: int, parts: bool, wide: bool = False
    ) -> list[LinearPlan]:
        """The plans of every split count whose splits all get steps of K (one split always
        does), up to LINEAR_MAX_PARTS in parts mode (its consumer sums them), else
        LINEAR_MAX_SPLITS; of wide tiles when `wide`."""
        most = LINEAR_MAX_PARTS if parts else LINEAR_MAX_SPLITS
        return [p for s in range(1, most + 1) if (p := cls(m, n, k, s, parts, wide)).whole]

    @classmethod
    # A pure function of its arguments, asked for again by every layer of a step program
    # (12% of a GPT-2 program's build); bounded, as /v1/ops callers bring any shape.
    @functools.lru_cache(maxsize=4096)
    def choose(
        cls,
        m: int,
        n: int,
        k: int,
        sms: int,
        parts: bool = False,
        free: int | None = None,
        wide: bool = False,
    ) -> LinearPlan:
        """The tiles and split of K that should finish soonest on `sms` multiprocessors (a block
        each): enough items to occupy them, against the cost of writing and summing partials.
        `parts`: for linear_parts. `free`: the blocks free to claim its records while its
        producer runs (all of them when None); a plan of more records pays LINEAR_LATE_COST for
        those claimed as the producer's blocks finish. `wide`: the device runs wide tiles
        (wide_tiles), considered past a 64-row m-block and for an even N (the condition of
        their tensor-core path)."""

        def cost(p: LinearPlan) -> tuple[float, int]:
            late = free is not None and free < p.items <= sms
            return p._cost(sms) + (LINEAR_LATE_COST if late else 0.0), p.splits

        plans = cls.splittings(m, n, k, parts)
        if wide and m > LINEAR_ROWS and n % 2 == 0:
            plans += cls.splittings(m, n, k, parts, wide=True)
        return min(plans, key=cost)

    @property
    def whole(self) -> bool:
        """Whether every split has steps of K (one split always does)."""
        steps = _ceil_div(self.k, LINEAR_KSTEP)
        return (
            self.splits == 1 or self.splits <= steps and _ceil_div(steps, self.kch) == self.splits
        )

    def _cost(self, sms: int) -> float:
        """Time in steps of one tile (4 KB of weights): the busiest block's items (each also
        writes its partial block when K is split), then the count-in and the last split's sum
        of the partials; in parts mode, the consumer's extra loads of the parts instead (in its
        one round trip for the row, spread over its records)."""
        if self.items == 0:
            return 0.0
        # 4 KB per 16 rows of 64 fp32 outputs
        partial = self.prows / 16 * self.tile_cols / LINEAR_COLS if self.splits > 1 else 0.0
        if self.parts:
            combine = self.splits * partial / 8
        else:
            combine = LINEAR_SPLIT_COST + self.splits * partial / 2 if self.splits > 1 else 0.0
        steps = self.kch * (LINEAR_WIDE_STEP_COST if self.wide else 1)
        return _ceil_div(self.items, sms) * (steps + LINEAR_ITEM_COST + partial) + combine

    @classmethod
    def of(cls, x: torch.Tensor, w: torch.Tensor, workspace: torch.Tensor) -> LinearPlan:
        """The plan of encoded inputs, `splits` read from the workspace as the device reads it:
        from its length, or in parts mode (an empty [S, 0] workspace) from its first dim; wide
        when it has a trailing dim more."""
        parts = workspace.dim() > 1 and workspace.shape[1] == 0
        plan = cls(*cls.dims(x, w), 1, parts, wide=workspace.dim() == (3 if parts else 2))
        if parts:
            return replace(plan, splits=workspace.shape[0])
        if workspace.numel() == 0:
            return plan
        block = plan.tiles * plan.prows * plan.tile_cols
        return replace(plan, splits=(workspace.numel() - plan.counters) // block)

    def owned_items(self, begin: int, end: int) -> torch.Tensor:
        """bool [splits, mblocks, ntiles]: the items among [begin, end)."""
        i = torch.arange(begin, end)
        mb, rest = i % self.mblocks, i // self.mblocks
        owned = torch.zeros(self.splits, self.mblocks, self.ntiles, dtype=torch.bool)
        owned[rest % self.splits, mb, rest // self.splits] = True
        return owned

    def owned_outputs(self, begin: int, end: int) -> torch.Tensor:
        """bool [M, N], or [splits, M, N] in parts mode: the outputs that items [begin, end)
        write on the CPU backend. Without parts, a tile is written by the record that holds its
        split 0 (once, whichever records the items form)."""
        owned = self.owned_items(begin, end)
        tiles = owned if self.parts else owned[0]
        rows = tiles.repeat_interleave(self.block_rows, -2)[..., : self.m, :]
        return rows.repeat_interleave(self.tile_cols, -1)[..., : self.n]


class LinearFamily(Family):
    """out = x W^T (+ bias) over x's last dim: torch.nn.functional.linear with Hugging Face's
    weights [out_features, in_features]. The layout picks a LinearPlan and adds inputs 2 (the bias,
    empty when there is none) and 3 (the split-K workspace); items are the plan's tiles.

    `parts` (linear_parts): out is fp32 [S, *x.shape[:-1], N], the sums of the plan's S ranges of
    K, split 0's with the bias; their sum is the linear. A consumer that sums them (the fused
    residual norms) spares the linear its combine. Input 3 is then an empty [S, 0] tensor.

    `activation` (linear_gelu, linear_gelu_tanh): out is that math function (mathlib) of the
    linear, applied in fp32 before out's rounding. `silu_glu` (linear_silu_glu): W's rows come
    in pairs, a gate's then its up's, and out [..., N / 2] is silu(gate) * up of each pair: an
    MLP's gated up projection with its SwiGLU."""

    header = "ops/linear.cuh"  # before its wait, a record streams its weights while x is made

    def __init__(self, parts: bool = False, activation: str | None = None) -> None:
        assert not (parts and activation), "parts are not final values: no activation"
        self.parts, self.activation = parts, activation
        self.name = "linear_parts" if parts else "_".join(filter(None, ("linear", activation)))
        self.macro = "GPUOS_DEFINE_" + self.name.upper()
        self.out_dtype = torch.float32 if parts else None
        self.gated = activation == GATED

    def layout(self, inputs: Tensors, dims: tuple[int, ...] | None, keepdim: bool) -> Layout:
        x, w, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        # parts mode's out has a leading dim more than x
        _check_ndim((1, *x.shape) if self.parts else x.shape, f"{self.name} input 0 (x)", least=1)
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise TensorSpecError(
                f"linear: input 1 (weight) must be [out_features, in_features] with in_features "
                f"the last dim of input 0 (x) {tuple(x.shape)}, got {tuple(w.shape)}"
            )
        if bias is not None and tuple(bias.shape) != (w.shape[0],):
            raise TensorSpecError(
                f"linear: input 2 (bias) must have shape ({w.shape[0]},) "
                f"(out_features), got {tuple(bias.shape)}"
            )
        if len({t.dtype for t in inputs}) > 1:
            raise TensorSpecError(
                f"linear: x, weight and bias must share one dtype, got "
                f"{', '.join(str(t.dtype) for t in inputs)}"
            )
        if self.gated and w.shape[0] % 2:
            raise TensorSpecError(
                f"{self.name}: input 1 (weight) must have an even out_features (rows in pairs: "
                f"a gate's, then its up's), got {tuple(w.shape)}"
            )
        plan = self._choose(x, w)
        views = (x, w, bias if bias is not None else x.new_empty(0), plan.workspace(x.device))
        outputs = plan.n // 2 if self.gated else plan.n
        shape = ((plan.splits,) if self.parts else ()) + tuple(x.shape[:-1]) + (outputs,)
        return Layout(views, shape, shape, plan.items)

    def fit_out(self, lay: Layout, out: torch.Tensor | None) -> Layout:
        """In parts mode an `out` given states the split count, its first dim (a caller whose
        task runs beside others plans its splits for its share of the multiprocessors with
        LinearPlan.choose); it must split K into that many non-empty ranges."""
        if not self.parts or out is None or out.dim() == 0 or out.shape[0] == lay.out_shape[0]:
            return lay
        x, w = lay.inputs[0], lay.inputs[1]
        wide = LinearPlan.of(x, w, lay.inputs[3]).wide  # the layout's tiles
        plans = {p.splits: p for p in LinearPlan.splittings(*LinearPlan.dims(x, w), True, wide)}
        plan = plans.get(out.shape[0])
        if plan is None:
            raise TensorSpecError(
                f"linear_parts: out's first dim is its count of K splits, each with some of K "
                f"({x.shape[-1]}): one of {', '.join(map(str, plans))}; got {out.shape[0]}"
            )
        shape = (plan.splits, *lay.out_shape[1:])
        inputs = (*lay.inputs[:3], plan.workspace(x.device))
        return replace(lay, inputs=inputs, out_shape=shape, ref_shape=shape, items=plan.items)

    def compute(self, xs: Tensors, p: Params, expr: Expr | None) -> torch.Tensor:
        x, w = xs[0], xs[1]
        bias = xs[2] if len(xs) > 2 and xs[2].numel() else None
        if self.gated:
            gate, up = gate_up(torch.nn.functional.linear(x, w, bias))
            return torch.nn.functional.silu(gate) * up
        if self.activation is not None:
            return FUNCTIONS[self.activation].torch(torch.nn.functional.linear(x, w, bias))
        if not self.parts:
            return torch.nn.functional.linear(x, w, bias)
        bounds = self._plan(xs).bounds
        return torch.stack(
            [
                torch.nn.functional.linear(x[..., k0:k1], w[:, k0:k1], bias if s == 0 else None)
                for s, (k0, k1) in enumerate(bounds)
            ]
        )

    def _plan(self, xs: Tensors) -> LinearPlan:
        """The plan of laid-out inputs, or of the call's own (x, w, bias?) as layout picks it."""
        x, w = xs[0], xs[1]
        if len(xs) > 3:
            return LinearPlan.of(x, w, xs[3])
        return self._choose(x, w)

    def _choose(self, x: torch.Tensor, w: torch.Tensor) -> LinearPlan:
        """The plan of x times w on their device's worker."""
        dims, device = LinearPlan.dims(x, w), x.device
        return LinearPlan.choose(*dims, sm_count(device), self.parts, wide=wide_tiles(device))

    def execute(
        self, out: torch.Tensor, xs: Tensors, p: Params, expr: Expr | None, begin: int, end: int
    ) -> None:
        plan = self._plan(xs)
        owned = plan.owned_outputs(begin, end)
        if self.gated:  # a pair's outputs share a tile: its gate's stands for it
            owned = gate_up(owned)[0]
        if not owned.any():
            return
        value = self.compute([*(t.float() for t in xs[:3]), xs[3]], p, expr)
        mask = owned.reshape(out.shape)
        out[mask] = value[mask].to(out.dtype)

    def cut(self, task: LaidOut, tile_elements: int) -> list[tuple[int, int]]:
        """At most one record per multiprocessor, of neighbouring items (a record streams its
        items' weights back to back)."""
        return _side_by_side(task)


# The cut of cuda/ops/attention.cuh (its GPUOS_ATTN_* constants; tests/unit/test_attention.py
# checks that they agree).
ATTENTION_WARPS = 8  # warps of a block that scan keys
ATTENTION_ALIGN = 16 * ATTENTION_WARPS  # a split's keys come in multiples of this: 16-key tiles
ATTENTION_ACC = 16  # output accumulators per lane: queries of an item x D / 32
ATTENTION_MAX_Q = 8  # queries of an item at most
# Workspace words before the counters: G, NQ, C, S, W, N (new_k and new_v given), R (ragged), a
# zero, then new_k's and new_v's TENSOR_REFs (zeros without them).
ATTENTION_NEWEST = 8  # the word the refs start at
ATTENTION_HEADER = ATTENTION_NEWEST + 2 * TENSOR_REF.itemsize // 4
ATTENTION_ITEMS_PER_SM = 4  # keys are split until the items cover the SMs this many times
ATTENTION_RECORDS_PER_SM = 4  # records per SM at most
# Warp mode (a warp an item), for at least a group per SM: splits of at most this many keys (16
# tiles one warp scans in turn), and at most this many of them (one warp combines them).
ATTENTION_WARP_KEYS = 256
ATTENTION_WARP_SPLITS = 4


@dataclass(frozen=True)
class AttentionPlan:
    """How an attention task's work is cut, as cuda/ops/attention.cuh states it: groups of at most
    `nq` of the `group` innermost rows that share K and V (and lengths, unless `ragged`), and
    `splits` ranges of `chunk` keys; one work item per (group, split). Shapes and strides decide
    it, never lengths."""

    rows: int  # rows of q
    group: int  # G: innermost rows that share K and V (and lengths, unless ragged)
    keys: int  # L
    d: int  # D
    splits: int  # S
    warps: bool = False  # W: warp mode, where the device can run it
    readers: int = 1  # sets of rows of one length that read one K and V (a prefill chunk's rows)
    ragged: bool = False  # R: a group's rows have lengths of their own

    @property
    def nq(self) -> int:
        """Queries of an item: as many of G as GPUOS_ATTN_ACC accumulators per lane allow."""
        per_lane = 1
        while 32 * per_lane < self.d:
            per_lane *= 2
        return min(self.group, ATTENTION_MAX_Q, ATTENTION_ACC // per_lane)

    @property
    def subgroups(self) -> int:
        return _ceil_div(self.group, self.nq)

    @property
    def groups(self) -> int:
        return self.rows // self.group * self.subgroups

    @property
    def chunk(self) -> int:
        """Keys of a split."""
        return _ceil_div(_ceil_div(self.keys, self.splits), ATTENTION_ALIGN) * ATTENTION_ALIGN

    @property
    def items(self) -> int:
        return self.groups * self.splits

    @property
    def counters(self) -> int:
        """Workspace words of the groups' arrival counters (padded like linear's)."""
        return _ceil_div(self.groups, 4) * 4

    @property
    def workspace_words(self) -> int:
        parts = self.splits * self.groups * self.nq * (self.d + 2) if self.splits > 1 else 0
        return ATTENTION_HEADER + self.counters + parts

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: torch.Tensor,
        newest: bool = False,
    ) -> AttentionPlan:
        """The plan of encoded views (lengths over q's leading dims, then anything). A group is
        the innermost rows over which K and V do not move, each with its own length (`ragged`)
        where the lengths move among them: a prefill chunk's rows over their slot's keys, up to
        8 of them an item where each was an item of its own (`newest`: the task gives its rows'
        newest keys apart, one per row, so rows group only where their lengths agree). With a
        group per SM or more, warp mode and splits of ATTENTION_WARP_KEYS (a block's items would
        each cost their latency one after another, whatever their keys), when that makes at most
        ATTENTION_WARP_SPLITS of them; else enough splits that the items cover
        ATTENTION_ITEMS_PER_SM times the SMs, when the keys allow."""
        lead = q.shape[:-1]

        def innermost(moves: Callable[[int], bool]) -> int:
            """Rows of the innermost leading dims over which nothing `moves`."""
            group = 1
            for dim in reversed(range(len(lead))):
                if lead[dim] != 1 and moves(dim):
                    break
                group *= lead[dim]
            return max(group, 1)

        def kv(dim: int) -> bool:
            return bool(k.stride(dim) or v.stride(dim))

        same = innermost(lambda dim: kv(dim) or bool(lengths.stride(dim)))
        group = same if newest else innermost(kv)
        shared = math.prod(n for dim, n in enumerate(lead) if not kv(dim))
        rows, keys, d = math.prod(lead), k.shape[-2], q.shape[-1]
        plan = cls(rows, group, keys, d, 1, readers=shared // same, ragged=group != same)
        sms, short = plan.sms(q.device), _ceil_div(plan.keys, ATTENTION_WARP_KEYS)
        if plan.groups >= sms and short <= ATTENTION_WARP_SPLITS:
            plan = replace(plan, splits=short, warps=True)
        else:
            want = _ceil_div(ATTENTION_ITEMS_PER_SM * sms, max(plan.groups, 1))
            most = _ceil_div(plan.keys, ATTENTION_ALIGN)
            plan = replace(plan, splits=max(1, min(want, most)))
        return replace(plan, splits=_ceil_div(plan.keys, plan.chunk))  # no split without keys

    def sms(self, device: torch.device, share: int | None = None) -> int:
        """Multiprocessors the task is cut for: a `share`-th of them where the call says that
        many tasks split the machine (OpCall.share), else all, or a `readers`-th of them where
        that many sets of rows of one length read one K and V. A prefill step has a task per
        chunk of a prompt, each reading its one slot's keys: cut for the whole machine, every
        chunk's task took a record per SM (50k records in a GPT-2 step of 512 prompt rows) for a
        slot's worth of keys."""
        if share is not None:
            return max(1, sm_count(device) // share)
        return _ceil_div(sm_count(device), self.readers)

    def workspace(
        self, device: torch.device, newest: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        """Zeroed (the counters must be), after the header the device reads the plan from, with
        the refs of `newest` (new_k, new_v: _newest) where given."""
        # zeroed where it lives (counters and partials can be megabytes), the header built on
        # the host and copied once
        words = torch.zeros(self.workspace_words, dtype=torch.int32, device=device)
        header = np.zeros(ATTENTION_HEADER, dtype=np.int32)
        fields = (
            self.group,
            self.nq,
            self.chunk,
            self.splits,
            int(self.warps),
            int(bool(newest)),
            int(self.ragged),
        )
        header[: len(fields)] = fields
        if newest:
            refs = np.frombuffer(b"".join(encode_ref(x) for x in newest), dtype=np.int32)
            header[ATTENTION_NEWEST : ATTENTION_NEWEST + refs.size] = refs
        words[:ATTENTION_HEADER] = torch.from_numpy(header)
        return words

    def owned_rows(self, begin: int, end: int) -> torch.Tensor:
        """The rows of the groups whose split 0 is among items [begin, end), in order: where the
        CPU backend writes each row (once, whichever records the items form)."""
        first, last = _ceil_div(begin, self.splits), _ceil_div(end, self.splits)
        return torch.arange(self._first_row(first), self._first_row(last))

    def _first_row(self, group: int) -> int:
        period, sub = divmod(group, self.subgroups)
        return min(period * self.group + sub * self.nq, self.rows)


def _newest(
    given: Sequence[torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor], lead: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """Attention's new_k and new_v (inputs 4 and 5, where given) expanded to q's leading dims
    `lead` and D, as the workspace carries them; TensorSpecError says what to fix."""
    if not given:
        return ()
    if len(given) != 2:
        raise TensorSpecError("attention: the newest keys and values come as a pair: new_k, new_v")
    out = []
    for name, x, m in zip(("new_k", "new_v"), given, kv):
        want = lead + m.shape[-1:]
        if not _broadcasts_to(x.shape, want):
            raise TensorSpecError(
                f"attention: {name} must broadcast to q's leading dims and D, {want}, got "
                f"{tuple(x.shape)}"
            )
        if x.dtype != m.dtype or x.stride(-1) != m.stride(-1):
            raise TensorSpecError(
                f"attention: {name} must have K's and V's dtype ({m.dtype}) and the stride of "
                f"their last dim ({m.stride(-1)}), got {x.dtype} and {x.stride(-1)}"
            )
        out.append(x.expand(want))
    return tuple(out)


def _carried_newest(control: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """new_k and new_v as the workspace that encoded lengths `control` carries them (host
    memory: the CPU backend), or () where it carries none."""
    at = control.stride(-1) * 4  # the workspace's address (_carrying)
    header = ctypes.string_at(at, 4 * ATTENTION_HEADER)
    if not int.from_bytes(header[20:24], "little"):
        return ()
    refs = np.frombuffer(header[4 * ATTENTION_NEWEST :], dtype=TENSOR_REF)
    return tuple(decode_ref(ref) for ref in refs)


def _carrying(lengths: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """Attention's lengths as encoded: [..., 1], the size-1 dim's stride the workspace's address in
    int32 words (no element is addressed through it: the ABI has no fifth input). The view holds
    the workspace, so that it lives as long as the task's inputs."""
    view = lengths.unsqueeze(-1)
    view = view.as_strided(
        view.shape, view.stride()[:-1] + (workspace.data_ptr() // 4,), view.storage_offset()
    )
    view.workspace = workspace  # type: ignore[attr-defined]
    return view


@functools.cache
def family(name: str) -> Family:
    """The family object of that name (one instance each)."""
    return {f.name: f for f in _FAMILIES}[name]


_FAMILIES: tuple[Family, ...] = (
    MapFamily(),
    RowFamily("softmax", "GPUOS_DEFINE_SOFTMAX", lambda xs, s: torch.softmax(xs[0], dim=-1)),
    RowFamily(
        "log_softmax", "GPUOS_DEFINE_LOG_SOFTMAX", lambda xs, s: torch.log_softmax(xs[0], dim=-1)
    ),
    RowFamily("layernorm", "GPUOS_DEFINE_LAYERNORM", _layernorm),
    RowFamily("rmsnorm", "GPUOS_DEFINE_RMSNORM", _rmsnorm),
    AddNormFamily("add_layernorm", "GPUOS_DEFINE_ADD_LAYERNORM", _layernorm),
    AddNormFamily("add_rmsnorm", "GPUOS_DEFINE_ADD_RMSNORM", _rmsnorm),
    ReduceFamily("sum", "GPUOS_DEFINE_SUM", mean=False),
    ReduceFamily("mean", "GPUOS_DEFINE_MEAN", mean=True),
    RotaryFamily(),
    RotaryFamily(parts=True),
    AttentionFamily(),
    ScatterRowsFamily(),
    GatherRowsFamily(),
    SampleFamily(),
    LinearFamily(),
    LinearFamily(parts=True),
    LinearFamily(activation="gelu"),
    LinearFamily(activation="gelu_tanh"),
    LinearFamily(activation=GATED),
    FeedTokensFamily(),
    TickFamily(),
)
