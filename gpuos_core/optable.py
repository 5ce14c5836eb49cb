"""Operator versions and the table that says which version of each operator is active.

The table is immutable: a swap or rollback builds the next table, the runtime prepares (compiles,
links, loads) what it needs, and only then publishes it, so a failure leaves the old one serving.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .catalogue import CATALOGUE, OpSpec
from .errors import OperatorExistsError, RollbackError, UnknownOperatorError


@dataclass(frozen=True)
class OpVersion:
    """One immutable version of one operator."""

    spec: OpSpec  # its definition
    version: int  # 1, 2, ... per operator

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def symbol(self) -> str:
        """Device symbol of this version in a worker image."""
        return f"gpuos_op_{self.spec.name}_v{self.version}"


@dataclass(frozen=True)
class OpTable:
    """All versions ever made (`history`) and, per operator, the stack of activations: a swap
    pushes, a rollback pops. The top is current, the one below it previous."""

    history: Mapping[str, tuple[OpVersion, ...]] = field(default_factory=dict)
    active: Mapping[str, tuple[OpVersion, ...]] = field(default_factory=dict)

    def current(self, name: str) -> OpVersion:
        return self._stack(name)[-1]

    def previous(self, name: str) -> OpVersion | None:
        stack = self._stack(name)
        return stack[-2] if len(stack) > 1 else None

    def names(self) -> tuple[str, ...]:
        return tuple(self.active)

    def added(self, spec: OpSpec) -> tuple[OpTable, OpVersion]:
        """Table with a new operator at version 1."""
        if spec.name in self.active:
            raise OperatorExistsError(f"operator {spec.name!r} exists: swap it to change it")
        return self._with(spec.name, OpVersion(spec, 1), ())

    def swapped(self, spec: OpSpec) -> tuple[OpTable, OpVersion]:
        """Table whose current version of `spec.name` is a new version made from `spec`."""
        made = OpVersion(spec, len(self.history[self._known(spec.name)]) + 1)
        return self._with(spec.name, made, self.active[spec.name])

    def rolled_back(self, name: str) -> tuple[OpTable, OpVersion]:
        """Table whose current version of `name` is the one active before the last change."""
        stack = self._stack(name)
        if len(stack) < 2:
            raise RollbackError(
                f"{name} is at its first active version {stack[-1].version}: "
                "nothing to roll back to"
            )
        active = dict(self.active)
        active[name] = stack[:-1]
        return OpTable(self.history, MappingProxyType(active)), stack[-2]

    def slots(self) -> tuple[OpVersion, ...]:
        """Versions the next image holds: current and previous of every operator (dual slot)."""
        return tuple(v for name in self.active for v in self._stack(name)[-2:])

    def _with(
        self, name: str, made: OpVersion, stack: tuple[OpVersion, ...]
    ) -> tuple[OpTable, OpVersion]:
        history, active = dict(self.history), dict(self.active)
        history[name] = history.get(name, ()) + (made,)
        active[name] = stack + (made,)
        return OpTable(MappingProxyType(history), MappingProxyType(active)), made

    def _known(self, name: str) -> str:
        if name not in self.active:
            raise UnknownOperatorError(
                f"unknown operator {name!r}; known: {', '.join(sorted(self.active))}"
            )
        return name

    def _stack(self, name: str) -> tuple[OpVersion, ...]:
        return self.active[self._known(name)]


def catalogue_table() -> OpTable:
    """Version 1 of every catalogue operator: what a fresh runtime starts from."""
    table = OpTable()
    for spec in CATALOGUE.values():
        table, _ = table.added(spec)
    return table


@dataclass(frozen=True)
class Image:
    """One loaded generation: which version each physical slot of the jump table holds."""

    generation: int
    slots: tuple[OpVersion, ...]

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {id(v): i for i, v in enumerate(self.slots)}  # versions are compared by identity

    def slot_of(self, version: OpVersion) -> int | None:
        """Physical slot of `version`, or None when this image does not hold it."""
        return self._index.get(id(version))

    def aliases(self, table: OpTable) -> dict[str, int]:
        """Logical name → physical slot of its current version (all must be loaded)."""
        return {name: self._require(table.current(name)) for name in table.names()}

    def _require(self, version: OpVersion) -> int:
        slot = self.slot_of(version)
        assert slot is not None, f"{version.symbol} is not in image {self.generation}"
        return slot
