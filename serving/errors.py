"""Errors of the Serve layer and the one place that turns any expected error into an HTTP answer.

Statuses are looked up by class name along the exception's MRO, so an error class the runtime adds
later maps correctly without importing it, and a subclass of a mapped class
inherits its status. The body is `{"error": class name, "detail": message, ...}` plus the error's
public fields (ExpressionError's `position`, CompileError's `log`, CanaryMismatchError's `cases`).
"""
from __future__ import annotations

import json

import pydantic
from fastapi.responses import JSONResponse

from gpuos_core import GpuosError

# Status per error class name; the first class of the MRO found here wins.
STATUS: dict[str, int] = {
    "AdminAuthError": 401,          # refined per instance (401 missing, 403 wrong or disabled)
    "RequestTooLargeError": 413,
    "TensorDataError": 422,
    "ValidationError": 422,         # pydantic: a value outside its allowed range
    "UnknownOperatorError": 404,
    "TensorSpecError": 422,
    "ExpressionError": 400,
    "CompileError": 400,
    "LinkError": 400,
    "CanaryMismatchError": 422,
    "CanaryCrashError": 422,
    "RawCudaDisabledError": 403,
    "OperatorExistsError": 409,
    "RollbackError": 409,
    "QueueFullError": 503,
    "DeadlineExceededError": 504,
    "RuntimeClosedError": 503,
    "StalledWorkerError": 503,
    "BackendUnavailableError": 503,
    "RegistryDivergedError": 503,
    "RegistryError": 500,
    "TaskFailedError": 500,
    "ModelNotFoundError": 404,
    "UnsupportedParameterError": 400,
    "PromptTooLongError": 400,
    "SamplingError": 400,
    "EngineFullError": 503,
    "EngineClosedError": 503,
    "EngineFailedError": 500,
    "GpuosError": 400,  # raised on purpose and says what to fix: the caller's to fix
}
RETRY_AFTER_S = 1  # what a 503 tells the client to wait


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


def status_of(exc: BaseException) -> int | None:
    """HTTP status for an expected error, or None for anything else (a bug: let it be a 500)."""
    if isinstance(exc, AdminAuthError):
        return exc.status
    for cls in type(exc).__mro__:
        if cls.__name__ in STATUS:
            return STATUS[cls.__name__]
    return None


def error_body(exc: BaseException) -> dict[str, object]:
    """The JSON body describing `exc`: its class, message and public scalar fields."""
    body: dict[str, object] = {"error": type(exc).__name__, "detail": str(exc)}
    for key, value in getattr(exc, "__dict__", {}).items():
        if not key.startswith("_") and key not in body and _jsonable(value):
            body[key] = value
    return body


def error_response(exc: BaseException, status: int) -> JSONResponse:
    """The HTTP answer for `exc` with `status` (Retry-After on 503, a challenge on 401)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(exc), status_code=status, headers=headers)


# The classes the app's handlers answer; anything else is a bug and stays a 500.
EXPECTED = (GpuosError, ServingError, pydantic.ValidationError)


def _jsonable(value: object) -> bool:
    """Plain JSON data (a position, a compiler log, a canary's cases), not objects."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
