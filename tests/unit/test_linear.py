"""The linear operator (out = x W^T + bias, issue 12) on each backend against torch in float64:
decode and prefill row counts, K and N off the tile sizes, fp32/fp16/bf16, leading dims and
strided views (both kernel paths on a GPU), split-K plans, records cut anywhere, reruns, and the
validation messages; its gelu and SwiGLU forms (an MLP's up projection). The plan's arithmetic is
checked against the kernel's header."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_catalogue import DTYPES, TOLERANCE, rel_error

from gpuos_core import OpCall, Runtime
from gpuos_core.abi import TASK, encode_task
from gpuos_core.calls import Prepared
from gpuos_core.errors import TensorSpecError
from gpuos_core.families import (
    DEFAULT_SMS,
    LINEAR_COLS,
    LINEAR_KSTEP,
    LINEAR_MAX_PARTS,
    LINEAR_PART_ROWS,
    LINEAR_ROWS,
    LINEAR_STEP_ALIGN,
    LINEAR_WIDE,
    LinearPlan,
    family,
)
from gpuos_core.paths import CUDA_DIR


@pytest.fixture(scope="module")
def rt(backend: str) -> Runtime:
    with Runtime(backend) as runtime:
        if backend == "cpu":  # cut tasks into records here too, so each record writes part of out
            runtime.backend.tile_elements = 512
        yield runtime


def randn(rt: Runtime, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal samples drawn on the CPU (the same numbers on every backend), on the runtime's
    device, scaled so that outputs stay O(1) whatever K."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) / shape[-1] ** 0.25).to(dtype=dtype, device=rt.device)


def check(rt: Runtime, task: Prepared) -> None:
    """Run `task` alone and compare with F.linear of its inputs in float64."""
    rt.submit([task]).wait(30)
    x, w, bias = (t.double() for t in task.inputs[:3])
    ref = F.linear(x, w, bias if bias.numel() else None)
    err = rel_error(task.out, ref)
    assert err < TOLERANCE[task.out.dtype], f"linear {tuple(x.shape)} x {tuple(w.shape)}: {err:.2e}"


def linear(
    rt: Runtime, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, **call: object
) -> Prepared:
    return rt.prepare(OpCall("linear", (x, w) if bias is None else (x, w, bias), **call))


def recut(task: Prepared, cuts: int, plan: LinearPlan | None = None) -> Prepared:
    """`task` in records cut at up to `cuts` random items; run by `plan` (its workspace) when
    given."""
    inputs = task.inputs if plan is None else (*task.inputs[:3], plan.workspace(task.out.device))
    items = task.items if plan is None else plan.items
    points = sorted(random.sample(range(1, items), min(cuts, items - 1)))
    ranges = list(zip([0] + points, points + [items]))
    records = np.empty(len(ranges), dtype=TASK)
    encode_task(records, ranges, task.out_ref, inputs, task.params.scalars)
    return replace(task, inputs=inputs, items=items, records=records)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 24, 64, 200])  # m-blocks of 8, 16, 32, 64 rows
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_linear_matches_torch(rt: Runtime, dtype: torch.dtype, m: int, with_bias: bool) -> None:
    # K = 200 is no multiple of a 32-wide step, N = 130 no multiple of a 64-wide tile; K = 1000
    # splits K into several ranges for few rows; K = 100 (not a multiple of 8) takes the CUDA-core
    # path on a GPU.
    for seed, (k, n) in enumerate([(200, 130), (1000, 70), (100, 64)]):
        x, w = randn(rt, (m, k), dtype, seed), randn(rt, (n, k), dtype, seed + 100)
        bias = randn(rt, (n,), dtype, seed + 200) if with_bias else None
        check(rt, linear(rt, x, w, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 16, 64, 200])
@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh"])
def test_linear_with_gelu_matches_torch(rt: Runtime, dtype: torch.dtype, m: int, kind: str) -> None:
    """linear_gelu and linear_gelu_tanh: the activation of each final value, on every path (on a
    GPU: tensor cores with K unsplit (K = 200) and split (K = 1000), and the CUDA-core path
    (K = 100))."""
    approximate = "tanh" if kind == "gelu_tanh" else "none"
    for seed, (k, n) in enumerate([(200, 130), (1000, 70), (100, 64)]):
        x, w = randn(rt, (m, k), dtype, seed), randn(rt, (n, k), dtype, seed + 100)
        bias = randn(rt, (n,), dtype, seed + 200)
        task = rt.prepare(OpCall(f"linear_{kind}", (x, w, bias)))
        rt.submit([task]).wait(30)
        ref = F.gelu(F.linear(x.double(), w.double(), bias.double()), approximate=approximate)
        err = rel_error(task.out, ref)
        assert err < TOLERANCE[dtype], f"linear_{kind} {m} x {k} x {n}: {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 16, 64, 200])
def test_linear_with_swiglu_matches_torch(rt: Runtime, dtype: torch.dtype, m: int) -> None:
    """linear_silu_glu: W's rows in pairs (gate, up), out silu(gate) * up of each pair, half as
    wide as W is tall, on every path as above; an odd count of rows is refused."""
    for seed, (k, n) in enumerate([(200, 130), (1000, 70), (100, 64)]):
        x, w = randn(rt, (m, k), dtype, seed), randn(rt, (n, k), dtype, seed + 100)
        bias = randn(rt, (n,), dtype, seed + 200)
        task = rt.prepare(OpCall("linear_silu_glu", (x, w, bias)))
        assert task.out.shape == (m, n // 2)
        rt.submit([task]).wait(30)
        y = F.linear(x.double(), w.double(), bias.double())
        ref = F.silu(y[:, 0::2]) * y[:, 1::2]
        err = rel_error(task.out, ref)
        assert err < TOLERANCE[dtype], f"linear_silu_glu {m} x {k} x {n}: {err:.2e}"
    with pytest.raises(TensorSpecError, match="even out_features"):
        rt.prepare(OpCall("linear_silu_glu", (x, w[:-1])))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_leading_dims_and_strided_views(rt: Runtime, dtype: torch.dtype) -> None:
    w, bias = randn(rt, (96, 64), dtype, 1), randn(rt, (96,), dtype, 2)
    x = randn(rt, (2, 3, 64), dtype, 3)
    task = linear(rt, x, w, bias)
    assert task.out.shape == (2, 3, 96)
    check(rt, task)
    check(rt, linear(rt, x.transpose(0, 1), w, bias))  # rows not one stride apart
    check(rt, linear(rt, x[..., ::2], w[:, :32], bias))  # K strided in x and in W
    wide = randn(rt, (6, 80), dtype, 4)
    check(rt, linear(rt, wide[:, 8:72], w, bias))  # rows 80 apart, 16-byte aligned
    check(rt, linear(rt, wide[:, 1:65], w, bias))  # rows off 16-byte alignment
    task = linear(rt, x[0, 0], w)  # one row, no leading dims
    assert task.out.shape == (96,)
    check(rt, task)


def test_given_out_views_and_out_dtype(rt: Runtime) -> None:
    x, w = randn(rt, (5, 64), torch.float16, 1), randn(rt, (70, 64), torch.float16, 2)
    buffer = torch.full((5, 80), float("nan"), dtype=torch.float16, device=rt.device)
    task = linear(rt, x, w, out=buffer[:, 3:73])  # rows 80 apart
    check(rt, task)
    assert torch.isnan(buffer[:, :3]).all() and torch.isnan(buffer[:, 73:]).all()
    scattered = torch.full((3, 2, 70), float("nan"), device=rt.device).transpose(0, 1)[:, :, :]
    check(rt, linear(rt, x[:3].unsqueeze(0).expand(2, 3, 64), w, out=scattered))  # rows apart
    task = linear(rt, x, w, out_dtype=torch.float32)
    assert task.out.dtype == torch.float32
    check(rt, task)


@pytest.mark.parametrize("m", [1, 40])
def test_split_k_records_cut_anywhere_and_rerun(rt: Runtime, m: int) -> None:
    x = randn(rt, (m, 2048), torch.float16, 5)
    w, bias = randn(rt, (100, 2048), torch.float16, 6), randn(rt, (100,), torch.float16, 7)
    task = linear(rt, x, w, bias)
    plan = LinearPlan.of(*task.inputs[:2], task.inputs[3])
    assert plan.splits > 1 and task.items == plan.items
    task = recut(task, 5)
    check(rt, task)
    task.out.fill_(float("nan"))  # a rerun: the last split of each tile reset its counter
    check(rt, task)
    x.mul_(-1)  # inputs change in place between runs, as a device program's do
    check(rt, task)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 64, 200])
def test_linear_parts_are_the_sums_of_the_k_splits(rt: Runtime, dtype: torch.dtype, m: int) -> None:
    """linear_parts: fp32 [S, M, N], part s the product over split s's k range (the bias in
    part 0), so that the parts sum to the linear; records cut anywhere, and reruns."""
    for seed, (k, n) in enumerate([(768, 130), (3072, 64), (100, 64)]):
        x, w = randn(rt, (m, k), dtype, seed), randn(rt, (n, k), dtype, seed + 100)
        bias = randn(rt, (n,), dtype, seed + 200)
        task = rt.prepare(OpCall("linear_parts", (x, w, bias)))
        plan = LinearPlan.of(*task.inputs[:2], task.inputs[3])
        assert plan.parts and 1 <= plan.splits <= LINEAR_MAX_PARTS
        assert task.out.shape == (plan.splits, m, n) and task.out.dtype == torch.float32
        task = recut(task, 4)
        for _ in range(2):  # a rerun writes the same parts
            check_parts(rt, task, plan)


def check_parts(rt: Runtime, task: Prepared, plan: LinearPlan) -> None:
    """Run linear_parts `task` alone: each part is the product over its split's k range of
    `plan` (the bias in part 0's), and they sum to the linear."""
    task.out.fill_(float("nan"))
    rt.submit([task]).wait(30)
    x, w, bias = (t.double() for t in task.inputs[:3])
    what = f"{plan.m} x {plan.k} x {plan.n} in {plan.splits}"
    for s, (k0, k1) in enumerate(plan.bounds):
        ref = F.linear(x[:, k0:k1], w[:, k0:k1], bias if s == 0 else None)
        err = rel_error(task.out[s], ref)
        assert err < TOLERANCE[torch.float32], f"part {s} of {what}: {err:.2e}"
    err = rel_error(task.out.double().sum(0), F.linear(x, w, bias))
    assert err < TOLERANCE[torch.float32], f"sum of {what}: {err:.2e}"


def linear_reference(op: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What `op` (linear, linear_gelu_tanh or linear_silu_glu) computes, in float64."""
    y = F.linear(x.double(), w.double(), bias.double())
    if op == "linear_silu_glu":
        return F.silu(y[:, 0::2]) * y[:, 1::2]
    return F.gelu(y, approximate="tanh") if op == "linear_gelu_tanh" else y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["linear", "linear_gelu_tanh", "linear_silu_glu", "linear_parts"])
def test_wide_tiles_match_torch(rt: Runtime, dtype: torch.dtype, op: str) -> None:
    """Plans of 128 x 128 tiles (prefill rows), K whole and split as far as it goes, records cut
    anywhere, and a rerun: on a GPU the warpgroup path (fp16 and bf16 with an even N) and the
    CUDA-core path (fp32, and an odd N)."""
    shapes = [(200, 1000, 390), (65, 256, 130), (130, 264, 129)]  # M, K, N off every tile
    for seed, (m, k, n) in enumerate(shapes):
        if n % 2 and op != "linear":
            continue  # a gated op's rows come in pairs; the odd N is for the plain linear
        x, w = randn(rt, (m, k), dtype, seed), randn(rt, (n, k), dtype, seed + 100)
        bias = randn(rt, (n,), dtype, seed + 200)
        plans = LinearPlan.splittings(m, n, k, op == "linear_parts", wide=True)
        for plan in (plans[0], plans[-1]):
            out = torch.empty((plan.splits, m, n), device=rt.device) if plan.parts else None
            wide = recut(rt.prepare(OpCall(op, (x, w, bias), out=out)), 4, plan)
            if plan.parts:
                check_parts(rt, wide, plan)
                continue
            for _ in range(2):  # a rerun: the last split of each tile reset its counter
                wide.out.fill_(float("nan"))
                rt.submit([wide]).wait(30)
                err = rel_error(wide.out, linear_reference(op, x, w, bias))
                assert err < TOLERANCE[dtype], f"{op} {m} x {k} x {n} in {plan.splits}: {err:.2e}"


@pytest.mark.parametrize("splits", [1, 2, 6])
def test_linear_parts_take_the_split_count_of_the_out_given(rt: Runtime, splits: int) -> None:
    """An out of [S, M, N] states linear_parts' count of K splits (a task that runs beside
    others plans its splits for its share of the SMs): its parts are those of S splits."""
    m, k, n = 40, 3072, 130
    x, w = randn(rt, (m, k), torch.float16, 1), randn(rt, (n, k), torch.float16, 2)
    bias = randn(rt, (n,), torch.float16, 3)
    out = torch.empty((splits, m, n), dtype=torch.float32, device=rt.device)
    task = rt.prepare(OpCall("linear_parts", (x, w, bias), out=out))
    plan = LinearPlan.of(*task.inputs[:2], task.inputs[3])
    assert plan.splits == splits and task.out.data_ptr() == out.data_ptr()
    check_parts(rt, task, plan)
    # 3072 is 96 steps of 32: 5 splits would leave the fifth empty, 7 are more than a norm sums
    for count in (5, LINEAR_MAX_PARTS + 1):
        bad = torch.empty((count, m, n), dtype=torch.float32, device=rt.device)
        with pytest.raises(TensorSpecError, match=r"count of K splits.*one of 1, 2, 3, 4, 6;"):
            rt.prepare(OpCall("linear_parts", (x, w, bias), out=bad))


def test_many_tasks_in_one_submission(rt: Runtime) -> None:
    w = randn(rt, (300, 512), torch.bfloat16, 8)
    xs = [randn(rt, (m, 512), torch.bfloat16, 9 + m) for m in (1, 2, 8, 17)]
    tasks = [linear(rt, x, w) for x in xs for _ in range(3)]
    rt.submit(tasks).wait(30)
    for task in tasks:
        ref = F.linear(task.inputs[0].double(), w.double())
        assert rel_error(task.out, ref) < TOLERANCE[torch.bfloat16]


def test_bad_inputs_are_rejected(rt: Runtime) -> None:
    x, w = randn(rt, (4, 64), torch.float16, 1), randn(rt, (32, 64), torch.float16, 2)
    cases = [
        ((x, w[0]), r"input 1 \(weight\) must be \[out_features, in_features\]"),
        ((x, w[:, :60]), r"in_features the last dim of input 0 \(x\) \(4, 64\), got \(32, 60\)"),
        ((x, w, x[0, :31]), r"input 2 \(bias\) must have shape \(32,\)"),
        ((x, w.float()), r"must share one dtype, got torch.float16, torch.float32"),
        ((x[0, 0], w), r"linear input 0 \(x\) must have 1 to 6 dims"),
        ((x,), r"linear takes 2 to 3 tensor input\(s\), got 1"),
        ((x, w.to(torch.int32)), r"linear input 1 has dtype torch.int32"),
    ]
    for inputs, message in cases:
        with pytest.raises(TensorSpecError, match=message):
            rt.prepare(OpCall("linear", inputs))


def test_the_plan_agrees_with_the_kernel() -> None:
    header = (CUDA_DIR / "ops" / "linear.cuh").read_text()
    defines = dict(re.findall(r"#define GPUOS_LINEAR_(\w+) (\d+)", header))
    names = ("BM", "BN", "WIDE", "KSTEP", "STEP_ALIGN", "PART_ROWS")
    assert {k: int(defines[k]) for k in names} == {
        "BM": LINEAR_ROWS,
        "BN": LINEAR_COLS,
        "WIDE": LINEAR_WIDE,
        "KSTEP": LINEAR_KSTEP,
        "STEP_ALIGN": LINEAR_STEP_ALIGN,
        "PART_ROWS": LINEAR_PART_ROWS,
    }


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 2304, 768),
        (1, 768, 3072),
        (1, 50257, 768),
        (64, 2048, 8192),
        (64, 8192, 2048),
        (512, 2048, 2048),
        (3, 70, 1000),
        (5, 5, 0),
        (0, 5, 5),
    ],
)
def test_plans_fill_the_device_without_empty_splits(m: int, n: int, k: int) -> None:
    plan = LinearPlan.choose(m, n, k, DEFAULT_SMS)
    steps = -(-k // LINEAR_KSTEP)
    assert plan.kch % LINEAR_STEP_ALIGN == 0
    assert plan.splits == 1 or -(-steps // plan.kch) == plan.splits  # the last split has steps
    assert plan.items == plan.tiles * plan.splits
    assert (plan.workspace_words == 0) == (plan.splits == 1)
    if plan.splits > 1:
        assert plan.items <= 2 * DEFAULT_SMS and plan.counters % 4 == 0
    words = torch.empty(plan.workspace_words, dtype=torch.int32)
    x, w = torch.empty(m, k), torch.empty(n, k)
    assert LinearPlan.of(x, w, words) == plan  # the splits read back as the device reads them
    parts = LinearPlan.choose(m, n, k, DEFAULT_SMS, parts=True)
    assert parts.splits <= LINEAR_MAX_PARTS and parts.workspace_words == 0
    assert parts.splits == 1 or -(-steps // parts.kch) == parts.splits
    assert parts.items <= 2 * DEFAULT_SMS or parts.splits == 1
    assert LinearPlan.of(x, w, torch.empty(parts.splits, 0, dtype=torch.int32)) == parts


def test_prefill_rows_take_wide_tiles_where_the_device_runs_them() -> None:
    """512 rows of Llama-3.2-1B's up projection: 128 x 128 tiles (half the bytes from L2 per
    product) where the device runs them, never for decode rows or an odd N; its output and down
    projections' parts too. The workspace states the tiles as the device reads them."""
    up = LinearPlan.choose(512, 16384, 2048, DEFAULT_SMS, wide=True)
    assert up.wide and up.tiles == 4 * 128
    assert not LinearPlan.choose(512, 16384, 2048, DEFAULT_SMS).wide
    assert not LinearPlan.choose(64, 16384, 2048, DEFAULT_SMS, wide=True).wide
    assert not LinearPlan.choose(512, 50257, 768, DEFAULT_SMS, wide=True).wide
    for k, parts in [(2048, True), (8192, True), (2048, False)]:
        plan = LinearPlan.choose(512, 2048, k, DEFAULT_SMS, parts, wide=True)
        assert plan.wide and plan.parts == parts
        x, w = torch.empty(512, k), torch.empty(2048, k)
        assert LinearPlan.of(x, w, plan.workspace(torch.device("cpu"))) == plan


