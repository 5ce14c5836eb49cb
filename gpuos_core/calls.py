"""Typed messages between callers, the runtime and the backends."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class OpCall:
    """One micro-request, as a caller states it."""

    op: str                                   # operator name (catalogue or registered)
    inputs: tuple[torch.Tensor, ...]          # positional tensor inputs
    out: torch.Tensor | None = None           # written in place when given, else allocated
    scalars: Mapping[str, float] = field(default_factory=dict)  # named operator parameters
    dims: tuple[int, ...] | None = None       # sum/mean: dims to reduce (None: all)
    keepdim: bool = False                     # sum/mean: keep reduced dims as size 1
    out_dtype: torch.dtype | None = None      # dtype of an allocated output (default: promoted)


@dataclass(frozen=True)
class Params:
    """Operator parameters as a kernel sees them: what a reference needs beside the tensors."""

    scalars: tuple[float, ...]                # in the operator's declared order
    reduce_dims: tuple[int, ...] = ()         # sum/mean: reduced dims of in[0]


class Tiling(Protocol):
    """What a task needs of its operator's family (families.Family): how to cut it into records."""

    def ranges(self, task: "Prepared", tile_elements: int | None) -> list[tuple[int, int]]: ...


@dataclass(frozen=True, eq=False)
class Prepared:
    """A validated task: tensors laid out as encoded; its version is resolved only at submit.

    `Runtime.prepare` returns it complete (records encoded) and nothing writes to it afterwards,
    records included: a submission resolves operator slots in a copy."""

    op: str                                   # logical operator name
    out: torch.Tensor                         # the result as the caller sees it
    out_ref: torch.Tensor                     # view of `out` encoded as task.out (keepdim layout)
    inputs: tuple[torch.Tensor, ...]          # views encoded as task.in (broadcasts expanded)
    params: Params                            # scalars and reduced dims
    items: int                                # work items (elements or rows) the task covers
    kind: Tiling                              # its operator's family (cuts the items into records)
    inputs_written: tuple[int, ...] = ()      # inputs the operator also writes in place
    # Its ABI records (one per tile), op_slot unresolved; None only inside Runtime.prepare, before
    # the family has cut the task into tiles.
    records: np.ndarray | None = None
