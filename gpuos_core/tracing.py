"""Traced regions: a function's queued ops recorded once per guard signature and replayed as one
device program, with no Python per op.

A call of a traced function (`Scheduler.trace`, dispatch.py) is keyed by its guards (`guard`):
how its arguments nest (tuples, lists, dicts, namedtuples), each tensor's type, shape, strides,
dtype, device and requires_grad, which arguments are the same tensor and which share storage,
the value of every other argument, and the grad and autocast modes. The first call with a new
key records: it runs under the scheduler as usual while the scheduler reports what happened
(`Recording`), and the flush at its end is one device program. The recording becomes a `Trace`
when each tensor a task touches is an argument (or a view of one the region made), a result the
function returns, an intermediate (from then on memory the trace owns: runs of one program never
overlap), or a tensor read in place (one the region reads without taking it as an argument: a
closure, a global, module state); and when nothing else ran in between: no op left to torch
other than views, no read of a value on the host, no flush. A replay allocates fresh results,
writes the arguments' and results' addresses into the program's records (one numpy scatter,
`program.Binding`), submits the program and waits.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .fusion import Form, inputs_of
from .pending import Node, Operand
from .program import Binding, Program
from .runtime import Runtime

FLUSH_TIMEOUT_S = 60.0  # how long a flush or a replay waits for its program
# Argument values guards compare by value (anything else cannot be guarded: a call with one runs
# the scheduler's path). Floats compare by their hex text, so -0.0 is not 0.0 and NaN is NaN.
VALUES = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        torch.Size,
    }
)
PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data the runtime may read
# How leaves nest (hashable): None for a leaf, else (type, children) or (dict, keys, children).
Structure = Any
Returned = tuple[int, int, Any]  # one returned leaf: (ARG or RESULT, index) or (VALUE, 0, itself)
ARG, RESULT, VALUE = 0, 1, 2


@dataclass
class TraceStats:
    """What a traced function did (counters only grow). Every call is counted once in `replayed`,
    `recorded` or `not_replayable`."""

    calls: int = 0  # calls of the traced function
    replayed: int = 0  # answered by replaying a trace: no Python per op
    recorded: int = 0  # guards matched no trace: ran the scheduler's path and recorded one
    misses: int = 0  # guards matched no trace (each records one, replayable or not)
    evicted: int = 0  # traces dropped to keep at most cache_size per function
    # why → calls that ran the scheduler's path because their trace cannot be replayed (the
    # recording included) or their arguments cannot be guarded
    not_replayable: collections.Counter[str] = field(default_factory=collections.Counter)


def flatten(tree: Any, leaves: list[Any]) -> Structure:
    """Append the leaves of `tree` to `leaves` and return how they nest. Tuples, lists,
    namedtuples and dicts with keys guards can compare are containers; all else is a leaf."""
    kind = type(tree)
    if kind is tuple or kind is list or (isinstance(tree, tuple) and hasattr(kind, "_fields")):
        return kind, tuple([flatten(x, leaves) for x in tree])
    if kind is dict and all(type(k) in VALUES for k in tree):
        return dict, tuple(tree), tuple([flatten(x, leaves) for x in tree.values()])
    leaves.append(tree)
    return None


def unflatten(structure: Structure, leaves: Iterator[Any]) -> Any:
    """The tree `flatten` described, over the next leaves of `leaves`."""
    if structure is None:
        return next(leaves)
    kind, items = structure[0], [unflatten(s, leaves) for s in structure[-1]]
    if kind is dict:
        return dict(zip(structure[1], items))
    return kind._make(items) if hasattr(kind, "_fields") else kind(items)


@dataclass(frozen=True)
class Guarded:
    """One call's arguments as the guards see them."""

    leaves: list[Any]  # the arguments, flattened
    key: Hashable | None  # the guard signature; None when an argument cannot be guarded
    addresses: list[int]  # data_ptr of each tensor leaf, 0 for the other leaves
    why: str = ""  # why the call cannot be guarded (key None)


