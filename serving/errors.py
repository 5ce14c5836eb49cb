"""Errors of the Serve layer and the one place that turns any error into an HTTP answer.

Statuses are declared per class in STATUS, looked up along the exception's MRO (a subclass defined
elsewhere inherits its base's status, but every error class of this project is listed: a test
checks it). What the caller got wrong is 4xx; what failed on our side (the runtime, the device, a
wait, the registry file) is 500 or 503, never 4xx; an exception nobody declared is a bug: 500.

Two body shapes, chosen by route (README, "Errors"):
- ours, `{"error": class name, "detail": message, ...}` plus the error's public fields
  (ExpressionError's `position`, CompileError's `log`, the canary's `cases`, a validation's
  `errors`);
- OpenAI's, `{"error": {"message", "type", "param", "code"}}`, on /v1/completions and /v1/models,
  so that OpenAI's clients raise their usual exceptions.
Floats that are NaN or infinite are written as the strings "NaN", "Infinity", "-Infinity".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

import pydantic
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gpuos_core import errors as core
from gpuos_core.backends.cudadrv import CudaError
from serving.llm.engine import (
    EngineClosedError,
    EngineFullError,
    KVMemoryError,
    NonFiniteLogitsError,
    PromptTooLongError,
)
from serving.llm.model import KVCacheFullError, ModelLoadError
from serving.llm.sampling import SamplingError

RETRY_AFTER_S = 1  # what a 503 tells the client to wait
# Routes that answer errors in OpenAI's shape.
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class ServingError(Exception):
    """Base class of the errors the Serve layer raises on purpose."""


class RequestTooLargeError(ServingError):
    """A request carries more tensor elements (or body bytes) than the replica accepts."""


class TensorDataError(ServingError, ValueError):
    """A JSON tensor cannot be built: ragged nesting, non-numbers, or data not matching shape."""


class QueueFullError(ServingError):
    """The coalescer's queue is full; retry after a moment (HTTP 503 with Retry-After)."""


class DeadlineExceededError(ServingError, TimeoutError):
    """A request was not answered within the coalescer's deadline (HTTP 504)."""


class AdminAuthError(ServingError):
    """An /admin request without the right bearer token; `status` is 401 or 403."""

    def __init__(self, message: str, status: int) -> None:
        self.status = status
        super().__init__(message)


class RegistryError(ServingError):
    """The operator registry's state file cannot be read or written."""


class RegistryDivergedError(ServingError):
    """A replica's operators cannot be brought to the registry's state (restart the replica)."""


class ModelNotFoundError(ServingError):
    """The request names a model this deployment does not serve (HTTP 404)."""


class EngineFailedError(ServingError):
    """The engine failed while generating (HTTP 500; the replica keeps serving)."""


class ReplicaLostError(ServingError):
    """The replica making a completion failed and the gateway found none to finish it in time
    (HTTP 503, or an error event in a stream already begun)."""


class UnsupportedParameterError(ServingError, ValueError):
    """An OpenAI parameter this server does not implement, set to a non-default value (400)."""

    def __init__(self, message: str, param: str) -> None:
        self.param = param
        super().__init__(message)


STATUS: Mapping[type[BaseException], int] = {
    # the request is wrong: the caller's to fix
    AdminAuthError: 401,  # refined per instance (401 missing, 403 wrong or disabled)
    core.RawCudaDisabledError: 403,
    core.UnknownOperatorError: 404,
    ModelNotFoundError: 404,
    core.ExpressionError: 400,
    core.CompileError: 400,  # the compiler's log says what in the source is wrong
    core.LinkError: 400,  # raw CUDA calling what does not exist
    UnsupportedParameterError: 400,
    PromptTooLongError: 400,
    SamplingError: 400,
    core.OperatorExistsError: 409,
    core.RollbackError: 409,
    RequestTooLargeError: 413,
    TensorDataError: 422,
    core.TensorSpecError: 422,
    core.CanaryMismatchError: 422,  # the candidate disagrees with its own reference
    core.CanaryCrashError: 422,  # the candidate faults or hangs: the old version keeps serving
    core.NonFiniteOutputError: 422,
    pydantic.ValidationError: 422,  # a value outside its allowed range
    RequestValidationError: 422,
    # the server failed: runtime, device, waits, files; retry later (503) or report (500)
    core.TaskFailedError: 500,
    core.ProgramError: 500,  # a device program built wrong: our code, not the request
    NonFiniteLogitsError: 500,
    CudaError: 500,
    ModelLoadError: 500,
    KVMemoryError: 500,  # at start: the pool does not fit; its message names the settings
    RegistryError: 500,
    EngineFailedError: 500,
    core.WaitTimeoutError: 503,
    core.StalledWorkerError: 503,
    core.RuntimeClosedError: 503,
    core.BackendUnavailableError: 503,
    RegistryDivergedError: 503,
    QueueFullError: 503,
    ReplicaLostError: 503,
    KVCacheFullError: 503,
    EngineFullError: 503,
    EngineClosedError: 503,
    DeadlineExceededError: 504,
}
# Raised on purpose: their answers say why.
OURS: tuple[type[BaseException], ...] = (core.GpuosError, ServingError, HTTPException, *STATUS)


