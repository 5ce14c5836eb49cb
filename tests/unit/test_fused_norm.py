"""Fused residual add + norm (add_rmsnorm, add_layernorm) on each backend: x is updated in place to
(x + y) rounded to x's dtype, bit for bit, and out matches the unfused torch reference
`r = (x + y).to(x.dtype); out = norm(r) * weight (+ bias)` computed in float64, over ragged and
strided shapes, tiled tasks and every float dtype; plus the validation messages."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from test_catalogue import DTYPES, TOLERANCE, rel_error
from test_index_ops import randn

from gpuos_core import OpCall, Runtime
from gpuos_core.catalogue import family
from gpuos_core.errors import TensorSpecError
from gpuos_core.families import ADDNORM_PAIR_MAX, ADDNORM_PAIR_ROWS

OPS = ("add_rmsnorm", "add_layernorm")
# ragged lengths, rows one per warp and rows a block each, either side of 256 (the warp's limit)
SHAPES = [(1, 1), (3, 7), (5, 33), (2, 3, 300), (1, 4096), (17, 1000), (64, 257)]
SHAPES += [(3, 256), (3, 257), (1, 768), (2, 2048)]  # rows held in registers: 768 to 2048
SHAPES += [(4, 768), (5, 764)]  # on CUDA a record a row: the block each
# On CUDA these are cut 2-16 rows a record (rows over 132 SMs, as a prefill step's are), which the
# device runs side by side: a pair of warps a row up to 768, else the block a row, one after
# another (8 rows a record and more: a 2,048-row step's). The CPU backend computes every record
# with torch, so they run on CUDA only.
RECORD_SHAPES = [(512, 768), (390, 764), (512, 2048), (300, 1028), (260, 2044)]
RECORD_SHAPES += [(2048, 768), (1500, 764), (2048, 2048), (1100, 1028)]
# (shape, splits): y as a linear_parts' partial sums
PARTS = [((1, 768), 3), ((64, 768), 6), ((3, 257), 6), ((2, 3, 300), 1), ((5, 33), 2)]
PARTS += [((2, 2048), 4), ((3, 256), 5), ((4, 768), 4)]
RECORD_PARTS = [((512, 768), 4), ((512, 2048), 2), ((300, 1028), 2), ((512, 2048), 3)]
RECORD_PARTS += [((2048, 768), 2), ((2048, 2048), 1)]


@pytest.fixture(scope="module")
def rt(tiled_rt: Runtime) -> Runtime:
    return tiled_rt


def unfused(
    op: str, x: torch.Tensor, y: torch.Tensor, params: tuple[torch.Tensor, ...], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new x and out the fused operator must give, from the unfused torch ops on the CPU:
    (x + y).to(x.dtype), then the norm of that rounded sum in float64."""
    r = (x.cpu() + y.cpu()).to(x.dtype)
    w = [p.cpu().double() for p in params]
    n = r.shape[-1]
    if op == "add_rmsnorm":
        return r, F.rms_norm(r.double(), (n,), *w, eps=eps)
    return r, F.layer_norm(r.double(), (n,), *w, eps=eps)


def run_fused(
    rt: Runtime,
    op: str,
    x: torch.Tensor,
    y: torch.Tensor,
    params: tuple[torch.Tensor, ...],
    eps: float,
) -> torch.Tensor:
    task = rt.prepare(OpCall(op, (x, y) + params, scalars={"eps": eps}))
    return rt.submit([task]).wait(30).result(0)


def check(
    rt: Runtime,
    op: str,
    x: torch.Tensor,
    y: torch.Tensor,
    params: tuple[torch.Tensor, ...] = (),
    eps: float = 1e-5,
) -> None:
    want_x, want_out = unfused(op, x, y, params, eps)
    out = run_fused(rt, op, x, y, params, eps)
    assert torch.equal(x.cpu(), want_x), "x was not updated to (x + y).to(x.dtype)"
    err = rel_error(out.cpu(), want_out)
    assert err < TOLERANCE[out.dtype], f"{op}: relative error {err:.2e}"


def check_shapes(
    rt: Runtime, op: str, dtype: torch.dtype, shapes: Sequence[tuple[int, ...]]
) -> None:
    """x and y of each shape, with the op's parameters, against the unfused reference."""
    for seed, shape in enumerate(shapes):
        n = shape[-1]
        x, y = randn(rt, shape, dtype, 3 * seed), randn(rt, shape, dtype, 3 * seed + 1)
        params = tuple(
            randn(rt, (n,), dtype, 100 + k) for k in range(2 if op == "add_layernorm" else 1)
        )
        check(rt, op, x, y, params)


