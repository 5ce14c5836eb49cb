"""The HTTP API of one replica, built per replica around the services it uses (`Services`: its
runtime, coalescer, registry, swap watch, metrics, and the replica's own operations).

Inference: GET /v1/ops, POST /v1/ops/{op}, GET /v1/stats; OpenAI-compatible POST /v1/completions
and GET /v1/models (serving/completions.py). Health and metrics: /healthz, /readyz, /metrics.
Admin (bearer token): /admin/ops (list, register), /admin/ops/{name} (one), .../swap,
.../rollback, /admin/replicas, /admin/coalescer. OpenAPI docs at /docs; every route's OpenAPI
lists the statuses it answers with.

Bad input of any kind gets a 4xx in one shape (serving/errors.py): bodies are limited while they
stream in, JSON is parsed by pydantic's parser (strict UTF-8, nesting at most 200 deep, about
3 ms a MB) in a worker thread when large, and every exception goes through `error_response`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import pydantic
import pydantic_core
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from gpuos_core import GpuosError, Runtime, TaskFailedError
from gpuos_core.canary import Comparison

from .coalescer import Coalescer
from .config import ADMIN_TOKEN_ENV, AppArgs, CoalescerConfig
from .errors import (
    AdminAuthError,
    RequestTooLargeError,
    ServingError,
    error_body,
    error_response,
    status_of,
)
from .hotpaths import INLINE_JSON_BYTES, HotPaths, HotRoute
from .jsonfast import json_answer
from .metrics import CONTENT_TYPE, ReplicaMetrics, exposition
from .registry import ChangeNote, ReplicaRegistry
from .relay import body_then, header
from .schemas import (
    AdminOp,
    BatchCall,
    BatchRequest,
    BatchResponse,
    ChangeResponse,
    CoalescerUpdate,
    HealthResponse,
    OpRequest,
    OpResponse,
    OpsResponse,
    ReadyResponse,
    RegisterRequest,
    ReplicasResponse,
    StatsResponse,
    SwapRequest,
    admin_op,
    canary_report,
    error_responses,
    op_infos,
    served,
    stats_total,
)
from .tensors import (
    Budgets,
    answer_encoding,
    check_output_size,
    from_tensor,
    request_budgets,
    to_call,
)
from .watch import SwapWatch

log = logging.getLogger("gpuos.serving")
Handler = Callable[[Request], Coroutine[Any, Any, Response]]
T = TypeVar("T")
# Calls a method on every replica of the deployment: (results, failures as text).
Broadcast = Callable[..., Awaitable[tuple[list[Any], list[str]]]]


class Change(Protocol):
    """Makes the change `note` describes with `apply` on every replica (stored in the registry,
    pushed to all): what `apply` returned, and the change's report."""

    def __call__(
        self, note: ChangeNote, apply: Callable[[Runtime], T]
    ) -> Awaitable[tuple[T, ChangeResponse]]: ...


@dataclass(frozen=True)
class Services:
    """What the routes of one replica use (serving/app.py builds it per replica)."""

    args: AppArgs  # limits: body bytes, tensor elements
    replica_id: str  # named in answers
    admin_token: str | None  # bearer token of /admin; None: admin off (403)
    runtime: Runtime
    coalescer: Coalescer
    registry: ReplicaRegistry
    watch: SwapWatch
    metrics: ReplicaMetrics
    readiness: Callable[[], ReadyResponse]  # ready, or the reason it is not
    change: Change
    broadcast: Broadcast


def build_api(
    replica: Services,
    routers: Sequence[APIRouter] = (),
    hot: Mapping[str, HotRoute] = MappingProxyType({}),
) -> FastAPI:
    """The replica's FastAPI app: routes bound to `replica`'s services, then `routers` (built with
    `JsonRoute`), error handlers, body size limit; the data plane's routes and `hot` (routes of
    `routers` with the same answers) served past FastAPI by HotPaths."""
    api = FastAPI(title="gpuos-serve", description="Coalesced GPU micro-operations on Ray Serve")
    _install_errors(api, replica.metrics)
    api.add_middleware(  # added first: inside BodyLimit, which reads the body
        HotPaths,
        routes={**_data_plane(replica), **hot},
        on_error=partial(counted_error, replica.metrics),
    )
    api.add_middleware(
        BodyLimit,
        limit=replica.args.max_body_bytes(),
        on_reject=lambda: replica.metrics.error("RequestTooLargeError", 413),
    )
    api.include_router(_health_routes(replica))
    api.include_router(_inference_routes(replica))
    api.include_router(_admin_routes(replica))
    for router in routers:
        api.include_router(router)
    return api