def status_of(exc: BaseException) -> int:
    """HTTP status for `exc`: its class's (or nearest base's) entry in STATUS, else 500."""
    if isinstance(exc, AdminAuthError):
        return exc.status
    if isinstance(exc, HTTPException):
        return exc.status_code
    return next((STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS), 500)


def error_body(exc: BaseException, status: int) -> dict[str, Any]:
    """Our JSON body for `exc`: its class, message and public scalar fields. An exception raised
    by no code of ours (a bug) names no internals: the replica's log has the traceback."""
    if not isinstance(exc, OURS):
        return {
            "error": "InternalError",
            "detail": f"unexpected {type(exc).__name__}; the replica's log has the details",
        }
    if isinstance(exc, HTTPException):
        return {"error": _http_name(status), "detail": str(exc.detail)}
    body: dict[str, Any] = {"error": type(exc).__name__, "detail": message_of(exc)}
    errors = _validation_errors(exc)
    if errors:
        body["errors"] = errors
    if isinstance(exc, (core.GpuosError, ServingError)):  # their attributes are for callers
        for key, value in vars(exc).items():
            if not key.startswith("_") and key not in body and key != "status" and _plain(value):
                body[key] = finite_json(value)
    return body


def openai_body(exc: BaseException, status: int) -> dict[str, Any]:
    """OpenAI's error body for `exc`."""
    message, param = message_of(exc), getattr(exc, "param", None)
    errors = _validation_errors(exc)
    if errors:
        param = ".".join(str(p) for p in errors[0]["loc"]) or None
    if not isinstance(exc, OURS):
        message = error_body(exc, status)["detail"]
    kind = (
        "invalid_request_error"
        if status < 500
        else "server_busy"
        if status == 503
        else "server_error"
    )
    code = "model_not_found" if isinstance(exc, ModelNotFoundError) else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: BaseException, path: str) -> JSONResponse:
    """The HTTP answer for `exc` on a request for `path`: its status, the route's body shape,
    Retry-After on 503, a challenge on 401, Allow on 405."""
    status = status_of(exc)
    if path.rstrip("/").endswith(OPENAI_PATHS) or path.startswith("/v1/models/"):
        if isinstance(exc, (RequestValidationError, pydantic.ValidationError)):
            status = 400  # OpenAI answers every malformed request with 400
        body = openai_body(exc, status)
    else:
        body = error_body(exc, status)
    headers = dict(getattr(exc, "headers", None) or {})
    if status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status, headers=headers)


def message_of(exc: BaseException) -> str:
    """One line a person can act on; validation errors name the first bad field."""
    errors = _validation_errors(exc)
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(exc)


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinite float written as "NaN", "Infinity" or "-Infinity"
    (JSON has no such numbers; a plain encoder writes null for all three)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _validation_errors(exc: BaseException) -> list[dict[str, Any]]:
    """pydantic's or FastAPI's validation errors as [{"loc", "msg", "type"}], body prefix cut."""
    if not isinstance(exc, (RequestValidationError, pydantic.ValidationError)):
        return []
    found = []
    for error in exc.errors():
        loc, msg = list(error.get("loc", ())), error["msg"]
        if error["type"] == "json_invalid":  # FastAPI's loc holds a meaningless offset there
            loc, msg = [], error.get("ctx", {}).get("error", msg)
        found.append(
            {"loc": loc[1:] if loc[:1] == ["body"] else loc, "msg": msg, "type": error["type"]}
        )
    return found


def _http_name(status: int) -> str:
    """'NotFound' for 404, 'MethodNotAllowed' for 405: routing errors have no class of ours."""
    return HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")


def _plain(value: object) -> bool:
    """Plain JSON data (a position, a compiler log, a canary's cases), not objects."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, dict) and all(
        isinstance(k, str) and _plain(v) for k, v in value.items()
    )
