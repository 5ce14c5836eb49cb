"""The operator registry: the one source of truth for operator versions, persisted to a state dir.

The state is a snapshot, not a log: per operator that differs from the built-in catalogue, every
version ever made (its expression) and the stack of activations (a swap pushes, a rollback pops).
A replica reaches any such state from the catalogue with the runtime's own register/swap/rollback,
replayed so that version numbers come out the same on every replica (`apply_state`).

A change is made on one replica under a file lock: catch up with the file, apply the change to the
local runtime (which compiles, and canary-checks once the runtime does, so a bad change fails here
with the old version still serving), write the new snapshot (tmp + rename), then the caller pushes
it to every replica. Replicas on other nodes need the state dir on shared storage.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from gpuos_core import GpuosError, Runtime
from gpuos_core.catalogue import CATALOGUE
from gpuos_core.optable import OpTable, OpVersion

from .errors import RegistryDivergedError, RegistryError

STATE_FILE = "registry.json"
LOG_LIMIT = 1000  # change records kept in the state file (the oldest are dropped)
Action = Literal["register", "swap", "rollback"]
T = TypeVar("T")


class VersionRecord(BaseModel):
    """One version of an operator as the registry stores it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int  # 1, 2, ... per operator
    source: str  # its expression, or "catalogue" for a built-in version 1
    arity: int  # tensor inputs
    cuda: str | None = None  # raw CUDA functor body (then `source` is its reference)


class OperatorRecord(BaseModel):
    """Every version of one operator and its activation stack (top = current)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    versions: tuple[VersionRecord, ...]
    active: tuple[int, ...]


class ChangeNote(BaseModel):
    """Who asks for a change of which operator, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    action: Action
    by: Literal["admin", "watch"] = "admin"  # watch: the replica rolled a failing swap back
    reason: str | None = None


class ChangeRecord(ChangeNote):
    """A change as the registry's log keeps it."""

    seq: int  # the registry state it made
    version: int  # the operator's active version after it
    at: float  # Unix time


class RegistryState(BaseModel):
    """The registry file: a sequence number (one per change), the changed operators and the log of
    changes (newest last)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1] = 1
    seq: int = 0
    ops: dict[str, OperatorRecord] = {}
    log: tuple[ChangeRecord, ...] = ()


def version_record(v: OpVersion) -> VersionRecord:
    """How the registry stores `v`: enough to make the same version again."""
    return VersionRecord(
        version=v.version, source=v.spec.source, arity=v.spec.arity, cuda=v.spec.cuda_body
    )


def op_record(table: OpTable, name: str) -> OperatorRecord:
    """The registry's record of `name` as `table` has it."""
    versions = tuple(version_record(v) for v in table.history[name])
    return OperatorRecord(versions=versions, active=tuple(v.version for v in table.active[name]))


def snapshot(table: OpTable, seq: int, log: tuple[ChangeRecord, ...] = ()) -> RegistryState:
    """The state `table` is in, numbered `seq`: every operator not as the catalogue ships it, and
    the last LOG_LIMIT records of `log`."""
    ops = {n: op_record(table, n) for n in table.names() if _changed(table, n)}
    return RegistryState(seq=seq, ops=ops, log=log[-LOG_LIMIT:])


def apply_state(runtime: Runtime, state: RegistryState) -> None:
    """Bring `runtime`'s operators to `state` with register/swap/rollback. Raises
    RegistryDivergedError when the runtime holds versions that `state` lacks or contradicts."""
    table = runtime.table
    extra = [n for n in table.names() if n not in state.ops and _changed(table, n)]
    if extra:
        raise RegistryDivergedError(f"the runtime has changes of {extra} that the registry lacks")
    for name, record in state.ops.items():
        try:
            _apply_op(runtime, name, record)
        except GpuosError as exc:
            raise RegistryDivergedError(f"cannot apply the registry's {name}: {exc}") from exc


def _changed(table: OpTable, name: str) -> bool:
    return name not in CATALOGUE or len(table.history[name]) > 1


