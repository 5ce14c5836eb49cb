"""HTTP request and response bodies (pydantic; they make the OpenAPI docs at /docs) and the
conversion between JSON tensors and torch tensors."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from gpuos_core import OpCall
from gpuos_core.optable import OpTable

from .config import CoalescerConfig
from .errors import RequestTooLargeError, TensorDataError
from .registry import VersionRecord, version_record

Dtype = Literal["float32", "float16", "bfloat16"]
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES: Mapping[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- inference ---------------------------------------------------------------------------------
class TensorIn(_Strict):
    """A tensor in JSON: nested lists (row-major), or a flat list with its shape."""

    data: list[Any] = Field(description="nested lists of numbers, or a flat list with `shape`")
    shape: list[int] | None = Field(None, description="required for a flat list of a >1-D tensor")
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

    data: list[float]
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


class CoalescerUpdate(_Strict):
    """Knobs to change on every replica; omitted ones keep their value."""

    enabled: bool | None = None
    max_batch: int | None = None
    window_us: int | None = None
    max_queue: int | None = None
    deadline_ms: int | None = None


class AdminOp(BaseModel):
    """An operator's versions: every one made (history) and the activation stack."""

    name: str
    family: str
    current: int
    previous: int | None
    active: list[int] = Field(description="activation stack, oldest first; rollback pops")
    history: list[VersionRecord]


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


class ChangeResponse(BaseModel):
    """The outcome of a register, swap or rollback."""

    action: Literal["register", "swap", "rollback"]
    op: AdminOp
    version: int = Field(description="the version now active")
    registry_seq: int
    replicas: list[ReplicaReport]
    unreachable: list[str] = Field(description="replicas that did not confirm (they catch up on "
                                               "their next health check)")


def admin_op(table: OpTable, name: str) -> AdminOp:
    """`name`'s history and activation stack as `table` has it."""
    history = table.history[name]
    previous = table.previous(name)
    return AdminOp(name=name, family=history[0].spec.family,
                   current=table.current(name).version,
                   previous=previous.version if previous else None,
                   active=[v.version for v in table.active[name]],
                   history=[version_record(v) for v in history])


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


def to_tensor(spec: TensorIn, what: str, device: torch.device) -> torch.Tensor:
    """A tensor on `device` from its JSON form; TensorDataError says what does not fit. The copy
    to a GPU runs on this thread's torch stream, which the runtime orders its batch after."""
    try:
        array = np.asarray(spec.data, dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise TensorDataError(f"{what}: data must be numbers in evenly nested lists "
                              f"({exc})") from None
    if spec.shape is not None and list(array.shape) != spec.shape:
        array = _reshaped(array, spec.shape, what)
    return torch.from_numpy(array).to(device=device, dtype=DTYPES[spec.dtype])


def _reshaped(array: np.ndarray, shape: list[int], what: str) -> np.ndarray:
    if array.ndim != 1 or any(n < 0 for n in shape) or array.size != int(np.prod(shape)):
        raise TensorDataError(f"{what}: data of shape {list(array.shape)} does not fit shape "
                              f"{shape}; give nested lists of that shape or a flat list of its "
                              "size")
    return array.reshape(shape)


def from_tensor(x: torch.Tensor) -> TensorOut:
    """The JSON form of a result (values converted to float for fp16/bf16)."""
    return TensorOut(data=x.detach().float().reshape(-1).tolist(), shape=list(x.shape),
                     dtype=DTYPE_NAMES[x.dtype])
