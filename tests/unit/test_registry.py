"""The operator registry: a stored state brings any replica's runtime to the same versions, changes
are all-or-nothing, and the file survives restarts and refuses corruption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpuos_core import ExpressionError, Runtime
from serving.errors import RegistryDivergedError, RegistryError
from serving.registry import (
    ChangeNote,
    RegistryState,
    RegistryStore,
    ReplicaRegistry,
    apply_state,
    op_record,
    snapshot,
)


@pytest.fixture
def rt() -> Iterator[Runtime]:
    with Runtime("cpu") as runtime:
        yield runtime


def made_history(rt: Runtime) -> RegistryState:
    """register, swaps and rollbacks leaving versions 1..4 of `lin` with active stack [1, 3]."""
    rt.register("lin", "A * 2 + B", 2)
    rt.swap("lin", "A * 3 + B")  # v2
    rt.rollback("lin")  # [1]
    rt.swap("lin", "A * 4 + B")  # v3: [1, 3]
    rt.swap("lin", "A * 5 + B")  # v4: [1, 3, 4]
    rt.rollback("lin")  # [1, 3]
    rt.swap("sigmoid", "1 / (1 + exp(-A))")
    return snapshot(rt.table, seq=7)


def test_a_fresh_runtime_reaches_the_same_versions_and_results(rt: Runtime) -> None:
    state = made_history(rt)
    assert state.ops["lin"].active == (1, 3) and len(state.ops["lin"].versions) == 4
    assert set(state.ops) == {"lin", "sigmoid"}  # untouched catalogue operators are not stored
    with Runtime("cpu") as fresh:
        apply_state(fresh, state)
        for name in ("lin", "sigmoid", "relu"):
            assert op_record(fresh.table, name) == op_record(rt.table, name)
        a, b = torch.randn(9), torch.randn(9)
        torch.testing.assert_close(fresh.run("lin", a, b), a * 4 + b)
        fresh.rollback("lin")  # the stack came along too
        torch.testing.assert_close(fresh.run("lin", a, b), a * 2 + b)


def test_a_replica_one_change_behind_catches_up(rt: Runtime) -> None:
    rt.register("lin", "A + 1")
    before = snapshot(rt.table, seq=1)
    rt.swap("lin", "A + 2")
    after = snapshot(rt.table, seq=2)
    with Runtime("cpu") as other:
        apply_state(other, before)
        apply_state(other, after)
        assert op_record(other.table, "lin") == op_record(rt.table, "lin")


def test_a_runtime_with_changes_the_registry_lacks_is_diverged(rt: Runtime) -> None:
    rt.register("mine", "A + 1")
    with pytest.raises(RegistryDivergedError, match="mine"):
        apply_state(rt, RegistryState(seq=1))


def test_a_runtime_whose_versions_differ_from_the_registry_is_diverged(rt: Runtime) -> None:
    with Runtime("cpu") as other:
        other.register("lin", "A + 1")
        rt.register("lin", "A + 100")
        with pytest.raises(RegistryDivergedError, match="differ"):
            apply_state(rt, snapshot(other.table, seq=1))


def test_the_store_round_trips_and_writes_atomically(tmp_path: Path, rt: Runtime) -> None:
    store = RegistryStore(tmp_path / "state")
    assert store.load() == RegistryState()  # no file yet: nothing changed
    state = made_history(rt)
    store.save(state)
    assert RegistryStore(tmp_path / "state").load() == state
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["registry.json"]


def test_a_corrupt_state_file_is_refused_with_its_path(tmp_path: Path) -> None:
    store = RegistryStore(tmp_path)
    store.path.write_text('{"format": 1, "seq": "many"}')
    with pytest.raises(RegistryError, match="registry.json"):
        store.load()


def test_a_change_made_on_one_replica_reaches_another_through_the_store(
    tmp_path: Path, rt: Runtime
) -> None:
    store = RegistryStore(tmp_path)
    mine = ReplicaRegistry(rt, store)
    made, state = mine.change(
        lambda r: r.register("lin", "A * 2"), ChangeNote(op="lin", action="register")
    )
    assert made.version == 1 and state.seq == 1 and store.load() == state
    with Runtime("cpu") as peer_rt:
        peer = ReplicaRegistry(peer_rt, store)
        assert peer.catch_up().seq == 1
        _, state = peer.change(
            lambda r: r.swap("lin", "A * 3"), ChangeNote(op="lin", action="swap", reason="faster")
        )
        assert state.seq == 2
    assert mine.catch_up() == state  # the first replica sees the peer's change
    assert [(r.seq, r.action, r.version, r.by, r.reason) for r in state.log] == [
        (1, "register", 1, "admin", None),
        (2, "swap", 2, "admin", "faster"),
    ]
    x = torch.randn(4)
    torch.testing.assert_close(rt.run("lin", x), x * 3)


def test_a_failing_change_changes_nothing(tmp_path: Path, rt: Runtime) -> None:
    registry = ReplicaRegistry(rt, RegistryStore(tmp_path))
    registry.change(lambda r: r.register("lin", "A * 2"), ChangeNote(op="lin", action="register"))
    with pytest.raises(ExpressionError):
        registry.change(lambda r: r.swap("lin", "A *"), ChangeNote(op="lin", action="swap"))
    assert registry.store.load().seq == 1 and registry.applied.seq == 1
    assert rt.table.current("lin").version == 1 and len(rt.history("lin")) == 1
