"""Traced regions: recorded once per guard signature, replayed as one device program with no
Python per op, always eager's results. A call whose guards differ records again; a region that
needs torch or the host in between runs the scheduler's path every time and says why. (Every
scheduler snippet also runs traced: tests/unit/test_scheduler.py, `traced`.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpuos_core import Runtime, Scheduler, SchedulerConfig, TraceStats, trace


@pytest.fixture(scope="module")
def rt(backend: str) -> Iterator[Runtime]:
    with Runtime(backend) as runtime:
        yield runtime


@pytest.fixture
def sched(rt: Runtime) -> Scheduler:
    return Scheduler(rt, SchedulerConfig(auto_flush_ms=None))


def rand(rt: Runtime, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=rt.device).to(dtype)


def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(torch.relu((x + y) * y)) / (y.abs() + 1)


def rows(xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [chain(x, y) for x, y in zip(xs, ys)]


def check(fn: Callable[..., Any], got: Any, *args: Any, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, fn(*args), atol=tol, rtol=tol * 10)


def test_replays_queue_no_op_and_return_new_results(rt: Runtime, sched: Scheduler) -> None:
    region = sched.trace(rows)
    x, y = rand(rt, 16, 300), rand(rt, 16, 300)
    first = region(x.unbind(0), y.unbind(0))
    held = [t.clone() for t in first]
    queued = sched.stats.intercepted
    for _ in range(3):
        x2, y2 = rand(rt, 16, 300), rand(rt, 16, 300)
        check(rows, region(x2.unbind(0), y2.unbind(0)), x2.unbind(0), y2.unbind(0))
    assert sched.stats.intercepted == queued  # replays queue nothing: no Python per op
    assert region.stats == TraceStats(calls=4, replayed=3, recorded=1, misses=1)
    check(rows, first, x.unbind(0), y.unbind(0))  # the first call's results were not overwritten
    torch.testing.assert_close(first, held, atol=0, rtol=0)


def test_a_replay_writes_fresh_tensors_every_call(rt: Runtime, sched: Scheduler) -> None:
    region = sched.trace(lambda x: (F.silu(x) * 2, x))
    x = rand(rt, 64)
    a, same = region(x)
    b, _ = region(x)
    assert same is x and a.data_ptr() != b.data_ptr()
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def change_shape(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn_like(x[:, :-1]), y[:, :-1]


def change_dtype(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.half(), y.half()


def change_strides(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.t().contiguous().t(), y


def same_tensor_twice(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return y, y


def overlapping_views(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.randn(x.shape[0] + 1, x.shape[1], device=x.device)
    return both[1:], both[:-1]


@pytest.mark.parametrize(
    "change", [change_shape, change_dtype, change_strides, same_tensor_twice, overlapping_views]
)
def test_guard_misses_record_a_new_trace_and_both_replay(
    rt: Runtime,
    sched: Scheduler,
    change: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(a) * b + a * 0.5

    region = sched.trace(fn)
    tol = 2e-2 if change is change_dtype else 1e-5
    for changed in (False, True, False, True):
        args = (rand(rt, 8, 40), rand(rt, 8, 40))
        args = change(*args) if changed else args
        check(fn, region(*args), *args, tol=tol)
    assert (region.stats.misses, region.stats.recorded, region.stats.replayed) == (2, 2, 2)


def test_a_python_argument_is_guarded_by_value(rt: Runtime, sched: Scheduler) -> None:
    region = sched.trace(lambda x, scale, act: getattr(F, act)(x * scale))
    x = rand(rt, 100)
    calls = [
        (2.0, "gelu"),
        (2.0, "gelu"),
        (3.0, "gelu"),
        (-0.0, "gelu"),
        (0.0, "gelu"),
        (3.0, "silu"),
        (3.0, "gelu"),
    ]
    for scale, act in calls:
        torch.testing.assert_close(region(x, scale, act), getattr(F, act)(x * scale))
    assert (region.stats.misses, region.stats.replayed) == (5, 2)


def test_keyword_and_nested_arguments_replay(rt: Runtime, sched: Scheduler) -> None:
    def fn(
        pair: tuple[torch.Tensor, torch.Tensor], *, extra: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        a, b = pair
        return {"sum": a + b, "scaled": [extra["w"] * a, None, 3]}

    region = sched.trace(fn)
    for _ in range(3):
        a, b, w = rand(rt, 5, 7), rand(rt, 5, 7), rand(rt, 7)
        got = region((a, b), extra={"w": w})
        torch.testing.assert_close(got, fn((a, b), extra={"w": w}))
        assert got["scaled"][1:] == [None, 3]
    assert region.stats.replayed == 2


def test_views_of_arguments_and_constants_made_in_the_region_replay(
    rt: Runtime, sched: Scheduler
) -> None:
    def fn(x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = torch.tensor(0.5, device=x.device)  # a constant: the same value every call
        return torch.relu(x.t()[1:3]) + x[:, :2].t().sigmoid(), h * half + x[0, 0]

    region = sched.trace(fn)
    for _ in range(3):
        x, h = rand(rt, 4, 4), rand(rt, 3, 4, dtype=torch.float16)
        check(fn, region(x, h), x, h, tol=2e-3)
    assert region.stats.replayed == 2


def test_nested_traced_functions_of_one_scheduler_replay_as_one(
    rt: Runtime, sched: Scheduler
) -> None:
    inner = sched.trace(lambda x: torch.tanh(x) + 1)
    outer = sched.trace(lambda x: inner(x) * inner(x * 2))
    for _ in range(3):
        x = rand(rt, 33)
        torch.testing.assert_close(outer(x), (torch.tanh(x) + 1) * (torch.tanh(x * 2) + 1))
    assert outer.stats.replayed == 2
    assert inner.stats.not_replayable == {
        "called while a region records (its ops run in that region)": 2
    }


def test_a_function_traced_by_another_scheduler_sees_written_arguments(
    rt: Runtime, sched: Scheduler
) -> None:
    inner = trace(lambda x: torch.tanh(x) * 2, rt)
    outer = sched.trace(lambda x: inner(torch.sigmoid(x)) + 1)  # inner reads a pending result
    for _ in range(3):
        x = rand(rt, 40)
        torch.testing.assert_close(outer(x), torch.tanh(torch.sigmoid(x)) * 2 + 1)
    assert outer.stats.replayed == 0 and inner.stats.replayed == 1  # inner, outside recordings
    assert outer.stats.not_replayable == {
        "a flush inside the region: it calls a function traced by another scheduler": 3
    }


def test_a_traced_call_inside_its_scheduler_sees_pending_arguments(
    rt: Runtime, sched: Scheduler
) -> None:
    region = sched.trace(lambda x: F.softplus(x) - x)
    x = rand(rt, 6, 20)
    with sched:
        for _ in range(3):
            y = torch.sigmoid(x) * 3  # pending: written before the region reads it
            z = region(y)
            w = z + 1  # queued again, on a result the region wrote
    y = torch.sigmoid(x) * 3
    torch.testing.assert_close(w, F.softplus(y) - y + 1)
    assert region.stats.replayed == 2
    assert not sched.stats.fallbacks  # a replay's own allocations are not the user's ops


KEPT: list[torch.Tensor] = []


def keeps_a_result(x: torch.Tensor) -> torch.Tensor:
    KEPT.append(torch.sigmoid(x))  # a result the caller can read other than through the return
    return KEPT[-1] * 2


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda x: torch.sigmoid(x) * torch.sigmoid(x).sum().item(), "aten._local_scalar_dense"),
        (lambda x: torch.relu(x) if (x * 2).sum() > 0 else -x, "aten.gt.Scalar"),
        (lambda x: torch.tensor(torch.exp(x).tolist(), device=x.device) + 1, "tolist"),
        (lambda x: torch.relu(x @ x.t()), "aten.mm.default runs in torch"),
        (lambda x: torch.erf(x) + 1, "aten.erf.default runs in torch"),
        (lambda x: (x * 2)[1:3], "views a result inside the region"),
        (lambda x: torch.relu(x).add_(1), "aten.add_.Tensor"),
        (keeps_a_result, "a result escapes other than through the return value"),
    ],
    ids=["item", "bool", "tolist", "matmul", "unlowered", "view_of_result", "in_place", "escape"],
)
def test_a_region_that_cannot_replay_runs_the_scheduler_path_and_says_why(
    rt: Runtime, sched: Scheduler, fn: Callable[[torch.Tensor], torch.Tensor], why: str
) -> None:
    region = sched.trace(fn)
    for _ in range(3):
        x = rand(rt, 6, 6)
        check(fn, region(x), x)
    assert region.stats.replayed == 0 and region.stats.misses == 1
    ((reason, calls),) = region.stats.not_replayable.items()
    assert why in reason and calls == 3


def test_arguments_guards_cannot_compare_run_the_scheduler_path(
    rt: Runtime, sched: Scheduler
) -> None:
    region = sched.trace(lambda x, names: torch.relu(x) * len(names))
    x = rand(rt, 10)
    for _ in range(2):
        torch.testing.assert_close(region(x, {"a", "b"}), torch.relu(x) * 2)
    assert region.stats.misses == 0
    assert region.stats.not_replayable == {
        "an argument of type set cannot be guarded (tensors, "
        "numbers, strings, None, dtypes and devices can, in "
        "tuples, lists and dicts)": 2
    }


def test_the_cache_keeps_the_latest_traces(rt: Runtime) -> None:
    region = trace(lambda x: torch.exp(-x * x), rt, cache_size=2)
    for n in (10, 11, 12, 12, 10, 11):
        x = rand(rt, n)
        torch.testing.assert_close(region(x), torch.exp(-x * x))
    assert (region.stats.misses, region.stats.replayed, region.stats.evicted) == (5, 1, 3)
