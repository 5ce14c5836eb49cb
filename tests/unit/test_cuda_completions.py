"""How the CUDA backend reads a batch's completions from the words the worker writes (one per
ring slot: ticket + 1 when done, -(ticket + 1) when failed): no batch completes before each of
its records, failures are found, and ring slots free as records finish. Host logic only: it runs
without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from gpuos_core.abi import TASK
from gpuos_core.backends.cuda import _Pending
from gpuos_core.batch import Batch

CAPACITY = 16


def pending(first: int, count: int) -> _Pending:
    batch = Batch([], np.zeros(count, dtype=TASK), np.zeros(count, dtype=np.int32), [])
    return _Pending(batch, first, count, CAPACITY - 1, published=count)


def ring(first: int) -> np.ndarray:
    """Completion words as an earlier lap of the ring left them: each slot done for the ticket
    one capacity before the one it holds now, from `first` on."""
    done = np.zeros(CAPACITY, dtype=np.int64)
    tickets = np.arange(first, first + CAPACITY) - CAPACITY
    done[tickets % CAPACITY] = tickets + 1
    return done


@pytest.mark.parametrize("thorough", [False, True])
def test_a_batch_completes_only_once_every_record_is_done(thorough: bool) -> None:
    first, count = 13, 7  # tickets 13..19 wrap from slot 13 to slot 3
    p, done = pending(first, count), ring(first)
    order = [19, 14, 13, 17, 15, 18, 16]  # out of order, the last record early
    for k, t in enumerate(order):
        assert not p.advance(done, thorough), f"complete with {order[k:]} not done"
        done[t % CAPACITY] = t + 1
    assert p.advance(done, thorough) and p.failures == []
    assert p.oldest == first + count


def test_a_failed_record_is_found_when_the_last_one_succeeded() -> None:
    first, count = 40, 9
    p, done = pending(first, count), ring(first)
    tickets = np.arange(first, first + count)
    done[tickets % CAPACITY] = tickets + 1
    done[44 % CAPACITY] = -(44 + 1)
    assert p.advance(done, False)
    assert p.failures == [44 - first]


def test_a_running_batch_frees_its_finished_slots_when_asked() -> None:
    first, count = 5, 10
    p, done = pending(first, count), ring(first)
    for t in (5, 6, 7, 9):
        done[t % CAPACITY] = t + 1
    assert not p.advance(done, True)
    assert p.oldest == 8  # slots of 5..7 free; 9 waits behind 8
    done[8 % CAPACITY] = 9
    assert not p.advance(done, True)
    assert p.oldest == 10


def test_a_lone_record_completes_or_fails_on_its_word() -> None:
    p, done = pending(3, 1), ring(3)
    assert not p.advance(done, False)
    done[3] = -4
    assert p.advance(done, False) and p.failures == [0]
