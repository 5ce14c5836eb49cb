"""Every catalogue operator on each backend against its torch reference (computed in float64),
over fresh random shapes, non-contiguous and broadcast inputs, and float32/float16/bfloat16."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gpuos_core import OpCall, Runtime
from gpuos_core.calls import Prepared
from gpuos_core.catalogue import CATALOGUE, OpSpec
from gpuos_core.families import family

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# ‖out − ref‖ / ‖ref‖ bounds for a result stored in each dtype (fp32 compute, rounding on store)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
POSITIVE_FIRST = {"log", "sqrt", "pow"}  # domain: input 0 > 0
AWAY_FROM_ZERO = {"div": 1, "reciprocal": 0}  # input index kept away from 0
MAP_OPS = sorted(n for n, s in CATALOGUE.items() if s.family == "map")
SUMS = {"sum", "mean"}  # rounding grows with Σ|x|, so a sum that cancels is measured against that
# A map whose every output sits in a far tail (gelu_tanh(-5.4) is -2e-8, and fp32's 1 + tanh
# gives -0, as torch's does) is measured against this fraction of its inputs' size instead. There
# fp32's 1 + tanh(u) keeps only an absolute error of ulp(1) / 2: torch's own fp32 gelu_tanh is off
# by up to 3.0e-8 |x| over x in [-6, -2], which a floor of 1e-3 read as 3e-5 (CI failed on one
# input of -4.0); 1e-2 keeps that 3x inside TOLERANCE's 1e-5.
TAIL_FLOOR = 1e-2


@pytest.fixture(scope="module")
def rt(backend: str) -> Runtime:
    with Runtime(backend) as runtime:
        yield runtime


def rel_error(
    out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None, floor: float = 0.0
) -> float:
    """‖out − ref‖ / ‖scale‖, `scale` being `ref` unless given (sums: see SUMS), and the
    denominator at least `floor` (maps: see TAIL_FLOOR)."""
    out, ref = out.double(), ref.double()
    norm = max((ref if scale is None else scale.double()).norm().item(), floor, 1e-30)
    assert not torch.isnan(out).any(), "NaN in output"
    return (out - ref).norm().item() / norm


def error(call: OpCall, task: Prepared) -> float:
    """The task's relative error against the operator's reference on float64 inputs."""
    spec = CATALOGUE[call.op]
    ref = spec.check_reference([x.double() for x in task.inputs], task.params)
    if call.op in SUMS:
        scale = spec.check_reference([x.double().abs() for x in task.inputs], task.params)
        return rel_error(task.out_ref, ref, scale)
    if spec.family == "map":
        floor = TAIL_FLOOR * max(x.double().norm().item() for x in task.inputs)
        return rel_error(task.out_ref, ref, floor=floor)
    return rel_error(task.out_ref, ref)


def check(rt: Runtime, call: OpCall) -> Prepared:
    """Run `call` alone and compare with the operator's reference on float64 inputs."""
    task = rt.prepare(call)
    rt.submit([task]).wait(10).result(0)
    err = error(call, task)
    assert err < TOLERANCE[task.out.dtype], f"{call.op}: relative error {err:.2e}"
    return task


def rand(
    rt: Runtime, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Fresh normal samples on the runtime's device (drawn on the CPU: same stream everywhere)."""
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=rt.device)


def domain(op: str, k: int, x: torch.Tensor) -> torch.Tensor:
    """Keep inputs inside the operator's domain (positive, or away from zero)."""
    if op in POSITIVE_FIRST and k == 0:
        return x.abs() + 0.5
    if AWAY_FROM_ZERO.get(op) == k:
        return torch.where(x >= 0, x + 0.5, x - 0.5)
    if op == "pow" and k == 1:  # base up to ~9: a larger exponent overflows float16 (inf)
        return x.clamp(-3.0, 3.0)
    return x


