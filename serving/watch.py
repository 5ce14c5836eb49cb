"""The swap watch: a freshly swapped operator that starts failing is rolled back by the replicas.

For `window_s` after a swap (by the registry's log, so every replica and a restarted one agree),
the new version is watched. A request that uses it fails when its task fails, or when its result
is NaN or infinite where the version before it, run on the same inputs, is finite; an LLM step with
non-finite logits fails every operator swapped in the window (the model uses them, and its logits
were finite before). The first failure rolls the operator back on every replica (through the
registry, so concurrent failures on several replicas roll it back once), with the reason in the
registry's log. Checking a result costs one `isfinite` over it; the old version runs only when the
new one produced non-finite values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from gpuos_core import OpCall, Runtime
from gpuos_core.canary import nonfinite_regressions
from gpuos_core.catalogue import run_reference
from gpuos_core.errors import GpuosError, RollbackError

from .errors import ServingError
from .registry import ChangeNote, ReplicaRegistry

log = logging.getLogger("gpuos.serving.watch")
# Makes the change `note` describes with `apply`, on every replica (GpuosReplica.change).
Change = Callable[[ChangeNote, Callable[[Runtime], object]], Awaitable[object]]


class SwapWatch:
    """Watches the versions swapped in the last `window_s` seconds on one replica."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        window_s: float,
        change: Change,
        on_rollback: Callable[[str], None],
    ) -> None:
        self.registry, self.window_s = registry, window_s
        self._change, self._on_rollback = change, on_rollback
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}  # rollbacks under way

    def watched(self, op: str, version: int) -> bool:
        """Whether `version` of `op` is current and came from a swap less than window_s ago."""
        table = self.registry.runtime.table
        if op not in table.active or table.current(op).version != version:
            return False
        last = next((r for r in reversed(self.registry.applied.log) if r.op == op), None)
        return (
            last is not None
            and last.action == "swap"
            and last.version == version
            and time.time() - last.at < self.window_s
        )

    def check_result(self, call: OpCall, version: int, out: torch.Tensor) -> None:
        """After a request's answer: roll `version` back if it made NaN or infinity where the
        version before it is finite on the same inputs."""
        if not self.watched(call.op, version) or bool(torch.isfinite(out).all()):
            return
        before = self.registry.runtime.table.previous(call.op)
        if before is None:
            return
        old = run_reference(before.spec, call).to(out.dtype)
        bad = nonfinite_regressions(out, old)
        if bad:
            self.failed(
                call.op,
                version,
                f"v{version} returned {bad} NaN or infinite value(s) "
                f"where v{before.version} is finite on the same inputs",
            )

    def failed(self, op: str, version: int, reason: str) -> bool:
        """A request using `version` of `op` failed: roll it back if it is watched (True)."""
        if not self.watched(op, version):
            return False
        if (op, version) not in self._pending:
            task = asyncio.get_running_loop().create_task(self._roll_back(op, version, reason))
            self._pending[(op, version)] = task
        return True

    def nonfinite_logits(self, reason: str) -> list[str]:
        """An LLM step saw non-finite logits: every operator swapped within the window fails.
        Returns those being rolled back."""
        table = self.registry.runtime.table
        swapped = sorted({r.op for r in self.registry.applied.log if r.action == "swap"})
        return [
            op
            for op in swapped
            if op in table.active and self.failed(op, table.current(op).version, reason)
        ]

    async def _roll_back(self, op: str, version: int, reason: str) -> None:
        note = ChangeNote(op=op, action="rollback", by="watch", reason=reason)
        try:
            await self._change(note, lambda rt: _roll_back_if_current(rt, op, version))
        except (GpuosError, ServingError) as exc:  # another replica was faster, or it failed
            log.warning("no automatic rollback of %s v%d: %s", op, version, exc)
        else:
            log.warning("rolled %s v%d back on every replica: %s", op, version, reason)
            self._on_rollback(op)
        finally:
            del self._pending[(op, version)]


def _roll_back_if_current(runtime: Runtime, op: str, version: int) -> object:
    """Roll `op` back unless `version` is not current any more (rolled back elsewhere)."""
    if runtime.table.current(op).version != version:
        raise RollbackError(f"{op} v{version} is not current any more")
    return runtime.rollback(op)
