"""Tensors of the /v1/ops requests and answers (serving/schemas.py's models) to torch and back.

Two encodings, chosen per tensor by the client: nested lists of numbers, or base64 of the
tensor's little-endian bytes with its dtype and shape. The bytes cost no Python per element either
way (base64 and `torch.frombuffer` run at C speed), which is what lets a replica answer thousands
of small calls a second; lists cost one Python float per element to parse and to write.

A request's tensor elements are counted against `ElementBudget`s: one for its inputs and one for
its results, each `max_elements`, shared by all the calls of a batch, so a batch costs a replica
no more memory than a single call may.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, NamedTuple

import numpy as np
import torch

from gpuos_core import OpCall
from gpuos_core.catalogue import OpSpec

from .errors import RequestTooLargeError, TensorDataError, finite_json
from .schemas import DTYPE_NAMES, DTYPES, NONFINITE, Encoding, OpRequest, TensorB64, TensorIn


class ElementBudget:
    """Tensor elements a request may still use for one purpose (`what`: its inputs, results)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.left, self.what = limit, limit, what

    @property
    def used(self) -> int:
        return self.limit - self.left

    def take(self, count: int, detail: str = "") -> None:
        """Use `count` elements; RequestTooLargeError (nothing used) when fewer are left."""
        if count > self.left:
            raise RequestTooLargeError(
                f"{detail}{self.what} have more than {self.limit} "
                "elements in all; split the request"
            )
        self.left -= count


class Budgets(NamedTuple):
    """The element budgets of one request."""

    inputs: ElementBudget
    results: ElementBudget


def request_budgets(max_elements: int) -> Budgets:
    """A request's budgets: `max_elements` for its inputs and as many for its results."""
    return Budgets(
        ElementBudget(max_elements, "the inputs"), ElementBudget(max_elements, "the results")
    )


def to_call(op: str, request: OpRequest, inputs: ElementBudget, device: torch.device) -> OpCall:
    """The runtime call a request describes, its tensors on `device` (the runtime's), each
    counted against `inputs` (RequestTooLargeError past it)."""
    tensors = []
    for i, spec in enumerate(request.inputs):
        x = to_tensor(spec, f"input {i}", device)
        inputs.take(x.numel())
        tensors.append(x)
    return OpCall(
        op,
        tuple(tensors),
        scalars=request.scalars,
        dims=tuple(request.dims) if request.dims is not None else None,
        keepdim=request.keepdim,
        out_dtype=DTYPES[request.out_dtype] if request.out_dtype else None,
    )


def check_output_size(spec: OpSpec, call: OpCall, results: ElementBudget) -> None:
    """Counts `call`'s result against `results` before it is allocated: RequestTooLargeError past
    it (broadcasting [n, 1] with [1, n], or a linear layer, multiplies small inputs)."""
    try:
        shape = spec.kind.layout(call.inputs, call.dims, call.keepdim).out_shape
    except Exception:  # a call that does not fit: runtime.prepare says why, with the right class
        return
    results.take(math.prod(shape), f"the result would have shape {list(shape)}: ")


def to_tensor(spec: TensorIn | TensorB64, what: str, device: torch.device) -> torch.Tensor:
    """A tensor on `device` from either encoding; TensorDataError says what does not fit. The copy
    to a GPU runs on this thread's torch stream, which the runtime orders its batch after."""
    if isinstance(spec, TensorB64):
        return _from_b64(spec, what).to(device)
    array = _array(spec.data, what)
    if spec.shape is not None and list(array.shape) != spec.shape:
        array = _reshaped(array, spec.shape, what)
    return torch.from_numpy(array).to(device=device, dtype=DTYPES[spec.dtype])


def _from_b64(spec: TensorB64, what: str) -> torch.Tensor:
    """The CPU tensor whose bytes `spec` carries (little-endian, as every supported host is)."""
    try:
        raw = bytearray(base64.b64decode(spec.b64, validate=True))  # writable: frombuffer's wish
    except (binascii.Error, ValueError) as exc:
        raise TensorDataError(f"{what}: b64 is not valid base64 ({exc})") from None
    dtype = DTYPES[spec.dtype]
    count = math.prod(spec.shape)
    if len(raw) != count * dtype.itemsize:
        raise TensorDataError(
            f"{what}: b64 holds {len(raw)} bytes; shape {spec.shape} of {spec.dtype} needs "
            f"{count * dtype.itemsize} ({count} elements of {dtype.itemsize} bytes)"
        )
    flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(spec.shape)


def _array(data: list[Any], what: str) -> np.ndarray:
    """float32 array of numbers in evenly nested lists, strings standing for non-finite values."""
    try:
        array = np.asarray(data)  # numbers only: an int or float array, at C speed
        if array.dtype.kind not in "iuf":  # strings, nulls, booleans: look at each element
            array = np.vectorize(_number, otypes=[np.float64])(np.asarray(data, dtype=object))
        return array.astype(np.float32)
    except (ValueError, TypeError, OverflowError) as exc:
        raise TensorDataError(
            f"{what}: data must be numbers in evenly nested lists ({exc})"
        ) from None


def _number(value: object) -> float:
    """One element: a number, or a string naming a non-finite one; ValueError says why not."""
    if type(value) in (int, float):  # not bool
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value in NONFINITE:
        return NONFINITE[value]
    if value is None:
        raise ValueError(
            'null is not a number; send NaN as "NaN" (infinities as "Infinity", "-Infinity")'
        )
    raise ValueError(f"got {type(value).__name__} {str(value)[:40]!r}")


def _reshaped(array: np.ndarray, shape: list[int], what: str) -> np.ndarray:
    if array.ndim != 1 or array.size != math.prod(shape):
        raise TensorDataError(
            f"{what}: data of shape {list(array.shape)} does not fit shape "
            f"{shape}; give nested lists of that shape or a flat list of its "
            "size"
        )
    return array.reshape(shape)


def answer_encoding(request: OpRequest) -> Encoding:
    """The encoding of a request's result: the one it asks for, else b64 if an input is b64."""
    if request.out_encoding is not None:
        return request.out_encoding
    return "b64" if any(isinstance(x, TensorB64) for x in request.inputs) else "list"


def from_tensor(x: torch.Tensor, encoding: Encoding = "list") -> dict[str, Any]:
    """The JSON form of a result (serving/jsonfast.py writes it): `TensorOut` or `TensorB64Out`.
    Built, not validated: a million floats took 200 ms of the event loop to check."""
    if encoding == "b64":
        data = x.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        return {
            "b64": base64.b64encode(data.data).decode("ascii"),
            "shape": list(x.shape),
            "dtype": DTYPE_NAMES[x.dtype],
        }
    return {"data": _listed(x), "shape": list(x.shape), "dtype": DTYPE_NAMES[x.dtype]}


def _listed(x: torch.Tensor) -> np.ndarray | list[Any]:
    """`x`'s values, row-major, as float32 (fp16/bf16 values are exact in it): the array itself
    when all are finite (written at C speed), else a list with non-finite ones as strings."""
    values = x.detach().float().reshape(-1).cpu().numpy()
    finite = np.isfinite(values)
    if finite.all():
        return values
    data: list[Any] = values.tolist()
    for i in np.flatnonzero(~finite):
        data[i] = finite_json(data[i])
    return data
