"""Swap safety without Ray: a candidate version runs beside the current one before it may be
activated (NaN where the current is finite is refused unless allowed), and after a swap the watch
rolls back a version whose answers turn non-finite, through the real registry, with the reason in
its log."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gpuos_core import OpCall, Runtime, RuntimeConfig
from gpuos_core.canary import compare_with_current
from gpuos_core.catalogue import CATALOGUE, new_version
from gpuos_core.errors import NonFiniteOutputError
from serving.registry import ChangeNote, RegistryStore, ReplicaRegistry
from serving.watch import SwapWatch

GELU = CATALOGUE["gelu_tanh"]


def test_a_version_that_is_nan_where_the_current_is_finite_is_refused() -> None:
    with pytest.raises(NonFiniteOutputError, match="allow_nonfinite") as refused:
        compare_with_current(GELU, new_version(GELU, "sqrt(A) * 0 + A"), seed=1)
    assert refused.value.cases and all(c["nonfinite"] > 0 for c in refused.value.cases)
    assert {c["dtype"] for c in refused.value.cases} == {"float32", "float16", "bfloat16"}
    allowed = compare_with_current(
        GELU, new_version(GELU, "sqrt(A) * 0 + A"), seed=1, allow_nonfinite=True
    )
    assert allowed.nonfinite > 0


def test_edge_values_catch_what_random_inputs_miss() -> None:
    sigmoid = CATALOGUE["sigmoid"]  # exp(100) / (1 + exp(100)) = inf / inf = NaN
    with pytest.raises(NonFiniteOutputError):
        compare_with_current(sigmoid, new_version(sigmoid, "exp(A) / (1 + exp(A))"), seed=2)


def test_an_accepted_version_reports_its_largest_deviation() -> None:
    same = compare_with_current(GELU, new_version(GELU, GELU.expression.text), seed=3)
    assert same.max_abs_deviation == 0.0 and same.nonfinite == 0
    close = compare_with_current(GELU, new_version(GELU, "A * sigmoid(1.702 * A)"), seed=3)
    assert 0 < close.max_abs_deviation < 0.1 and len(close.cases) == 15


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[ReplicaRegistry]:
    with Runtime("cpu") as runtime:
        yield ReplicaRegistry(runtime, RegistryStore(tmp_path))


def change_here(registry: ReplicaRegistry) -> Callable:
    """The watch's change function on one replica: the registry's change, off the loop."""

    async def change(note: ChangeNote, apply: Callable[[Runtime], object]) -> object:
        return await asyncio.to_thread(registry.change, apply, note)

    return change


def test_the_watch_rolls_back_a_swap_whose_answers_turn_nan(registry: ReplicaRegistry) -> None:
    rt = registry.runtime
    registry.change(lambda r: r.register("wt", "A * 2"), ChangeNote(op="wt", action="register"))
    # NaN at 50.5 only, 25 sigma past the canary's random inputs: passes the comparison
    nan_at_50 = "A * 2 + 0 * log(abs(A - 50.5))"
    registry.change(lambda r: r.swap("wt", nan_at_50), ChangeNote(op="wt", action="swap"))
    rolled: list[str] = []
    watch = SwapWatch(
        registry, window_s=60, change=change_here(registry), on_rollback=rolled.append
    )
    assert watch.watched("wt", 2) and not watch.watched("wt", 1)

    async def requests() -> None:
        fine = OpCall("wt", (torch.tensor([1.0, 2.0]),))
        watch.check_result(fine, 2, rt.run("wt", *fine.inputs))  # finite: nothing happens
        bad = OpCall("wt", (torch.tensor([1.0, 50.5]),))
        out = rt.run("wt", *bad.inputs)
        assert math.isnan(out[1])
        watch.check_result(bad, 2, out)
        watch.check_result(bad, 2, out)  # a second failure joins the rollback under way
        async with asyncio.timeout(30):
            while not rolled:
                await asyncio.sleep(0.01)

    asyncio.run(requests())
    assert rolled == ["wt"] and rt.table.current("wt").version == 1
    last = registry.applied.log[-1]
    assert (last.action, last.by, last.version) == ("rollback", "watch", 1)
    assert "v2 returned 1 NaN" in (last.reason or "")
    assert registry.store.load().log[-1] == last  # every replica reads it from the registry


def test_the_watch_ends_with_its_window(registry: ReplicaRegistry) -> None:
    registry.change(lambda r: r.register("wt", "A"), ChangeNote(op="wt", action="register"))
    registry.change(lambda r: r.swap("wt", "A + 1"), ChangeNote(op="wt", action="swap"))
    watch = SwapWatch(
        registry, window_s=0.05, change=change_here(registry), on_rollback=lambda op: None
    )
    assert watch.watched("wt", 2)
    time.sleep(0.1)
    assert not watch.watched("wt", 2) and not watch.failed("wt", 2, "too late")


def test_the_runtime_refuses_a_nan_swap_without_the_serving_layer(tmp_path: Path) -> None:
    """Runtime.swap itself compares (not only the admin route): a refused version changes
    nothing, an allowed one is reported in last_change."""
    with Runtime(config=RuntimeConfig(backend="cpu", cache_dir=tmp_path)) as rt:
        x = torch.tensor([-1.0, 0.0, 2.0])
        before = rt.run("gelu_tanh", x)
        with pytest.raises(NonFiniteOutputError, match="allow_nonfinite"):
            rt.swap("gelu_tanh", "sqrt(A) * 0 + A")
        assert rt.table.current("gelu_tanh").version == 1
        torch.testing.assert_close(rt.run("gelu_tanh", x), before)
        made = rt.swap("gelu_tanh", "sqrt(A) * 0 + A", allow_nonfinite=True)
        assert made.version == 2 and rt.last_change is not None
        assert rt.last_change.comparison is not None and rt.last_change.comparison.nonfinite > 0
        assert torch.isnan(rt.run("gelu_tanh", x)[0])