def relay_entry(api: FastAPI) -> ASGIApp:
    """Where a request the relay channel carries (a completion route: HotPaths answers it) enters
    `api`: its error middleware, with the same handler, then the middlewares build_api adds and
    what they wrap, past the layers FastAPI adds between the two (its telemetry and its own body
    limit: ~10% of the replica's event loop a completion on the CPU box). The whole app where
    that stack is not as expected."""
    outer = api.build_middleware_stack()
    node = getattr(outer, "app", None)
    while node is not None and not isinstance(node, BodyLimit):
        node = getattr(node, "app", None)
    if not isinstance(outer, ServerErrorMiddleware) or node is None:
        log.warning("relay channel: unexpected middleware stack; relaying through the whole app")
        return api
    return ServerErrorMiddleware(node, handler=outer.handler, debug=outer.debug)


def _install_errors(api: FastAPI, metrics: ReplicaMetrics) -> None:
    async def answer(request: Request, exc: Exception) -> Response:
        response = counted_error(metrics, exc, request.url.path)
        if response.status_code == 405:  # Starlette's Allow names the first route's methods only
            response.headers["Allow"] = ", ".join(_methods(api, request.url.path))
        return response

    # Raised on purpose: answered here. Anything else is a bug: Starlette's outermost middleware
    # calls the Exception handler (so the client gets the same shape), then logs the traceback.
    for cls in (
        GpuosError,
        ServingError,
        pydantic.ValidationError,
        RequestValidationError,
        HTTPException,
        Exception,
    ):
        api.add_exception_handler(cls, answer)


def counted_error(metrics: ReplicaMetrics, exc: BaseException, path: str) -> Response:
    """`error_response` for `exc` on `path`, counted in the replica's error metric."""
    response = error_response(exc, path)
    metrics.error(type(exc).__name__, response.status_code)
    return response


def _methods(api: FastAPI, path: str) -> list[str]:
    """Every method the app's OpenAPI lists for `path`."""
    return sorted(
        method.upper()
        for template, operations in api.openapi()["paths"].items()
        if compile_path(template)[0].match(path)
        for method in operations
    )


# -- request bodies ----------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: reads the request body as it streams in (chunked or not) and answers 413
    as soon as it passes `limit` bytes, or at once for a Content-Length over it; the app then
    reads the body from memory. Memory per request stays under `limit`, and nothing is parsed."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[], None]) -> None:
        self.app, self.limit, self.on_reject = app, limit, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive, self.limit, _content_length(scope))
        except RequestTooLargeError as exc:
            self.on_reject()
            await error_response(exc, scope["path"])(scope, receive, send)
            return
        if body is not None:  # None: the client went away
            await self.app(scope, body_then(body, receive), send)


async def _read_body(receive: Receive, limit: int, declared: int) -> bytes | None:
    """The whole body, or None if the client disconnected; RequestTooLargeError as soon as the
    Content-Length (`declared`) or the bytes received pass `limit`."""
    chunks: list[bytes] = []
    size, more = 0, True
    while True:
        if max(size, declared) > limit:
            raise RequestTooLargeError(f"request body over {limit} bytes; split the request")
        if not more:
            return b"".join(chunks)
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)


def _content_length(scope: Scope) -> int:
    value = header(scope["headers"], b"content-length") or b""
    return int(value) if value.isdigit() else 0


class _JsonRequest(Request):
    """A request whose JSON body is parsed by pydantic's parser: about 3x faster than json's, it
    refuses invalid UTF-8 and nesting over 200 levels (json's recursion error was a 500), and a
    large body is parsed in a worker thread."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            try:
                self._json = (
                    pydantic_core.from_json(raw)
                    if len(raw) < INLINE_JSON_BYTES
                    else await asyncio.to_thread(pydantic_core.from_json, raw)
                )
            except ValueError as exc:  # FastAPI answers JSONDecodeError with a validation error
                raise json.JSONDecodeError(f"invalid JSON: {exc}", "", 0) from None
        return self._json


class JsonRoute(APIRoute):
    """Every route of this app: request bodies parsed as `_JsonRequest` does."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return route


# -- routes ------------------------------------------------------------------------------------
def _health_routes(replica: Services) -> APIRouter:
    router = APIRouter(tags=["health"], route_class=JsonRoute)

    @router.get("/healthz")
    def healthz() -> HealthResponse:
        """Answers 200 once the replica is constructed and able to take requests."""
        return HealthResponse(status="ok", backend=replica.runtime.backend_name)

    @router.get("/readyz", responses={503: {"model": ReadyResponse}})
    def readyz() -> JSONResponse:
        """200 when the replica serves the registry's operators on a working backend, else 503."""
        ready = replica.readiness()
        return JSONResponse(ready.model_dump(), status_code=200 if ready.ready else 503)

    @router.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "metrics"}},
    )
    async def metrics() -> Response:
        """Every replica's metrics in Prometheus' text format, labelled by replica."""
        replicas, _ = await replica.broadcast("local_metrics")
        return Response(exposition(replicas), media_type=CONTENT_TYPE)

    return router


