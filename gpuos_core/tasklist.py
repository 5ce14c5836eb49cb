"""Tasks encoded for submission: ABI records back to back and the operators they use."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .abi import OP_NOP, RAW_TASK, TASK
from .calls import Prepared


class Resolution(Protocol):
    """What resolving needs of the runtime's published state."""

    @property
    def aliases(self) -> Mapping[str, int]: ...  # logical name → physical slot

    @property
    def slot_versions(self) -> np.ndarray: ...  # physical slot → version number


@dataclass(eq=False)
class TaskList:
    """Tasks encoded for submission: their records back to back, and which operator each uses
    (resolved to a slot only at submit, so a TaskList may be submitted more than once)."""

    tasks: tuple[Prepared, ...]
    records: np.ndarray  # TASK records of every task, tiles included
    owners: np.ndarray  # record → task index
    op_names: tuple[str, ...]  # distinct operators
    op_of_task: np.ndarray  # task → index into op_names
    op_of_record: np.ndarray  # record → index into op_names; -1: a record that runs no operator
    pinned: bool = False  # records come from Backend.host_records: copied from directly
    # The published state whose slots `records` hold, and each task's version under it: a
    # resubmission under the same state skips resolving again (microseconds per submit).
    resolved: tuple[Resolution, np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def alone(cls, task: Prepared) -> TaskList:
        """`task` as a TaskList of its own, over a copy of its records (resolving writes them).
        Copied as bytes: a structured-dtype copy costs four times as much."""
        owners = np.zeros(len(task.records), dtype=np.int32)
        records = task.records.view(RAW_TASK).copy().view(TASK)
        return cls((task,), records, owners, (task.op,), owners[:1], owners)

    def resolve(self, state: Resolution, idle: bool = False) -> np.ndarray:
        """Write each record's physical slot under `state`; the version of each task. `idle`:
        no earlier submission of these records can still be copying them."""
        if self.resolved is not None:
            if self.resolved[0] is state:
                return self.resolved[1]
            if self.pinned and not idle:
                # An earlier submission may still be copying from these records (a rollback does
                # not drain), so this one gets its own, staged like any pageable records.
                self.records, self.pinned = self.records.copy(), False
        # Join records (op -1) take the last entry, OP_NOP: they run no operator.
        slots = np.array([*(state.aliases[name] for name in self.op_names), OP_NOP], dtype=np.int32)
        self.records["op_slot"] = slots.take(self.op_of_record)
        versions = state.slot_versions.take(slots.take(self.op_of_task))
        self.resolved = (state, versions)
        return versions


def encode_batch(tasks: Sequence[Prepared], allocate: Callable[[int], np.ndarray]) -> TaskList:
    """Concatenate prepared tasks' records into one TaskList, in the records `allocate(n)` gives
    (Backend.host_records: page-locked on CUDA). Bytewise: a structured-dtype copy costs tens of
    microseconds per record."""
    names: dict[str, int] = {}
    op_of_task = np.array([names.setdefault(t.op, len(names)) for t in tasks], dtype=np.int32)
    counts = [len(t.records) for t in tasks]
    records = allocate(sum(counts))
    np.concatenate([t.records.view(RAW_TASK) for t in tasks], out=records.view(RAW_TASK))
    owners = np.repeat(np.arange(len(tasks), dtype=np.int32), counts)
    return TaskList(
        tuple(tasks), records, owners, tuple(names), op_of_task, op_of_task[owners], pinned=True
    )
