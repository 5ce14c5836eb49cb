"""HTTP request and response bodies (pydantic; they make the OpenAPI docs at /docs) and the
conversion between JSON tensors and torch tensors.

JSON has no NaN or infinity: tensors write them as the strings "NaN", "Infinity" and "-Infinity",
in answers and in requests (which also take the bare literals NaN and Infinity some encoders
write); null is refused, as it could mean any of them or a missing value.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from gpuos_core import OpCall
from gpuos_core.canary import Comparison
from gpuos_core.catalogue import OpSpec
from gpuos_core.optable import OpTable

from .config import CoalescerConfig, DeadlineMs, MaxBatch, MaxQueue, WindowUs
from .errors import RequestTooLargeError, TensorDataError, finite_json
from .registry import Action, ChangeRecord, VersionRecord, version_record

Dtype = Literal["float32", "float16", "bfloat16"]
DTYPES: Mapping[Dtype, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES: Mapping[torch.dtype, Dtype] = {v: k for k, v in DTYPES.items()}
NonFinite = Literal["NaN", "Infinity", "-Infinity"]
NONFINITE: Mapping[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
MAX_DIMS = 8  # more than any operator takes (the runtime says which)
Dim = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Strict(BaseModel):
    """A request body: unknown keys refused, and no coercion (a boolean is not a number, a
    string not a boolean), so what the OpenAPI schema refuses the server refuses too."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- inference ---------------------------------------------------------------------------------
class TensorIn(_Strict):
    """A tensor in JSON: nested lists (row-major), or a flat list with its shape."""

    data: list[Any] = Field(description='nested lists of numbers, or a flat list with `shape`; '
                                        '"NaN", "Infinity", "-Infinity" for non-finite values')
    shape: list[Dim] | None = Field(None, max_length=MAX_DIMS,
                                    description="required for a flat list of a >1-D tensor")
    dtype: Dtype = "float32"


class OpRequest(_Strict):
    """Inputs and options of one operator call."""

    inputs: list[TensorIn] = Field(description="positional tensor inputs")
    out_dtype: Dtype | None = Field(None, description="output dtype (default: promoted inputs)")
    scalars: dict[str, float] = Field({}, description="named parameters, e.g. {'eps': 1e-5}")
    dims: list[int] | None = Field(None, description="sum/mean: dims to reduce (default all)")
    keepdim: bool = False


class TensorOut(BaseModel):
    """A result tensor: its elements in row-major order, shape and dtype."""

    data: list[float | NonFinite] = Field(description='row-major; non-finite values as "NaN", '
                                                      '"Infinity", "-Infinity"')
    shape: list[int]
    dtype: Dtype


class OpResponse(BaseModel):
    """The result of one call and what computed it."""

    op: str
    version: int = Field(description="operator version that computed this result")
    output: TensorOut
    replica: str = Field(description="the replica that answered")


class ScalarInfo(BaseModel):
    name: str
    default: float | None = Field(description="None: required (or derived from the inputs)")


class OpInfo(BaseModel):
    """One operator of the catalogue or registry, as callers see it."""

    name: str
    family: str
    arity: int = Field(description="most tensor inputs")
    min_inputs: int
    scalars: list[ScalarInfo]
    version: int = Field(description="active version")
    source: str = Field(description="expression of the active version, or 'catalogue'")


class OpsResponse(BaseModel):
    backend: str
    ops: list[OpInfo]


def op_infos(table: OpTable) -> list[OpInfo]:
    """Every operator's interface and active version, by name."""
    infos = []
    for name in sorted(table.names()):
        current = table.current(name)
        spec = current.spec
        scalars = [ScalarInfo(name=p.name, default=p.default) for p in spec.scalars]
        infos.append(OpInfo(name=name, family=spec.family, arity=spec.arity,
                            min_inputs=spec.min_inputs, scalars=scalars,
                            version=current.version, source=spec.source))
    return infos


# -- health and statistics ---------------------------------------------------------------------
class HealthResponse(BaseModel):
    """Body of `GET /healthz`."""

    status: Literal["ok"]
    backend: str  # the backend the replica serves with


class ReadyResponse(BaseModel):
    """Body of `GET /readyz` (503 with `ready: false` and the reason when not ready)."""

    ready: bool
    replica: str
    registry_seq: int
    reason: str | None = None


class ReplicaStats(BaseModel):
    """One replica's coalescer counters since it started."""

    replica: str
    requests: int
    batches: int
    tasks: int
    mean_batch_size: float
    max_batch_seen: int
    rejected: int
    expired: int
    queue_depth: int
    sizes: dict[int, int] = Field(description="batch size -> submissions of that size")
    config: CoalescerConfig
    llm_steps: int = Field(0, description="LLM engine steps (every running request advances)")
    llm_tokens: int = Field(0, description="tokens the LLM engine generated")
    llm_running: int = Field(0, description="completions decoding now (KV slots in use)")
    llm_waiting: int = Field(0, description="completions waiting for a KV slot")


