"""Error → HTTP answer: every error class of the project has a declared status, what the caller
got wrong is 4xx, what failed on our side (runtime, device, waits, files) is 5xx, and the bodies
keep their shapes (ours, OpenAI's) with non-finite numbers written distinguishably."""

from __future__ import annotations

import json
import math

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

import serving.app  # noqa: F401  (imports every module that defines an error class)
from gpuos_core import errors as core
from gpuos_core.backends.cudadrv import CudaError
from gpuos_core.optable import catalogue_table
from serving import errors as serving_errors
from serving.errors import (
    STATUS,
    AdminAuthError,
    EngineFailedError,
    ModelNotFoundError,
    ServingError,
    TensorDataError,
    error_body,
    error_response,
    finite_json,
    openai_body,
    status_of,
)
from serving.llm.engine import (
    EngineClosedError,
    EngineFullError,
    KVMemoryError,
    NonFiniteLogitsError,
    PromptTooLongError,
)
from serving.llm.model import KVCacheFullError, ModelLoadError
from serving.llm.sampling import SamplingError
from serving.schemas import served

EXPECTED_STATUS = {  # the contract, class by class
    core.ExpressionError: 400,
    core.CompileError: 400,
    core.LinkError: 400,
    SamplingError: 400,
    PromptTooLongError: 400,
    serving_errors.UnsupportedParameterError: 400,
    core.RawCudaDisabledError: 403,
    core.UnknownOperatorError: 404,
    ModelNotFoundError: 404,
    core.OperatorExistsError: 409,
    core.RollbackError: 409,
    serving_errors.RequestTooLargeError: 413,
    TensorDataError: 422,
    core.TensorSpecError: 422,
    core.CanaryMismatchError: 422,
    core.CanaryCrashError: 422,
    core.NonFiniteOutputError: 422,
    pydantic.ValidationError: 422,
    RequestValidationError: 422,
    # our side: never 4xx
    core.TaskFailedError: 500,
    core.ProgramError: 500,
    CudaError: 500,
    ModelLoadError: 500,
    KVMemoryError: 500,
    serving_errors.RegistryError: 500,
    EngineFailedError: 500,
    NonFiniteLogitsError: 500,
    core.WaitTimeoutError: 503,
    core.StalledWorkerError: 503,
    core.RuntimeClosedError: 503,
    core.BackendUnavailableError: 503,
    serving_errors.RegistryDivergedError: 503,
    serving_errors.QueueFullError: 503,
    serving_errors.ReplicaLostError: 503,
    KVCacheFullError: 503,
    EngineFullError: 503,
    EngineClosedError: 503,
    serving_errors.DeadlineExceededError: 504,
}


def project_error_classes() -> set[type[BaseException]]:
    """Every error class defined in gpuos_core or serving (imported above)."""
    found, todo = set(), [core.GpuosError, ServingError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith(("gpuos_core", "serving")):
            found.add(cls)
    return found - {core.GpuosError, ServingError}


def bare(cls: type[BaseException]) -> BaseException:
    """An instance of `cls` without running its constructor: statuses go by class only."""
    if cls is pydantic.ValidationError:  # made by pydantic-core only
        return pydantic.ValidationError.from_exception_data("model", [])
    return cls.__new__(cls)


@pytest.mark.parametrize(
    "cls", sorted(EXPECTED_STATUS, key=lambda c: c.__name__), ids=lambda c: c.__name__
)
def test_each_error_class_has_its_status(cls: type[BaseException]) -> None:
    assert status_of(bare(cls)) == EXPECTED_STATUS[cls]


def test_every_error_class_of_the_project_is_declared() -> None:
    undeclared = {c.__name__ for c in project_error_classes()} - {c.__name__ for c in STATUS}
    assert not undeclared, f"add these to serving.errors.STATUS: {sorted(undeclared)}"
    assert set(STATUS) - {AdminAuthError} == set(EXPECTED_STATUS)  # its status is per instance


def test_an_undeclared_error_is_a_500_whose_body_names_no_internals() -> None:
    class Subclass(core.WaitTimeoutError):
        pass

    assert status_of(Subclass("late")) == 503  # a subclass inherits its base's status
    assert status_of(ZeroDivisionError("x")) == 500
    assert error_body(ZeroDivisionError("secret path /x"), 500) == {
        "error": "InternalError",
        "detail": "unexpected ZeroDivisionError; the replica's log has the details",
    }
    assert status_of(AdminAuthError("wrong", 403)) == 403
    assert status_of(HTTPException(405)) == 405


def test_bodies_carry_public_fields_with_non_finite_numbers_as_strings() -> None:
    cases = [{"rel_error": math.inf, "ok": False}, {"rel_error": math.nan, "x": -math.inf}]
    body = error_body(core.CanaryMismatchError("disagrees", cases), 422)
    assert body == {
        "error": "CanaryMismatchError",
        "detail": "disagrees",
        "cases": [{"rel_error": "Infinity", "ok": False}, {"rel_error": "NaN", "x": "-Infinity"}],
    }
    json.dumps(body, allow_nan=False)
    assert finite_json([1.0, math.nan, (math.inf,)]) == [1.0, "NaN", ["Infinity"]]


def test_the_route_picks_the_shape_and_503_says_when_to_retry() -> None:
    ours = error_response(serving_errors.QueueFullError("full"), "/v1/ops/relu")
    assert ours.status_code == 503 and ours.headers["Retry-After"] == "1"
    assert json.loads(ours.body) == {"error": "QueueFullError", "detail": "full"}
    openai = error_response(ModelNotFoundError("no such model"), "/v1/completions")
    assert json.loads(openai.body) == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    assert openai_body(CudaError("cuMemAlloc failed"), 500)["error"]["type"] == "server_error"
    challenge = error_response(AdminAuthError("missing", 401), "/admin/ops")
    assert challenge.headers["WWW-Authenticate"] == "Bearer"


def test_an_unknown_or_internal_operator_is_404_naming_only_the_served_ones() -> None:
    table = catalogue_table()
    assert served(table, "add").spec.family == table.current("add").spec.family
    for name, what in (
        ("no_such_op", "unknown operator 'no_such_op'"),
        ("tick", "operator 'tick' is internal to the LLM engine"),
    ):
        with pytest.raises(core.UnknownOperatorError) as caught:
            served(table, name)
        assert status_of(caught.value) == 404
        message = str(caught.value)
        assert message.startswith(f"{what}; served: ")
        listed = message.split("served: ")[1].split(", ")
        assert "add" in listed and "gelu_tanh" in listed
        assert "tick" not in listed and "feed_tokens" not in listed