def _inference_routes(replica: Services) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["inference"], route_class=JsonRoute)

    @router.get("/ops")
    def list_ops() -> OpsResponse:
        """Every operator: family, interface (arity, scalar parameters) and active version."""
        runtime = replica.runtime
        return OpsResponse(backend=runtime.backend_name, ops=op_infos(runtime.table))

    @router.post(
        "/ops/{op}",
        response_model=None,
        responses={
            200: {"model": OpResponse, "description": "the result"},
            **error_responses(404, 413, 422, 500, 503, 504),
        },
    )
    async def run_op(op: str, body: OpRequest) -> Response:
        """Run `op` on the given tensors, coalesced with concurrent requests into one submission.
        404 unknown op, 413 too many elements (inputs or result), 422 inputs that do not fit,
        500 the task failed, 503 queue full (retry after Retry-After), 504 deadline passed."""
        return await op_answer(replica, op, body)

    @router.post(
        "/batch",
        response_model=None,
        responses={
            200: {"model": BatchResponse, "description": "one result or error per call, in order"},
            **error_responses(413, 422),
        },
    )
    async def run_batch(body: BatchRequest) -> Response:
        """Run many calls, coalesced with each other and with concurrent requests. Each call gets
        its own result or the error POST /v1/ops/{op} would have answered it with, and its
        status: one failing call fails no other. The calls' inputs together, and their results
        together, may have at most max_elements elements, as one call's may (a call past that
        gets 413). 413 a body over the limit, 422 a body the schema refuses (whole)."""
        return await batch_answer(replica, body)

    @router.get("/stats")
    async def stats() -> StatsResponse:
        """Coalescer counters of every replica (batches, tasks, mean batch size) and their sum."""
        replicas, _ = await replica.broadcast("local_stats")
        return StatsResponse(replicas=replicas, total=stats_total(replicas))

    return router


def _data_plane(replica: Services) -> dict[str, HotRoute]:
    """POST /v1/ops/{op} and /v1/batch, for HotPaths."""
    return {
        "/v1/ops/": HotRoute(OpRequest, lambda body, op: op_answer(replica, op, body)),
        "/v1/batch": HotRoute(BatchRequest, lambda body, _: batch_answer(replica, body)),
    }


async def op_answer(replica: Services, op: str, body: OpRequest) -> Response:
    """POST /v1/ops/{op}'s answer (HotPaths and the route both call it)."""
    budgets = request_budgets(replica.args.max_elements)
    answer = await _run_call(replica, op, body, budgets)
    # Written once here: FastAPI would validate and convert the result twice more.
    return await json_answer({**answer, "replica": replica.replica_id}, budgets.results.used)


async def batch_answer(replica: Services, body: BatchRequest) -> Response:
    """POST /v1/batch's answer (HotPaths and the route both call it)."""
    budgets = request_budgets(replica.args.max_elements)
    results = await asyncio.gather(*(_batch_entry(replica, call, budgets) for call in body.calls))
    return await json_answer(
        {"results": results, "replica": replica.replica_id}, budgets.results.used
    )


async def _run_call(
    replica: Services, op: str, request: OpRequest, budgets: Budgets
) -> dict[str, Any]:
    """One call through the coalescer: its answer's `op`, `version` and `output`. Its inputs and
    result are counted against `budgets`; the error classes say what failed."""
    spec = served(replica.runtime.table, op).spec  # 404 before building tensors
    call = to_call(op, request, budgets.inputs, replica.runtime.device)
    check_output_size(spec, call, budgets.results)
    try:
        done = await replica.coalescer.submit(call)
    except TaskFailedError as exc:
        replica.watch.failed(op, replica.runtime.table.current(op).version, str(exc))
        raise
    replica.watch.check_result(call, done.version, done.out)
    return {
        "op": op,
        "version": done.version,
        "output": from_tensor(done.out, answer_encoding(request)),
    }


async def _batch_entry(replica: Services, call: BatchCall, budgets: Budgets) -> dict[str, Any]:
    """One call of a batch: its result, or its error as POST /v1/ops/{op} would answer it."""
    try:
        return {"status": 200, **await _run_call(replica, call.op, call, budgets)}
    except Exception as exc:  # each call's own answer; the batch goes on
        status = status_of(exc)
        replica.metrics.error(type(exc).__name__, status)
        if status >= 500:  # the single route's handler would log these
            log.warning("batch call of %s failed: %r", call.op, exc, exc_info=status == 500)
        return {"status": status, "op": call.op, **error_body(exc, status)}


