"""The coalescer against a real runtime: concurrent requests share submissions, each gets its own
result or its own error, limits and deadlines hold, and knobs change live."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
import torch

from gpuos_core import OpCall, Runtime, RuntimeClosedError, TaskFailedError, TensorSpecError
from serving.coalescer import Coalescer, Completed
from serving.config import CoalescerConfig
from serving.errors import DeadlineExceededError, QueueFullError

T = TypeVar("T")
LONG_WINDOW_US = 1_000_000  # a window no test waits for: flushes must come from something else


@pytest.fixture
def rt(backend: str) -> Iterator[Runtime]:
    with Runtime(backend) as runtime:
        yield runtime


def run(main: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(main())


def softmax_call(rt: Runtime) -> OpCall:
    return OpCall("softmax", (torch.randn(3, 17, device=rt.device),))


def check_softmax(call: OpCall, done: Completed) -> None:
    torch.testing.assert_close(done.out, torch.softmax(call.inputs[0], -1))
    assert done.version == 1


def test_concurrent_requests_share_submissions_and_get_their_own_results(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(max_batch=64, window_us=5000))
    calls = [softmax_call(rt) for _ in range(40)]

    async def main() -> list[Completed]:
        return await asyncio.gather(*(coalescer.submit(c) for c in calls))

    for call, done in zip(calls, run(main)):
        check_softmax(call, done)
    assert coalescer.stats.tasks == 40 and coalescer.stats.batches < 40
    assert coalescer.stats.mean_batch_size > 1 and coalescer.queue_depth == 0


def test_a_full_batch_flushes_without_waiting_for_the_window(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(max_batch=4, window_us=LONG_WINDOW_US))
    calls = [softmax_call(rt) for _ in range(8)]

    async def main() -> float:
        started = time.perf_counter()
        for call, done in zip(calls, await asyncio.gather(*(coalescer.submit(c) for c in calls))):
            check_softmax(call, done)
        return time.perf_counter() - started

    assert run(main) < 0.5  # far below the 1 s window
    assert coalescer.stats.sizes == {4: 2}


def test_the_window_flushes_a_partial_batch(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(max_batch=64, window_us=30_000))
    calls = [softmax_call(rt) for _ in range(3)]

    async def main() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(coalescer.submit(c) for c in calls))
        return time.perf_counter() - started

    assert run(main) >= 0.03
    assert coalescer.stats.sizes == {3: 1}


def test_a_bad_call_fails_alone_and_is_never_queued(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(window_us=2000))
    good = [
        OpCall("add", (torch.randn(5, device=rt.device), torch.randn(5, device=rt.device)))
        for _ in range(3)
    ]
    bad = OpCall("add", (torch.randn(5, device=rt.device), torch.randn(4, device=rt.device)))

    async def main() -> list[Completed | BaseException]:
        return await asyncio.gather(
            *(coalescer.submit(c) for c in [good[0], bad, *good[1:]]), return_exceptions=True
        )

    results = run(main)
    assert isinstance(results[1], TensorSpecError) and "broadcast" in str(results[1])
    for call, done in zip(good, [results[0], *results[2:]]):
        assert isinstance(done, Completed)
        torch.testing.assert_close(done.out, call.inputs[0] + call.inputs[1])
    assert coalescer.stats.tasks == 3


def test_a_task_failing_on_the_device_fails_only_its_own_request() -> None:
    with Runtime("cpu") as rt:  # the fault is injected into a record the CPU backend executes
        coalescer = Coalescer(rt, CoalescerConfig(window_us=5000))
        calls = [OpCall("exp", (torch.randn(6),)) for _ in range(4)]
        tasks = [rt.prepare(c) for c in calls]
        tasks[2].records["num_inputs"] = 0  # the kernel finds no input: this task fails

        async def main() -> list[Completed | BaseException]:
            return await asyncio.gather(
                *(coalescer.submit_prepared(t) for t in tasks), return_exceptions=True
            )

        results = run(main)
    assert coalescer.stats.sizes == {4: 1}  # they did share a submission
    assert isinstance(results[2], TaskFailedError)
    for i in (0, 1, 3):
        torch.testing.assert_close(results[i].out, torch.exp(calls[i].inputs[0]))


def test_a_full_queue_refuses_calls_and_still_answers_the_queued_ones(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(max_queue=2, window_us=20_000))
    calls = [softmax_call(rt) for _ in range(3)]

    async def main() -> list[Completed | BaseException]:
        return await asyncio.gather(*(coalescer.submit(c) for c in calls), return_exceptions=True)

    results = run(main)
    assert isinstance(results[2], QueueFullError) and "max_queue 2" in str(results[2])
    check_softmax(calls[0], results[0])
    check_softmax(calls[1], results[1])
    assert coalescer.stats.rejected == 1


def test_a_request_past_its_deadline_fails_and_is_not_submitted(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(deadline_ms=50, window_us=LONG_WINDOW_US))

    async def main() -> float:
        started = time.perf_counter()
        with pytest.raises(DeadlineExceededError, match="0.05 s"):
            await coalescer.submit(softmax_call(rt))
        coalescer.flush()
        return time.perf_counter() - started

    assert run(main) < 0.5
    assert coalescer.stats.expired == 1 and coalescer.stats.batches == 0


def test_disabled_coalescing_submits_each_request_alone(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(enabled=False, window_us=LONG_WINDOW_US))
    calls = [softmax_call(rt) for _ in range(10)]

    async def main() -> list[Completed]:
        return await asyncio.gather(*(coalescer.submit(c) for c in calls))

    for call, done in zip(calls, run(main)):
        check_softmax(call, done)
    assert coalescer.stats.sizes == {1: 10}


def test_reconfigure_applies_to_requests_already_waiting(rt: Runtime) -> None:
    coalescer = Coalescer(rt, CoalescerConfig(max_batch=100, window_us=LONG_WINDOW_US))
    calls = [softmax_call(rt) for _ in range(3)]

    async def main() -> float:
        started = time.perf_counter()
        pending = [asyncio.create_task(coalescer.submit(c)) for c in calls]
        await asyncio.sleep(0.01)
        assert coalescer.queue_depth == 3
        coalescer.reconfigure(CoalescerConfig(max_batch=2, window_us=LONG_WINDOW_US))
        for call, done in zip(calls, await asyncio.gather(*pending)):
            check_softmax(call, done)
        return time.perf_counter() - started

    assert run(main) < 0.5
    assert coalescer.stats.sizes == {2: 1, 1: 1}


def test_every_result_comes_from_the_version_it_reports_across_swaps(rt: Runtime) -> None:
    rt.register("tag", "A + 1")
    adds = {1: 1.0}  # version → what it adds
    coalescer = Coalescer(rt, CoalescerConfig(max_batch=8, window_us=500))

    async def traffic(stop: asyncio.Event) -> list[tuple[torch.Tensor, Completed]]:
        seen = []
        while not stop.is_set():
            x = torch.randn(32, device=rt.device)
            seen.append((x, await coalescer.submit(OpCall("tag", (x,)))))
        return seen

    async def main() -> list[tuple[torch.Tensor, Completed]]:
        stop = asyncio.Event()
        users = [asyncio.create_task(traffic(stop)) for _ in range(6)]
        await asyncio.sleep(0.02)
        for k in (2, 3):
            adds[len(rt.history("tag")) + 1] = float(k)  # known before a task can use it
            await asyncio.to_thread(rt.swap, "tag", f"A + {k}")
            await asyncio.sleep(0.02)
        stop.set()
        return [pair for seen in await asyncio.gather(*users) for pair in seen]

    answers = run(main)
    assert {done.version for _, done in answers} == {1, 2, 3}
    for x, done in answers:
        torch.testing.assert_close(done.out, x + adds[done.version])


def test_a_refused_submission_fails_every_request_it_held() -> None:
    rt = Runtime("cpu")
    coalescer = Coalescer(rt, CoalescerConfig(window_us=5000))
    calls = [softmax_call(rt) for _ in range(3)]

    async def main() -> list[Completed | BaseException]:
        pending = [asyncio.create_task(coalescer.submit(c)) for c in calls]
        await asyncio.sleep(0)  # queued, window not over
        rt.close()
        return await asyncio.gather(*pending, return_exceptions=True)

    assert all(isinstance(r, RuntimeClosedError) for r in run(main))


@pytest.mark.parametrize(
    "knobs",
    [{"max_batch": 0}, {"window_us": -1}, {"max_queue": 0}, {"deadline_ms": 0}, {"max_batc": 8}],
)
def test_bad_knobs_are_refused(knobs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        CoalescerConfig.model_validate(knobs)