class StatsTotal(BaseModel):
    requests: int
    batches: int
    tasks: int
    mean_batch_size: float = Field(description="tasks per runtime submission, all replicas")
    llm_steps: int = 0
    llm_tokens: int = 0


class StatsResponse(BaseModel):
    """Counters of every replica and their sum (take differences between two reads)."""

    replicas: list[ReplicaStats]
    total: StatsTotal


def stats_total(replicas: list[ReplicaStats]) -> StatsTotal:
    batches = sum(r.batches for r in replicas)
    tasks = sum(r.tasks for r in replicas)
    return StatsTotal(requests=sum(r.requests for r in replicas), batches=batches, tasks=tasks,
                      mean_batch_size=tasks / batches if batches else 0.0,
                      llm_steps=sum(r.llm_steps for r in replicas),
                      llm_tokens=sum(r.llm_tokens for r in replicas))


# -- admin -------------------------------------------------------------------------------------
class RegisterRequest(_Strict):
    name: str = Field(description="lower-case identifier, at most 48 characters")
    expression: str = Field(description="elementwise expression over A, B, C and s0..s3")
    arity: int | None = Field(None, ge=1, le=3, description="tensor inputs (default: as used)")
    cuda: str | None = Field(None, description="raw CUDA functor body, `expression` then being "
                                               "its reference (needs allow_raw_cuda)")


class SwapRequest(_Strict):
    expression: str = Field(description="the new version's expression (same inputs)")
    cuda: str | None = Field(None, description="raw CUDA functor body (needs allow_raw_cuda)")
    allow_nonfinite: bool = Field(False, description="accept a version that is NaN or infinite "
                                                     "where the current one is finite")


class CoalescerUpdate(_Strict):
    """Knobs to change on every replica; omitted ones keep their value."""

    enabled: bool | None = None
    max_batch: MaxBatch | None = None
    window_us: WindowUs | None = None
    max_queue: MaxQueue | None = None
    deadline_ms: DeadlineMs | None = None


class AdminOp(BaseModel):
    """An operator's versions: every one made (history) and the activation stack."""

    name: str
    family: str
    current: int
    previous: int | None
    active: list[int] = Field(description="activation stack, oldest first; rollback pops")
    history: list[VersionRecord]
    changes: list[ChangeRecord] = Field(description="its registers, swaps and rollbacks, oldest "
                                                    "first: who made each and why")


class ReplicaReport(BaseModel):
    """What one replica has applied."""

    replica: str
    registry_seq: int
    versions: dict[str, int] = Field(description="operator -> active version")
    diverged: str | None = Field(description="why the registry could not be applied, if so")
    coalescer: CoalescerConfig


class ReplicasResponse(BaseModel):
    """Every replica's report, and the replicas that did not answer (with why)."""

    replicas: list[ReplicaReport]
    unreachable: list[str]


class CanaryReport(BaseModel):
    """A swap's new version beside the one it replaced, on the canary inputs (all dtypes)."""

    max_abs_deviation: float = Field(description="largest |new - current| where both are finite")
    nonfinite: int = Field(description="elements NaN or infinite in the new version, finite in "
                                       "the current (only with allow_nonfinite)")
    cases: int = Field(description="input cases times dtypes compared")


class ChangeResponse(BaseModel):
    """The outcome of a register, swap or rollback."""

    action: Action
    op: AdminOp
    version: int = Field(description="the version now active")
    registry_seq: int
    replicas: list[ReplicaReport]
    unreachable: list[str] = Field(description="replicas that did not confirm (they catch up on "
                                               "their next health check)")
    canary: CanaryReport | None = Field(None, description="swaps: the new version beside the "
                                                          "current one")


def canary_report(comparison: Comparison) -> CanaryReport:
    return CanaryReport(max_abs_deviation=comparison.max_abs_deviation,
                        nonfinite=comparison.nonfinite, cases=len(comparison.cases))


def admin_op(table: OpTable, name: str, log: tuple[ChangeRecord, ...] = ()) -> AdminOp:
    """`name`'s history and activation stack as `table` has it, and its records in `log`."""
    history = table.history[name]
    previous = table.previous(name)
    return AdminOp(name=name, family=history[0].spec.family,
                   current=table.current(name).version,
                   previous=previous.version if previous else None,
                   active=[v.version for v in table.active[name]],
                   history=[version_record(v) for v in history],
                   changes=[r for r in log if r.op == name])