def check_parts(
    rt: Runtime, op: str, dtype: torch.dtype, cases: Sequence[tuple[tuple[int, ...], int]]
) -> None:
    """y given as a linear_parts' S partial sums [S, *x.shape] (fp32) stands for their sum in
    split order: x becomes (x + ((y0 + y1) + ...)).to(x.dtype) bit for bit."""
    for seed, (shape, splits) in enumerate(cases):
        x = randn(rt, shape, dtype, 7 * seed)
        parts = randn(rt, (splits, *shape), torch.float32, 7 * seed + 1)
        total = parts[0].cpu().clone()
        for part in parts[1:]:
            total += part.cpu()  # in split order, as the operator adds them
        n = shape[-1]
        params = tuple(
            randn(rt, (n,), dtype, 7 * seed + 2 + k)
            for k in range(2 if op == "add_layernorm" else 1)
        )
        want_x, want_out = unfused(op, x, total, params, 1e-5)
        out = run_fused(rt, op, x, parts, params, 1e-5)
        assert torch.equal(x.cpu(), want_x), f"{shape} in {splits} parts"
        assert rel_error(out.cpu(), want_out) < TOLERANCE[out.dtype], f"{shape} in {splits} parts"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_fused_equals_unfused_over_shapes(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    check_shapes(rt, op, dtype, SHAPES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_partial_sums_as_the_residual(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    check_parts(rt, op, dtype, PARTS)


# the module's CUDA runtime, the one the backend-generic tests use there
@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_several_rows_a_record(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    check_shapes(rt, op, dtype, RECORD_SHAPES)
    check_parts(rt, op, dtype, RECORD_PARTS)


def test_rows_of_a_task_sharing_the_machine_come_several_a_record() -> None:
    """A norm that shares the machine (OpCall.share: a lane of a decode step beside another)
    takes rows that pairs of warps hold ADDNORM_PAIR_ROWS a record, with partial sums too, so
    that its records hold fewer blocks while they wait; alone, a record a row (the most SMs for
    its bytes); rows too long for a pair, and rows the elements already gather, as before."""

    def cut(rows: int, width: int, parts: int = 0, share: int | None = 2) -> list[int]:
        x, w = torch.zeros(rows, width), torch.ones(width)
        y = torch.zeros(parts, rows, width) if parts else torch.zeros(rows, width)
        call = OpCall("add_layernorm", (x, y, w, torch.zeros(width)), share=share)
        with Runtime("cpu") as runtime:
            task = runtime.prepare(call)
        return [e - b for b, e in family("add_layernorm").ranges(task, 16384)]

    assert cut(32, 768, 4) == [ADDNORM_PAIR_ROWS] * (32 // ADDNORM_PAIR_ROWS)
    assert cut(32, 768, 4, share=None) == [1] * 32
    assert cut(10, ADDNORM_PAIR_MAX) == [4, 4, 2]
    assert cut(1, 768, 4) == [1]
    assert cut(64, 2048, 4) == [1] * 64  # the block a row
    assert cut(2048, 768) == [16] * 128  # by elements: more than a pair's rows already


@pytest.mark.parametrize("op", OPS)
def test_optional_parameters_eps_and_mixed_dtypes(rt: Runtime, op: str) -> None:
    x = randn(rt, (6, 40), torch.bfloat16, 1)
    y = randn(rt, (6, 40), torch.float32, 2)  # the sum is still rounded to x's bfloat16
    check(rt, op, x, y, eps=1e-2)
    check(rt, op, x, y.half(), (randn(rt, (40,), torch.float32, 3),), eps=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_strided_views_update_in_place(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    base = randn(rt, (30, 9), dtype, 4)
    x = base.t()[:, ::2]  # (9, 15), non-contiguous rows inside a larger buffer
    y = randn(rt, (15, 9), dtype, 5).t()
    before = base.clone()
    check(rt, op, x, y, (randn(rt, (15,), dtype, 6),))
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[::2] = False
    assert torch.equal(base[untouched], before[untouched]), "wrote outside x's view"


def test_ragged_tasks_in_one_submission(rt: Runtime) -> None:
    """Residual streams of different requests (lengths and dtypes) in one batch, each its own."""
    cases = []
    for seed, (rows, n, dtype) in enumerate(
        [
            (1, 64, torch.float16),
            (7, 64, torch.bfloat16),
            (3, 300, torch.float32),
            (2, 5, torch.float16),
        ]
    ):
        x, y = randn(rt, (rows, n), dtype, 10 * seed), randn(rt, (rows, n), dtype, 10 * seed + 1)
        w = randn(rt, (n,), dtype, 10 * seed + 2)
        op = OPS[seed % 2]
        params = (w, w) if op == "add_layernorm" else (w,)
        cases.append((op, x, y, params, unfused(op, x, y, params, 1e-5)))
    tasks = [rt.prepare(OpCall(op, (x, y) + p)) for op, x, y, p, _ in cases]
    results = rt.submit(tasks).wait(30).results()
    for (op, x, _, _, (want_x, want_out)), out in zip(cases, results):
        assert torch.equal(x.cpu(), want_x)
        assert rel_error(out.cpu(), want_out) < TOLERANCE[out.dtype], op


@pytest.mark.parametrize(
    "inputs, message",
    [
        (lambda x: (x, x[:, :4]), "input 1 (the residual y) must have the shape of input 0"),
        (lambda x: (x, x.expand(7, 3, 8)), "or be [S, *that] with 1 <= S <= 6 partial sums"),
        (lambda x: (x[:1].expand(3, 8), x), "updated in place, so it must not be an expanded view"),
        (lambda x: (x, x, torch.ones(7)), "input 2 must have shape (8,)"),
        (lambda x: (x, x.int()), "input 1 has dtype torch.int32"),
        (lambda x: (x,), "takes 2 to 3 tensor input(s), got 1"),
    ],
)
def test_validation_messages(inputs, message: str) -> None:
    with Runtime("cpu") as rt:
        with pytest.raises(TensorSpecError, match=re.escape(message)):
            rt.prepare(OpCall("add_rmsnorm", inputs(torch.randn(3, 8))))
