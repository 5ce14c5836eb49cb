"""HTTP request and response bodies (pydantic; they make the OpenAPI docs at /docs). The conversion
between these tensors and torch tensors is serving/tensors.py.

A tensor travels in one of two encodings: nested lists of numbers (`TensorIn`, `TensorOut`), or
its little-endian bytes in base64 with dtype and shape (`TensorB64`), which costs no Python per
element. JSON has no NaN or infinity: lists write them as the strings "NaN", "Infinity" and
"-Infinity", in answers and in requests (which also take the bare literals NaN and Infinity some
encoders write); null is refused, as it could mean any of them or a missing value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from gpuos_core.canary import Comparison
from gpuos_core.errors import UnknownOperatorError
from gpuos_core.optable import OpTable, OpVersion

from .config import CoalescerConfig, DeadlineMs, MaxBatch, MaxQueue, WindowUs
from .registry import Action, ChangeRecord, VersionRecord, version_record

Dtype = Literal["float32", "float16", "bfloat16"]
DTYPES: Mapping[Dtype, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: Mapping[torch.dtype, Dtype] = {v: k for k, v in DTYPES.items()}
Encoding = Literal["list", "b64"]
NonFinite = Literal["NaN", "Infinity", "-Infinity"]
NONFINITE: Mapping[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
MAX_DIMS = 8  # more than any operator takes (the runtime says which)
MAX_BATCH_CALLS = 256  # calls in one POST /v1/batch (max_ongoing_requests of the shipped configs)
Dim = Annotated[int, Field(ge=0, le=2**31 - 1)]
Shape = Annotated[list[Dim], Field(max_length=MAX_DIMS)]


class _Strict(BaseModel):
    """A request body: unknown keys refused, and no coercion (a boolean is not a number, a
    string not a boolean), so what the OpenAPI schema refuses the server refuses too."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- inference ---------------------------------------------------------------------------------
class TensorIn(_Strict):
    """A tensor in JSON: nested lists (row-major), or a flat list with its shape."""

    data: list[Any] = Field(
        description="nested lists of numbers, or a flat list with `shape`; "
        '"NaN", "Infinity", "-Infinity" for non-finite values'
    )
    shape: Shape | None = Field(None, description="required for a flat list of a >1-D tensor")
    dtype: Dtype = "float32"


class TensorB64(_Strict):
    """A tensor as its bytes: row-major, little-endian, in standard base64 with padding (RFC 4648,
    section 4). Its byte count must be the product of `shape` times the dtype's size (4 for
    float32, 2 for float16 and bfloat16)."""

    b64: str = Field(description="base64 of the tensor's little-endian bytes, row-major")
    shape: Shape = Field(description="the tensor's shape ([] for a single number)")
    dtype: Dtype = "float32"


def _encoding_of(value: Any) -> Encoding:
    """Which tensor model a request's tensor is: b64 when it has that key."""
    has_b64 = isinstance(value, TensorB64) or (isinstance(value, dict) and "b64" in value)
    return "b64" if has_b64 else "list"


TensorInput = Annotated[
    Annotated[TensorIn, Tag("list")] | Annotated[TensorB64, Tag("b64")], Discriminator(_encoding_of)
]


class OpRequest(_Strict):
    """Inputs and options of one operator call."""

    inputs: list[TensorInput] = Field(description="positional tensor inputs, each as lists or b64")
    out_dtype: Dtype | None = Field(None, description="output dtype (default: promoted inputs)")
    out_encoding: Encoding | None = Field(
        None, description="the result's encoding (default: b64 if an input is b64, else list)"
    )
    scalars: dict[str, float] = Field({}, description="named parameters, e.g. {'eps': 1e-5}")
    dims: list[int] | None = Field(None, description="sum/mean: dims to reduce (default all)")
    keepdim: bool = False


class TensorOut(BaseModel):
    """A result tensor as lists: its elements in row-major order, shape and dtype."""

    data: list[float | NonFinite] = Field(
        description='row-major; non-finite values as "NaN", "Infinity", "-Infinity"'
    )
    shape: list[int]
    dtype: Dtype


class TensorB64Out(BaseModel):
    """A result tensor as bytes, encoded as `TensorB64` (in its own dtype)."""

    b64: str
    shape: list[int]
    dtype: Dtype


class OpResult(BaseModel):
    """One call's result and what computed it."""

    op: str
    version: int = Field(description="operator version that computed this result")
    output: TensorOut | TensorB64Out


class OpResponse(OpResult):
    """The answer to POST /v1/ops/{op}."""

    replica: str = Field(description="the replica that answered")


class BatchCall(OpRequest):
    """One call of a batch: the operator and its request."""

    op: str = Field(description="the operator, as in POST /v1/ops/{op}")


class BatchRequest(_Strict):
    """Many operator calls in one request, coalesced with each other and with other requests."""

    calls: list[BatchCall] = Field(min_length=1, max_length=MAX_BATCH_CALLS)


class CallDone(OpResult):
    """A batch call that succeeded."""

    status: Literal[200]


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


def served(table: OpTable, name: str) -> OpVersion:
    """The active version of operator `name` where the data plane serves it, else
    UnknownOperatorError (404) naming those it serves."""
    stack = table.active.get(name)
    if stack and not stack[-1].spec.kind.internal:
        return stack[-1]
    what = (
        f"operator {name!r} is internal to the LLM engine"
        if stack
        else f"unknown operator {name!r}"
    )
    raise UnknownOperatorError(f"{what}; served: {', '.join(served_names(table))}")


def served_names(table: OpTable) -> list[str]:
    """The operators the data plane serves, by name: all but the LLM engine's internal ones."""
    return [n for n in sorted(table.names()) if not table.current(n).spec.kind.internal]