# -- errors ------------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    """Every error of these routes: the error's class, a message, and its public fields."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="the error's class, e.g. TensorDataError")
    detail: str = Field(description="what was wrong and what to do about it")


class OpenAIErrorFields(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, server_busy or server_error")
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """Errors of the OpenAI-compatible routes, in OpenAI's shape."""

    error: OpenAIErrorFields


def error_responses(*statuses: int, openai: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses a route answers with, in its body shape."""
    model = OpenAIErrorBody if openai else ErrorBody
    return {status: {"model": model, "description": HTTPStatus(status).phrase}
            for status in statuses}


# -- tensors -----------------------------------------------------------------------------------
def to_call(op: str, request: OpRequest, max_elements: int, device: torch.device) -> OpCall:
    """The runtime call a request describes, its tensors on `device` (the runtime's);
    RequestTooLargeError past `max_elements` in all."""
    inputs, left = [], max_elements
    for i, spec in enumerate(request.inputs):
        x = to_tensor(spec, f"input {i}", device)
        left -= x.numel()
        if left < 0:
            raise RequestTooLargeError(f"the inputs have more than {max_elements} elements in all; "
                                       "split the request")
        inputs.append(x)
    return OpCall(op, tuple(inputs), scalars=request.scalars,
                  dims=tuple(request.dims) if request.dims is not None else None,
                  keepdim=request.keepdim,
                  out_dtype=DTYPES[request.out_dtype] if request.out_dtype else None)


def check_output_size(spec: OpSpec, call: OpCall, max_elements: int) -> None:
    """RequestTooLargeError when `call`'s result would have more than `max_elements` elements
    (broadcasting [n, 1] with [1, n], or a linear layer, multiplies small inputs)."""
    try:
        shape = spec.kind.layout(call.inputs, call.dims, call.keepdim).out_shape
    except Exception:  # a call that does not fit: runtime.prepare says why, with the right class
        return
    if math.prod(shape) > max_elements:
        raise RequestTooLargeError(f"the result would have shape {list(shape)}, more than "
                                   f"{max_elements} elements; split the request")


def to_tensor(spec: TensorIn, what: str, device: torch.device) -> torch.Tensor:
    """A tensor on `device` from its JSON form; TensorDataError says what does not fit. The copy
    to a GPU runs on this thread's torch stream, which the runtime orders its batch after."""
    array = _array(spec.data, what)
    if spec.shape is not None and list(array.shape) != spec.shape:
        array = _reshaped(array, spec.shape, what)
    return torch.from_numpy(array).to(device=device, dtype=DTYPES[spec.dtype])


def _array(data: list[Any], what: str) -> np.ndarray:
    """float32 array of numbers in evenly nested lists, strings standing for non-finite values."""
    try:
        array = np.asarray(data)  # numbers only: an int or float array, at C speed
        if array.dtype.kind not in "iuf":  # strings, nulls, booleans: look at each element
            array = np.vectorize(_number, otypes=[np.float64])(np.asarray(data, dtype=object))
        return array.astype(np.float32)
    except (ValueError, TypeError, OverflowError) as exc:
        raise TensorDataError(f"{what}: data must be numbers in evenly nested lists "
                              f"({exc})") from None


def _number(value: object) -> float:
    """One element: a number, or a string naming a non-finite one; ValueError says why not."""
    if type(value) in (int, float):  # not bool
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value in NONFINITE:
        return NONFINITE[value]
    if value is None:
        raise ValueError('null is not a number; send NaN as "NaN" (infinities as "Infinity", '
                         '"-Infinity")')
    raise ValueError(f"got {type(value).__name__} {str(value)[:40]!r}")


def _reshaped(array: np.ndarray, shape: list[int], what: str) -> np.ndarray:
    if array.ndim != 1 or array.size != math.prod(shape):
        raise TensorDataError(f"{what}: data of shape {list(array.shape)} does not fit shape "
                              f"{shape}; give nested lists of that shape or a flat list of its "
                              "size")
    return array.reshape(shape)


def from_tensor(x: torch.Tensor) -> TensorOut:
    """The JSON form of a result (values converted to float for fp16/bf16; non-finite ones as
    strings)."""
    values = x.detach().float().reshape(-1).cpu().numpy()
    data: list[Any] = values.tolist()
    for i in np.flatnonzero(~np.isfinite(values)):
        data[i] = finite_json(data[i])
    # Built, not validated: a million floats took 200 ms of the event loop to check.
    return TensorOut.model_construct(data=data, shape=list(x.shape), dtype=DTYPE_NAMES[x.dtype])