def _apply_op(runtime: Runtime, name: str, record: OperatorRecord) -> None:
    """Create the versions the runtime lacks in order, popping those `record` does not keep
    active as soon as they are not needed, so the stack ends equal to `record.active`."""
    if name in runtime.table.active and op_record(runtime.table, name) == record:
        return
    if name not in runtime.table.active:
        first = record.versions[0]
        # Stored versions passed their canary on the replica that made them: replaying them
        # (one child process each) would make a replica's start as slow as its history is long.
        runtime.register(name, first.source, first.arity, cuda=first.cuda, canary=False)
    have = len(runtime.table.history[name])
    _check_prefix(name, op_record(runtime.table, name), record)
    keep = set(record.active)
    _pop_inactive(runtime, name, keep)
    for wanted in record.versions[have:]:
        made = runtime.swap(name, wanted.source, cuda=wanted.cuda, canary=False)
        if made.version != wanted.version:
            raise RegistryDivergedError(
                f"{name}: made v{made.version}, registry says v{wanted.version}"
            )
        _pop_inactive(runtime, name, keep)
    if op_record(runtime.table, name) != record:
        raise RegistryDivergedError(f"{name}: cannot reach active versions {list(record.active)}")


def _check_prefix(name: str, have: OperatorRecord, want: OperatorRecord) -> None:
    if have.versions != want.versions[: len(have.versions)]:
        raise RegistryDivergedError(f"{name}: the runtime's versions differ from the registry's")


def _pop_inactive(runtime: Runtime, name: str, keep: set[int]) -> None:
    while runtime.table.current(name).version not in keep:
        runtime.rollback(name)


class RegistryStore:
    """The state file in a directory, written atomically, with a lock for read-modify-write."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE

    def load(self) -> RegistryState:
        """The stored state; an empty one when there is no file yet."""
        try:
            return RegistryState.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return RegistryState()
        except (OSError, ValidationError) as exc:
            raise RegistryError(
                f"cannot read the operator registry {self.path}: {exc}; "
                "fix or remove it (removing resets every operator)"
            ) from exc

    def save(self, state: RegistryState) -> None:
        """Replace the file atomically: a reader sees the old state or the new, never a mix."""
        tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tmp.open("w") as sink:
                json.dump(state.model_dump(mode="json"), sink, indent=1)
                sink.flush()
                os.fsync(sink.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            raise RegistryError(f"cannot write the operator registry {self.path}: {exc}") from exc

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the registry's lock (an flock: every replica on this machine, or sharing the
        directory over a filesystem with locks)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".registry.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


class ReplicaRegistry:
    """One replica's runtime kept equal to the registry. Blocking (compiles): call from a thread."""

    def __init__(self, runtime: Runtime, store: RegistryStore) -> None:
        self.runtime = runtime
        self.store = store
        self.applied = RegistryState()  # the state this replica's runtime is in
        self.diverged: str | None = None  # why the last apply failed, until one succeeds
        self._lock = threading.Lock()  # one apply or change at a time in this replica

    def catch_up(self) -> RegistryState:
        """Apply the stored state if it is newer than the applied one; returns the applied one."""
        with self._lock:
            return self._apply(self.store.load())

    def catch_up_unless_busy(self) -> None:
        """`catch_up`, skipped while a change or push is being applied (a canary can take longer
        than a health check may)."""
        if self._lock.acquire(blocking=False):
            try:
                self._apply(self.store.load())
            finally:
                self._lock.release()

    def apply(self, state: RegistryState) -> RegistryState:
        """Apply a pushed state if it is newer than the applied one; returns the applied one."""
        with self._lock:
            return self._apply(state)

    def change(self, action: Callable[[Runtime], T], note: ChangeNote) -> tuple[T, RegistryState]:
        """Run `action` (the register, swap or rollback `note` describes) on the runtime at the
        registry's latest state and store the result with its record in the log. If `action`
        raises, nothing changes anywhere."""
        with self.store.locked(), self._lock:
            stored = self.store.load()
            self._apply(stored)
            made = action(self.runtime)
            seq = max(self.applied.seq, stored.seq) + 1
            record = ChangeRecord(
                **note.model_dump(),
                seq=seq,
                at=time.time(),
                version=self.runtime.table.current(note.op).version,
            )
            state = snapshot(self.runtime.table, seq, (*self.applied.log, record))
            try:
                self.store.save(state)
            except RegistryError as exc:  # the runtime is ahead of the file now
                self.diverged = str(exc)
                raise
            self.applied = state
            return made, state

    def _apply(self, state: RegistryState) -> RegistryState:
        if state.seq <= self.applied.seq:
            return self.applied
        try:
            apply_state(self.runtime, state)
        except RegistryDivergedError as exc:
            self.diverged = str(exc)
            raise
        self.applied, self.diverged = state, None
        return state
