"""Typed messages between callers, the runtime and the backends."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np
import torch

# Allocates a task's output: (shape, dtype) -> a tensor on the runtime's device.
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class OpCall:
    """One micro-request, as a caller states it."""

    op: str  # operator name (catalogue or registered)
    inputs: tuple[torch.Tensor, ...]  # positional tensor inputs
    out: torch.Tensor | None = None  # written in place when given, else allocated
    scalars: Mapping[str, float] = field(default_factory=dict)  # named operator parameters
    dims: tuple[int, ...] | None = None  # sum/mean: dims to reduce (None: all)
    keepdim: bool = False  # sum/mean: keep reduced dims as size 1
    out_dtype: torch.dtype | None = None  # dtype of an allocated output (default: promoted)
    # tasks of a program that run side by side and split the machine (a prefill step's chunks'
    # attention, one task each): the task's records are cut for its share of the SMs (None:
    # as its family judges from the shapes)
    share: int | None = None


@dataclass(frozen=True)
class Params:
    """Operator parameters as a kernel sees them: what a reference needs beside the tensors."""

    scalars: tuple[float, ...]  # in the operator's declared order
    reduce_dims: tuple[int, ...] = ()  # sum/mean: reduced dims of in[0]


class Tiling(Protocol):
    """What a task needs of its operator's family (families.Family): how to cut it into
    records."""

    def ranges(self, task: LaidOut, tile_elements: int | None) -> list[tuple[int, int]]: ...


@dataclass(frozen=True, eq=False)
class LaidOut:
    """A validated call with its tensors laid out as they will be encoded: what its operator's
    family needs to cut it into records (catalogue.prepare makes it, Runtime.prepare encodes it)."""

    op: str  # logical operator name
    out: torch.Tensor  # the result as the caller sees it
    out_ref: torch.Tensor  # view of `out` encoded as task.out (keepdim layout)
    inputs: tuple[torch.Tensor, ...]  # views encoded as task.in (broadcasts expanded)
    params: Params  # scalars and reduced dims
    items: int  # work items (elements or rows) the task covers
    kind: Tiling  # its operator's family (cuts the items into records)
    inputs_written: tuple[int, ...] = ()  # inputs the operator also writes in place
    # tensors the operator reads beside its inputs (their refs ride in its workspace): what a
    # program's data flow must see
    reads: tuple[torch.Tensor, ...] = ()
    share: int | None = None  # OpCall.share


@dataclass(frozen=True, eq=False)
class Prepared(LaidOut):
    """A task ready to submit: laid out and encoded; its version is resolved only at submit.

    Nothing writes to it after `Runtime.prepare`, records included: a submission resolves
    operator slots in a copy."""

    records: np.ndarray = field(kw_only=True)  # ABI records (one per tile), op_slot unresolved

    @classmethod
    def encoded(cls, task: LaidOut, records: np.ndarray) -> Prepared:
        """`task` with its records."""
        return cls(**{f.name: getattr(task, f.name) for f in fields(LaidOut)}, records=records)