def map_inputs(
    rt: Runtime,
    spec: OpSpec,
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    return tuple(domain(spec.name, k, rand(rt, s, dtype, gen) * 2) for k, s in enumerate(shapes))


def default_scalars(spec: OpSpec) -> dict[str, float]:
    given = {"min": -0.5, "max": 0.7}
    return {p.name: given[p.name] for p in spec.scalars if p.default is None and p.name in given}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", MAP_OPS)
def test_map_contiguous_random_shapes(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    spec, gen = CATALOGUE[op], torch.Generator().manual_seed(random.randrange(2**31))
    for _ in range(3):
        shape = tuple(random.randint(1, 9) for _ in range(random.randint(1, 4)))
        xs = map_inputs(rt, spec, [shape] * spec.arity, dtype, gen)
        check(rt, OpCall(op, xs, scalars=default_scalars(spec)))


@pytest.mark.parametrize("op", MAP_OPS)
def test_map_one_element_over_a_value_grid(rt: Runtime, op: str) -> None:
    """One-element fp32 calls (the draw that leaves a lone input in a tail) over a fixed grid."""
    spec = CATALOGUE[op]
    grid = torch.linspace(-6.0, 6.0, 49).tolist()
    calls = [
        OpCall(
            op,
            tuple(domain(op, k, torch.tensor([v], device=rt.device)) for k in range(spec.arity)),
            scalars=default_scalars(spec),
        )
        for v in grid
    ]
    tasks = [rt.prepare(c) for c in calls]
    rt.submit(tasks).wait(10)
    for v, c, task in zip(grid, calls, tasks):
        err = error(c, task)
        assert err < TOLERANCE[torch.float32], f"{op}({v:.2f}): relative error {err:.2e}"


@pytest.mark.parametrize("op", MAP_OPS)
def test_map_non_contiguous_and_broadcast(rt: Runtime, op: str) -> None:
    spec, gen = CATALOGUE[op], torch.Generator().manual_seed(random.randrange(2**31))
    base = map_inputs(rt, spec, [(7, 5, 6)] * spec.arity, torch.float32, gen)
    strided = tuple(x[1:, ::2].transpose(0, 2) for x in base)  # (3, 5, 6) non-contiguous
    assert not strided[0].is_contiguous()
    check(rt, OpCall(op, strided, scalars=default_scalars(spec)))
    if spec.arity == 2:
        a, b = map_inputs(rt, spec, [(4, 1, 6), (3, 1)], torch.float32, gen)
        task = check(rt, OpCall(op, (a, b)))
        assert task.out.shape == (4, 3, 6)


def test_binary_mixed_dtypes_promote_and_out_dtype(rt: Runtime) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    a, b = rand(rt, (5, 8), torch.float16, gen), rand(rt, (8,), torch.bfloat16, gen)
    task = check(rt, OpCall("mul", (a, b)))
    assert task.out.dtype == torch.float32  # promote_types(float16, bfloat16)
    task = check(rt, OpCall("add", (a, a), out_dtype=torch.bfloat16))
    assert task.out.dtype == torch.bfloat16


def test_given_out_is_written_in_place(rt: Runtime) -> None:
    a = torch.randn(6, 4, device=rt.device)
    out = torch.full((8, 6), float("nan"), device=rt.device)
    view = out[1:7, 1:5]  # strided view into a larger buffer
    rt.run("sigmoid", a, out=view)
    torch.testing.assert_close(out[1:7, 1:5], torch.sigmoid(a))
    assert torch.isnan(out[0]).all() and torch.isnan(out[:, 0]).all()  # untouched around it


def row_case(rt: Runtime, op: str, dtype: torch.dtype, gen: torch.Generator) -> OpCall:
    rows, n = random.randint(1, 9), random.randint(1, 300)
    x = rand(rt, (n, rows), dtype, gen).t()  # non-contiguous rows
    extra = {"layernorm": 2, "rmsnorm": 1}.get(op, 0)
    params = tuple(
        rand(rt, (n,), dtype, gen) for _ in range(random.randint(0, extra) if extra else 0)
    )
    return OpCall(op, (x * 3,) + params)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layernorm", "rmsnorm"])
def test_row_operators(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for _ in range(4):
        check(rt, row_case(rt, op, dtype, gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layernorm", "rmsnorm"])
def test_norms_on_either_side_of_the_warp_row_limit(
    rt: Runtime, op: str, dtype: torch.dtype
) -> None:
    """Rows of up to 256 go one per warp, longer ones too when there are rows for every warp,
    else the whole block takes each row; weight and bias given."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for rows, n in [(3, 256), (3, 257), (64, 257), (2, 768), (1, 2049)]:
        params = tuple(rand(rt, (n,), dtype, gen) for _ in range(2 if op == "layernorm" else 1))
        check(rt, OpCall(op, (rand(rt, (rows, n), dtype, gen) * 3,) + params))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reductions_over_dims_with_keepdim(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x = rand(rt, (5, 7, 4), dtype, gen).permute(2, 0, 1)  # (4, 5, 7), non-contiguous
    for dims, keepdim in [(None, False), ((1,), True), ((0, 2), False), ((-1,), False)]:
        task = check(rt, OpCall(op, (x,), dims=dims, keepdim=keepdim))
        expect = getattr(torch, op)(
            x.double(), dim=dims if dims else tuple(range(3)), keepdim=keepdim
        )
        assert task.out.shape == expect.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["swiglu", "gelu_tanh", "add"])
def test_map_over_views_of_rows(rt: Runtime, op: str, dtype: torch.dtype) -> None:
    """The halves of one projection's rows (swiglu's gate and up), rows whose starts are not 4
    elements apart, and a view that starts off a 4-element boundary: each as the reference."""
    spec, gen = CATALOGUE[op], torch.Generator().manual_seed(random.randrange(2**31))
    base = map_inputs(rt, spec, [(37, 48)] * spec.arity, dtype, gen)
    halves = tuple(x.chunk(2, dim=-1)[k % 2] for k, x in enumerate(base))
    ragged = tuple(x.view(-1)[: 37 * 46].view(37, 46)[:, :44] for x in base)
    shifted = tuple(x[:, 1:25] for x in base)
    for xs in (halves, ragged, shifted):
        assert not xs[0].is_contiguous()
        check(rt, OpCall(op, xs, scalars=default_scalars(spec)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_long_reductions_over_contiguous_inner_dims(
    rt: Runtime, op: str, dtype: torch.dtype
) -> None:
    """Rows of logits' length (the step's finiteness check sums them), a view that starts inside
    its buffer, and every dim of a contiguous tensor: each output from its own elements."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    rows = rand(rt, (4, 5003), dtype, gen)
    cube = rand(rt, (2, 3, 700), dtype, gen)
    for x, dims in [(rows, (-1,)), (rows[1:], (1,)), (cube, None), (cube, (1, 2))]:
        task = check(rt, OpCall(op, (x,), dims=dims))
        expect = getattr(torch, op)(x.double(), dim=dims if dims else tuple(range(x.dim())))
        assert task.out.shape == expect.shape


def test_long_reductions_take_a_record_each_up_to_the_multiprocessors() -> None:
    """The step's finiteness sums of its rows of logits run side by side (a block a row, a
    record a row up to the SMs: 132 off a GPU), not 4 rows to a record in turn; reductions
    short enough for a thread each stay cut by elements."""

    def cut(shape: tuple[int, ...]) -> list[int]:
        with Runtime("cpu") as runtime:
            task = runtime.prepare(OpCall("sum", (torch.zeros(shape),), dims=(1,)))
        return [e - b for b, e in family("sum").ranges(task, 16384)]

    assert cut((8, 256)) == [1] * 8
    assert cut((264, 256)) == [2] * 132
    assert cut((4096, 64)) == [32] * 128


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_with_broadcast_tables(rt: Runtime, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    tokens, heads, d = random.randint(1, 6), random.randint(1, 4), 2 * random.randint(1, 32)
    angle = rand(rt, (tokens, 1, d // 2), torch.float32, gen)
    x = rand(rt, (tokens, heads, d), dtype, gen)
    check(rt, OpCall("rotary", (x, angle.cos().to(dtype), angle.sin().to(dtype))))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_decode_over_kv_cache_views(rt: Runtime, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    heads, d, capacity = 4, 64, 300
    cache_k, cache_v = (rand(rt, (heads, capacity, d), dtype, gen) for _ in range(2))
    for length in (1, 17, 300):  # ragged: each request attends over its own KV length
        q = rand(rt, (heads, d), dtype, gen)
        task = check(rt, OpCall("attention_decode", (q, cache_k[:, :length], cache_v[:, :length])))
        assert task.params.scalars == (1 / math.sqrt(d),)
    q = rand(rt, (heads, d), dtype, gen)
    check(
        rt,
        OpCall("attention_decode", (q, cache_k[:1, :9], cache_v[:1, :9]), scalars={"scale": 0.3}),
    )  # one KV head shared by every query head


def test_a_batch_mixes_operators_and_keeps_each_result(rt: Runtime) -> None:
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    f32 = torch.float32
    calls = [
        row_case(rt, "softmax", f32, gen),
        OpCall("add", (rand(rt, (3,), f32, gen),) * 2),
        OpCall("mean", (rand(rt, (4, 5), f32, gen),), dims=(1,)),
        row_case(rt, "rmsnorm", torch.float16, gen),
    ]
    tasks = [rt.prepare(c) for c in calls]
    batch = rt.submit(tasks).wait(10)
    for call, task, out in zip(calls, tasks, batch.results()):
        assert out is task.out
        assert error(call, task) < TOLERANCE[out.dtype]


def test_every_catalogue_operator_is_covered() -> None:
    covered = set(MAP_OPS) | {
        "softmax",
        "log_softmax",
        "layernorm",
        "rmsnorm",
        "sum",
        "mean",
        "rotary",
        "attention_decode",
    }
    # with the index inputs of rotary and attention: test_index_ops.py
    covered |= {"scatter_rows", "rotary_parts"}
    covered |= {"add_rmsnorm", "add_layernorm"}  # test_fused_norm.py
    covered |= {"sample_tokens"}  # test_device_sampling.py
    linears = {"linear", "linear_parts", "linear_gelu", "linear_gelu_tanh", "linear_silu_glu"}
    covered |= linears  # test_linear.py
    covered |= {"gather_rows"}  # test_gather_rows.py
    covered |= {"feed_tokens", "tick"}  # test_step_chain.py
    assert covered == set(CATALOGUE)