def _admin_routes(replica: Services) -> APIRouter:
    def authorize(authorization: str | None = Header(None)) -> None:
        _check_token(replica.admin_token, authorization)

    router = APIRouter(
        prefix="/admin",
        tags=["admin"],
        dependencies=[Depends(authorize)],
        route_class=JsonRoute,
        responses=error_responses(401, 403, 422),
    )
    changes = error_responses(400, 404, 409, 413, 500, 503)

    @router.get("/ops")
    def list_ops() -> list[AdminOp]:
        """Every operator with its version history, activation stack and change log."""
        # A replica that started while a change was pushed missed the push (its health check
        # catches up within a period): an admin read answers from the latest stored state, so a
        # client reads its own writes whichever replica it reaches (seen on two H200s).
        replica.registry.catch_up()
        table = replica.runtime.table
        log = replica.registry.applied.log
        return [admin_op(table, name, log) for name in sorted(table.names())]

    @router.get("/ops/{name}", responses=error_responses(404))
    def get_op(name: str) -> AdminOp:
        """One operator, as list_ops has it."""
        replica.registry.catch_up()  # as in list_ops
        replica.runtime.table.current(name)  # 404 for unknown names
        return admin_op(replica.runtime.table, name, replica.registry.applied.log)

    @router.post("/ops", status_code=201, responses=changes)
    async def register(body: RegisterRequest) -> ChangeResponse:
        """Add an elementwise operator (version 1); 400 with the position for a bad expression,
        409 if the name exists, 403 for raw CUDA unless the app allows it."""
        _, done = await replica.change(
            ChangeNote(op=body.name, action="register"),
            lambda rt: rt.register(body.name, body.expression, body.arity, cuda=body.cuda),
        )
        return done

    @router.post("/ops/{name}/swap", responses=changes)
    async def swap(name: str, body: SwapRequest) -> ChangeResponse:
        """Compile a new version, run it beside the current one on the canary inputs (and, on a
        GPU, against its reference in a sandbox), then make it current on every replica; the
        answer reports its largest deviation. On any failure the old version keeps serving: 400
        with the position or compiler log, 422 with the canary's cases (a mismatch, or NaN or
        infinity where the current version is finite, unless allow_nonfinite). For `watch_s`
        seconds after, failing requests roll it back by themselves."""
        comparison, done = await replica.change(
            ChangeNote(op=name, action="swap"), lambda rt: _checked_swap(rt, name, body)
        )
        return done.model_copy(update={"canary": canary_report(comparison)})

    @router.post("/ops/{name}/rollback", responses=changes)
    async def rollback(name: str) -> ChangeResponse:
        """Make the version active before the last change current again on every replica."""
        _, done = await replica.change(
            ChangeNote(op=name, action="rollback"), lambda rt: rt.rollback(name)
        )
        return done

    @router.get("/replicas")
    async def replicas() -> ReplicasResponse:
        """Each replica's applied registry state, active versions and coalescer knobs."""
        reports, unreachable = await replica.broadcast("report")
        return ReplicasResponse(replicas=reports, unreachable=unreachable)

    @router.put("/coalescer", responses=error_responses(413))
    async def coalescer(body: CoalescerUpdate) -> ReplicasResponse:
        """Set coalescer knobs on every running replica: this replica's knobs updated with the
        given ones (422 if out of range), until a redeploy applies the config's user_config."""
        knobs = {**replica.coalescer.config.model_dump(), **body.model_dump(exclude_none=True)}
        config = CoalescerConfig.model_validate(knobs)
        reports, unreachable = await replica.broadcast("apply_coalescer", config)
        return ReplicasResponse(replicas=reports, unreachable=unreachable)

    return router


def _checked_swap(runtime: Runtime, name: str, body: SwapRequest) -> Comparison:
    """Swap the new version in: compared with the current one (NonFiniteOutputError unless
    allowed), compiled, sandbox-checked on a GPU, activated. Returns the comparison."""
    runtime.swap(name, body.expression, cuda=body.cuda, allow_nonfinite=body.allow_nonfinite)
    change = runtime.last_change  # this swap's: the registry applies one change at a time
    assert change is not None and change.comparison is not None, "swap() compares when canary"
    return change.comparison


def _check_token(expected: str | None, authorization: str | None) -> None:
    if expected is None:
        raise AdminAuthError(
            f"admin disabled: set {ADMIN_TOKEN_ENV} or the app arg admin_token", 403
        )
    if not authorization:
        raise AdminAuthError("missing 'Authorization: Bearer <token>' header", 401)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), expected.encode()
    ):
        raise AdminAuthError("wrong admin token", 403)
