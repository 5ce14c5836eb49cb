"""feed_tokens and tick, the operators that chain an LLM engine's decode steps on the device
(cuda/ops/steps.cuh): a fed row takes the token the previous step sampled, once that step
ticked; a step queued behind another takes that step's tokens; a step whose predecessor never
ticks does not hang; the validation messages."""

from __future__ import annotations

import pytest
import torch
from test_index_ops import ints, randn, run

from gpuos_core import OpCall, Runtime
from gpuos_core.errors import TaskFailedError, TensorSpecError
from serving.llm.device_step import fed


@pytest.fixture(scope="module")
def rt(tiled_rt: Runtime) -> Runtime:
    return tiled_rt


def test_fed_rows_take_the_sampled_token_of_their_logits_row(rt: Runtime) -> None:
    tokens = ints(rt, [5, -1, fed(0), fed(2), fed(3), 0])
    sampled, clock, expect = ints(rt, [11, 12, 13]), ints(rt, [3]), ints(rt, [3])
    out = run(rt, OpCall("feed_tokens", (tokens, sampled, clock, expect)))
    assert out.dtype == torch.int32
    assert out.cpu().tolist() == [5, -1, 11, 13, -1, 0]  # logits row 3 is not there: idle


@pytest.mark.parametrize("start", [7, 2**31 - 1])
def test_tick_advances_the_clock_wrapping_as_int32(rt: Runtime, start: int) -> None:
    clock = ints(rt, [start])
    run(rt, OpCall("tick", (ints(rt, [0]),), out=clock))
    assert clock.item() == (start + 1 + 2**31) % 2**32 - 2**31


def test_a_step_queued_behind_another_takes_its_tokens(rt: Runtime) -> None:
    """Step A samples (greedy) and ticks; step B, submitted before A finished, feeds its rows
    from what A sampled. Five rounds: the clock's expected value moves on each time."""
    vocab, rows = 5000, 4
    sampled, clock = ints(rt, [-1] * rows), ints(rt, [0])
    params, rng = torch.zeros(rows, 3, device=rt.device), ints(rt, [[0, 0, 0]] * rows)
    logits = torch.zeros(rows, vocab, device=rt.device)
    tokens, expect = ints(rt, [fed(r) for r in reversed(range(rows))]), ints(rt, [0])
    a = rt.program()
    a.add(
        OpCall(
            "tick", (a.add(OpCall("sample_tokens", (logits, params, rng), out=sampled)),), out=clock
        )
    )
    step_a = a.build()
    b = rt.program()
    taken = b.add(OpCall("feed_tokens", (tokens, sampled, clock, expect)))
    step_b = b.build()
    for round in range(5):
        logits.copy_(randn(rt, (rows, vocab), torch.float32, round))
        expect.fill_(round + 1)  # A's tick of this round
        first, second = rt.submit(step_a), rt.submit(step_b)
        second.wait(30).check()
        first.wait(30).check()
        want = logits.argmax(-1).int().flip(0)
        assert torch.equal(taken.cpu(), want.cpu()), round


def test_a_step_whose_predecessor_never_ticks_does_not_hang(rt: Runtime) -> None:
    """On the CPU the records run in order, so the feed fails at once; on a GPU it waits its
    bounded time (cuda/ops/steps.cuh) and then leaves the fed rows idle."""
    tokens, sampled = ints(rt, [fed(0), 3]), ints(rt, [9])
    call = OpCall("feed_tokens", (tokens, sampled, ints(rt, [4]), ints(rt, [5])))
    if rt.device.type == "cpu":
        with pytest.raises(TaskFailedError, match="should have taken it to 5"):
            run(rt, call)
    else:
        assert run(rt, call).cpu().tolist() == [-1, 3]


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda x: OpCall("feed_tokens", (x([1]), x([1]), x([0, 0]), x([0]))), "clock must"),
        (lambda x: OpCall("feed_tokens", (x([[1]]), x([1]), x([0]), x([0]))), "1-D"),
        (lambda x: OpCall("tick", (x([1]),)), "clock given as out="),
    ],
)
def test_bad_calls_say_what_to_fix(rt: Runtime, call, words: str) -> None:
    with pytest.raises(TensorSpecError, match=words):
        rt.prepare(call(lambda v: ints(rt, v)))