def op_infos(table: OpTable) -> list[OpInfo]:
    """Every served operator's interface and active version, by name."""
    infos = []
    for name in served_names(table):
        current = table.current(name)
        spec = current.spec
        scalars = [ScalarInfo(name=p.name, default=p.default) for p in spec.scalars]
        infos.append(
            OpInfo(
                name=name,
                family=spec.family,
                arity=spec.arity,
                min_inputs=spec.min_inputs,
                scalars=scalars,
                version=current.version,
                source=spec.source,
            )
        )
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
    llm_launches: int = Field(
        0, description="LLM step programs launched (one runs up to llm.decode_steps steps)"
    )
    llm_tokens: int = Field(0, description="tokens the LLM engine generated")
    llm_running: int = Field(0, description="completions decoding now (KV slots in use)")
    llm_waiting: int = Field(0, description="completions waiting for a KV slot")
    llm_programs: int = Field(
        0, description="LLM step programs built (one per new step layout; its step waits)"
    )
    llm_program_build_ms: int = Field(0, description="milliseconds spent building them")
    llm_step_host_ms: int = Field(
        0,
        description="milliseconds of the LLM step loop besides its waits for a launched step's "
        "tokens: scheduling, writing and publishing steps, reading tokens back, streaming text",
    )
    llm_step_wait_ms: int = Field(
        0,
        description="milliseconds the LLM step loop waited for a launched step's tokens (a "
        "small share while requests run: the host, not the device, bounds the steps)",
    )


class StatsTotal(BaseModel):
    requests: int
    batches: int
    tasks: int
    mean_batch_size: float = Field(description="tasks per runtime submission, all replicas")
    llm_steps: int = 0
    llm_launches: int = 0
    llm_tokens: int = 0
    llm_programs: int = 0
    llm_program_build_ms: int = 0
    llm_step_host_ms: int = 0
    llm_step_wait_ms: int = 0


class StatsResponse(BaseModel):
    """Counters of every replica and their sum (take differences between two reads)."""

    replicas: list[ReplicaStats]
    total: StatsTotal


def stats_total(replicas: list[ReplicaStats]) -> StatsTotal:
    batches = sum(r.batches for r in replicas)
    tasks = sum(r.tasks for r in replicas)
    return StatsTotal(
        requests=sum(r.requests for r in replicas),
        batches=batches,
        tasks=tasks,
        mean_batch_size=tasks / batches if batches else 0.0,
        **{  # every LLM counter, summed
            name: sum(getattr(r, name) for r in replicas)
            for name in StatsTotal.model_fields
            if name.startswith("llm_")
        },
    )


# -- admin -------------------------------------------------------------------------------------
class RegisterRequest(_Strict):
    name: str = Field(description="lower-case identifier, at most 48 characters")
    expression: str = Field(description="elementwise expression over A, B, C and s0..s3")
    arity: int | None = Field(None, ge=1, le=3, description="tensor inputs (default: as used)")
    cuda: str | None = Field(
        None,
        description="raw CUDA functor body, `expression` then being "
        "its reference (needs allow_raw_cuda)",
    )


class SwapRequest(_Strict):
    expression: str = Field(description="the new version's expression (same inputs)")
    cuda: str | None = Field(None, description="raw CUDA functor body (needs allow_raw_cuda)")
    allow_nonfinite: bool = Field(
        False,
        description="accept a version that is NaN or infinite where the current one is finite",
    )


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
    changes: list[ChangeRecord] = Field(
        description="its registers, swaps and rollbacks, oldest first: who made each and why"
    )


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
    nonfinite: int = Field(
        description="elements NaN or infinite in the new version, finite in "
        "the current (only with allow_nonfinite)"
    )
    cases: int = Field(description="input cases times dtypes compared")


class ChangeResponse(BaseModel):
    """The outcome of a register, swap or rollback."""

    action: Action
    op: AdminOp
    version: int = Field(description="the version now active")
    registry_seq: int
    replicas: list[ReplicaReport]
    unreachable: list[str] = Field(
        description="replicas that did not confirm (they catch up on their next health check)"
    )
    canary: CanaryReport | None = Field(
        None, description="swaps: the new version beside the current one"
    )


def canary_report(comparison: Comparison) -> CanaryReport:
    return CanaryReport(
        max_abs_deviation=comparison.max_abs_deviation,
        nonfinite=comparison.nonfinite,
        cases=len(comparison.cases),
    )


def admin_op(table: OpTable, name: str, log: tuple[ChangeRecord, ...] = ()) -> AdminOp:
    """`name`'s history and activation stack as `table` has it, and its records in `log`."""
    history = table.history[name]
    previous = table.previous(name)
    return AdminOp(
        name=name,
        family=history[0].spec.family,
        current=table.current(name).version,
        previous=previous.version if previous else None,
        active=[v.version for v in table.active[name]],
        history=[version_record(v) for v in history],
        changes=[r for r in log if r.op == name],
    )


# -- errors ------------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    """Every error of these routes: the error's class, a message, and its public fields."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="the error's class, e.g. TensorDataError")
    detail: str = Field(description="what was wrong and what to do about it")


class CallFailed(ErrorBody):
    """A batch call that failed: the status and the error body POST /v1/ops/{op} would have
    answered it with, and its operator."""

    status: int = Field(description="the HTTP status this call alone would have got")
    op: str


class BatchResponse(BaseModel):
    """One entry per call, in the order of the calls."""

    results: list[CallDone | CallFailed]
    replica: str = Field(description="the replica that answered")


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
    return {
        status: {"model": model, "description": HTTPStatus(status).phrase} for status in statuses
    }