def guard(args: tuple, kwargs: dict[str, Any]) -> Guarded:
    """The guards of a call with `args` and `kwargs`. Tensors are keyed by type, shape, strides,
    dtype, device and requires_grad, plus the first argument that is the same tensor and the
    first that shares its storage; other arguments by value; and the grad and autocast modes."""
    leaves: list[Any] = []
    structure = flatten((args, kwargs), leaves)
    signature: list[Hashable] = []
    addresses: list[int] = []
    storages: dict[int, int] = {}
    objects: dict[int, int] = {}
    for i, x in enumerate(leaves):
        kind = type(x)
        if kind in PLAIN:
            ptr = x.data_ptr()
            storage = storages.setdefault(ptr - x.storage_offset() * x.itemsize, i)
            signature.append(
                (
                    kind,
                    x.shape,
                    x.stride(),
                    x.dtype,
                    x.device,
                    x.requires_grad,
                    storage,
                    objects.setdefault(id(x), i),
                )
            )
            addresses.append(ptr)
        elif kind in VALUES:
            signature.append((kind, x.hex() if kind is float else x))
            addresses.append(0)
        else:
            return Guarded(
                leaves,
                None,
                [],
                f"an argument of type {kind.__name__} cannot be "
                "guarded (tensors, numbers, strings, None, dtypes and devices can, "
                "in tuples, lists and dicts)",
            )
    return Guarded(leaves, (structure, _modes(), tuple(signature)), addresses)


def _modes() -> Hashable:
    """The torch modes that change which ops a region's code dispatches: grad mode (what may be
    queued) and autocast (the casts it inserts)."""
    return torch.is_grad_enabled(), *(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )


@dataclass(frozen=True)
class Flushed:
    """A flush as the scheduler ran it: the nodes that got a task, in program order, the forms
    fusion gave them (by node id), and the program."""

    tasks: Sequence[Node]
    forms: dict[int, Form]
    program: Program


@dataclass(frozen=True, eq=False)
class Trace:
    """A recorded call that replays: its program, where each run's tensors go in it, and what
    the function returns."""

    runtime: Runtime
    program: Program | None  # None: the region leaves no work to run
    binding: Binding | None  # slots: the arguments' leaves, then the results
    results: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # shape and dtype of each result
    returns: tuple[Returned, ...]  # each returned leaf
    structure: Structure  # how the returned leaves nest

    def replay(self, leaves: Sequence[Any], addresses: Sequence[int]) -> Any:
        """The function's return value for arguments `leaves` (at `addresses`) that passed this
        trace's guards: fresh results, written when this returns (TaskFailedError if a task
        failed)."""
        device = self.runtime.device
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.results]
        if self.program is not None and self.binding is not None:
            bound = np.array([*addresses, *(o.data_ptr() for o in outs)], dtype=np.uint64)
            self.program.rebind(self.binding, bound)
            self.runtime.submit(self.program).wait(FLUSH_TIMEOUT_S).check()
        picked = (
            leaves[i] if kind == ARG else outs[i] if kind == RESULT else value
            for kind, i, value in self.returns
        )
        return unflatten(self.structure, picked)