def test_a_plan_with_records_past_the_free_blocks_pays_for_the_late_ones() -> None:
    """A projection after 8 records of attention (Llama-3.2-1B's output projection at one row)
    takes fewer K splits, all claimed while attention runs; a long K (its down projection)
    keeps its splits, whose records would each take longer than the late ones are late."""
    short = LinearPlan.choose(1, 2048, 2048, DEFAULT_SMS, parts=True)
    assert short.items > DEFAULT_SMS - 8
    fit = LinearPlan.choose(1, 2048, 2048, DEFAULT_SMS, parts=True, free=DEFAULT_SMS - 8)
    assert fit.splits < short.splits and fit.items <= DEFAULT_SMS - 8
    long = LinearPlan.choose(1, 2048, 8192, DEFAULT_SMS, parts=True)
    assert long.items > DEFAULT_SMS - 8
    assert LinearPlan.choose(1, 2048, 8192, DEFAULT_SMS, parts=True, free=DEFAULT_SMS - 8) == long


@pytest.mark.parametrize(("n", "records"), [(50257, 131), (16384, 128), (2304, 36)])
def test_records_are_neighbouring_items_the_fewest_that_one_wave_allows(
    n: int, records: int
) -> None:
    """786, 256 and 36 n-tiles on 132 multiprocessors: records of 6, 2 and 1 items, no more of
    them than that takes (the blocks left over claim the next stage's records)."""
    with Runtime("cpu") as runtime:
        x, w = torch.randn(1, 64), torch.randn(n, 64)
        task = runtime.prepare(OpCall("linear", (x, w)))
    ranges = family("linear").ranges(task, 16384)
    assert len(ranges) == records and ranges[0][0] == 0 and ranges[-1][1] == task.items
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - b for b, e in ranges]
    assert max(sizes) == -(-task.items // DEFAULT_SMS) and max(sizes) - min(sizes) <= 1
    assert family("linear").ranges(task, None) == [(0, task.items)]
