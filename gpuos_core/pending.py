"""The scheduler's pending set: ops queued since the last flush, and which memory they touch.

A queued op is a `Node` whose result is a real tensor the runtime writes at the flush. The set
indexes results by tensor and by storage so that the scheduler can tell, for any tensor torch is
about to touch, whether it is a pending result, a view of one, or the input of a pending task.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Union

import torch

from .lowering import Build

Operand = Union[torch.Tensor, float, "Node"]


@dataclass(eq=False, slots=True)
class Node:
    """One queued op. Holds its output only weakly (pinned: strongly) so that a result nobody can
    read is never written; its operands (tensors, numbers, other nodes) strongly."""

    operands: tuple[Operand, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    ref: weakref.ref[torch.Tensor]
    build: Build | None = None  # elementwise: expression over the operands' expressions
    op: str = ""  # row/reduce: catalogue operator name
    device: torch.device = torch.device("cpu")
    dims: tuple[int, ...] | None = None  # sum/mean dims (None: all)
    keepdim: bool = False
    transpose: int | None = None  # softmax over this dim, via a view swapping it with the last
    pinned: torch.Tensor | None = None  # set when a view of the result escaped
    temp: torch.Tensor | None = None  # output allocated at flush when the result object died

    def alive(self) -> bool:
        return self.pinned is not None or self.ref() is not None

    def tensor(self) -> torch.Tensor:
        """The tensor this node writes: the caller's, or a temporary if that one died."""
        out = self.pinned if self.pinned is not None else self.ref()
        if out is None:
            if self.temp is None:
                self.temp = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            out = self.temp
        return out


def storage_of(t: torch.Tensor) -> int:
    """The address of the storage behind `t` (shared by all its views)."""
    return t.untyped_storage().data_ptr()


class Pending:
    """Nodes in queue order (producers first), indexed by result tensor and by storage.

    Not thread-safe: its owner calls it under one lock. The one exception is a result dying on
    another thread: its weakref callback only appends to a deque, which `reap` applies later.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._by_id: dict[int, Node] = {}  # id(result tensor) → node
        # Counts as plain dicts read with .get: a Counter's miss is a Python call, and most are.
        self._results: dict[int, int] = {}  # storage → live results
        self._inputs: dict[int, int] = {}  # storage → task inputs
        self._dead: collections.deque[tuple[int, int, int]] = collections.deque()
        self._epoch = 0  # bumped by `take`: callbacks of results taken before are ignored

    def __len__(self) -> int:
        return len(self.nodes)

    def add(
        self,
        operands: tuple[Operand, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        **kind: Any,
    ) -> torch.Tensor:
        """Queue a node over `operands`; its result, allocated now and written at the flush."""
        out = torch.empty(shape, dtype=dtype, device=device)
        storage, dead = out.data_ptr(), self._dead  # a fresh tensor starts its storage
        # Called when the result dies (any thread): queued, applied under the lock by reap.
        epoch, key = self._epoch, id(out)
        ref = weakref.ref(out, lambda _: dead.append((epoch, key, storage)))
        node = Node(operands, shape, dtype, ref, device=device, **kind)
        self._by_id[key] = node
        results, inputs = self._results, self._inputs
        results[storage] = results.get(storage, 0) + 1
        for x in operands:
            if isinstance(x, torch.Tensor):
                read = storage_of(x)
                inputs[read] = inputs.get(read, 0) + 1
        self.nodes.append(node)
        return out

    def node_of(self, t: torch.Tensor) -> Node | None:
        """The node whose result is `t` itself (not a view of it), or None."""
        node = self._by_id.get(id(t))
        return node if node is not None and node.ref() is t else None

    def writes(self, t: torch.Tensor) -> bool:
        """Whether a pending result lives in `t`'s storage (`t` may be that result)."""
        return self._results.get(storage_of(t), 0) > 0

    def reads(self, t: torch.Tensor) -> bool:
        """Whether a pending task reads a tensor in `t`'s storage."""
        return self._inputs.get(storage_of(t), 0) > 0

    def aliases(self, t: torch.Tensor) -> bool:
        """Whether `t` is a view of a pending result, other than the result itself."""
        return self.node_of(t) is None and self.writes(t)

    def reap(self) -> None:
        """Forget results that died (weakref callbacks queue them)."""
        while self._dead:
            epoch, key, storage = self._dead.popleft()
            if epoch == self._epoch:
                self._results[storage] -= 1
                node = self._by_id.get(key)
                if node is not None and node.ref() is None:  # not a newer result at that id
                    del self._by_id[key]

    def take(self) -> list[Node]:
        """Every queued node, leaving the set empty."""
        nodes, self.nodes = self.nodes, []
        self._by_id.clear()
        self._results.clear()
        self._inputs.clear()
        self._epoch += 1
        return nodes