class Recording:
    """What the scheduler reports while a traced call records (dispatch.py): the views of its
    arguments the region made, and the first reason the trace cannot be replayed."""

    def __init__(self, guarded: Guarded) -> None:
        self.guarded = guarded
        self.reason: str | None = None
        # id → (tensor, argument leaf): the tensor arguments and each view of one the region made
        self._views: dict[int, tuple[torch.Tensor, int]] = {
            id(x): (x, i) for i, x in enumerate(guarded.leaves) if isinstance(x, torch.Tensor)
        }

    def refuse(self, reason: str) -> None:
        """Mark the trace not replayable; the first reason is the one kept."""
        if self.reason is None:
            self.reason = reason

    def argument_of(self, t: torch.Tensor) -> int | None:
        """The argument leaf `t` is, or is a view of made in the region; else None."""
        hit = self._views.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def ran_in_torch(
        self, func: torch._ops.OpOverload, args: tuple, result: Any, of_pending: bool
    ) -> None:
        """An op the scheduler left to torch. A view replays as the addresses its readers
        encode (a view of an argument is bound to it); any other op, or a view of a pending
        result (`of_pending`), cannot be replayed."""
        if not func.is_view or func._schema.is_mutable:
            self.refuse(f"{func} runs in torch (a replay runs only the queued ops)")
        elif of_pending:
            self.refuse(f"{func} views a result inside the region")
        else:
            base = next((a for a in args if isinstance(a, torch.Tensor)), None)
            index = None if base is None else self.argument_of(base)
            if index is not None:
                views = result if isinstance(result, (list, tuple)) else (result,)
                self._views.update((id(v), (v, index)) for v in views)

    def finish(self, returned: Any, flushed: Flushed | None, runtime: Runtime) -> Trace | str:
        """The trace of a call that returned `returned` and ended with `flushed`, or why it
        cannot be replayed."""
        nodes = flushed.tasks if flushed is not None else ()
        made = {id(r): n for n in nodes if (r := n.ref()) is not None}
        leaves: list[Any] = []
        structure = flatten(returned, leaves)
        # The nodes whose results are returned, by first appearance: result slot j is the j-th.
        outputs = {id(n): n for x in leaves if (n := made.get(id(x))) is not None}
        slots = {key: j for j, key in enumerate(outputs)}
        returns = tuple(self._returned(x, made, slots) for x in leaves)
        if any(n.alive() and id(n) not in outputs for n in nodes):
            self.refuse("a result escapes other than through the return value")
        if self.reason is not None:
            return self.reason
        results = tuple((n.shape, n.dtype) for n in outputs.values())
        if flushed is None:
            return Trace(runtime, None, None, results, returns, structure)
        binding = self._binding(flushed, list(outputs.values()))
        return Trace(runtime, flushed.program, binding, results, returns, structure)

    def _returned(self, x: Any, made: dict[int, Node], slots: dict[int, int]) -> Returned:
        """Where returned leaf `x` comes from at a replay."""
        if isinstance(x, torch.Tensor):
            k = self.argument_of(x)
            if k is not None:
                if self.guarded.leaves[k] is not x:
                    self.refuse("returns a view of an argument")
                return ARG, k, None
            node = made.get(id(x))
            if node is not None:
                return RESULT, slots[id(node)], None
            return VALUE, 0, x  # a tensor the region reads in place: the same one every call
        if type(x) not in VALUES:
            self.refuse(
                f"returns a {type(x).__name__} (tensors and plain values replay, in "
                "tuples, lists and dicts)"
            )
        return VALUE, 0, x

    def _binding(self, flushed: Flushed, outputs: list[Node]) -> Binding:
        """Where the arguments (slots 0..) and the returned results (the slots after them) go
        in the program's records."""
        first = len(self.guarded.leaves)
        result_slot = {id(n): first + j for j, n in enumerate(outputs)}
        uses = []
        for i, n in enumerate(flushed.tasks):
            sources: tuple[Operand, ...] = (n, *inputs_of(n, flushed.forms.get(id(n))))
            for operand, source in enumerate(sources, start=-1):
                slot = (
                    result_slot.get(id(source))
                    if isinstance(source, Node)
                    else None
                    if isinstance(source, float)
                    else self.argument_of(source)
                )
                if slot is not None:  # else memory the trace owns or reads in place
                    uses.append((i, operand, slot))
        addresses = [*self.guarded.addresses, *(n.tensor().data_ptr() for n in outputs)]
        return flushed.program.binding(uses, addresses)
