"""The HTTP API of one replica, built per replica around its runtime, coalescer and registry.

Inference: GET /v1/ops, POST /v1/ops/{op}, GET /v1/stats; OpenAI-compatible POST /v1/completions
and GET /v1/models (serving/completions.py). Health: /healthz, /readyz. Admin (bearer
token): /admin/ops (list, register), /admin/ops/{name} (one), .../swap, .../rollback,
/admin/replicas, /admin/coalescer. OpenAPI docs at /docs. Every expected error is answered by
`errors.error_response` (4xx with a message; never a 500 for bad input).
"""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gpuos_core import Runtime
from gpuos_core.optable import OpVersion

from .completions import completion_routes
from .config import ADMIN_TOKEN_ENV, CoalescerConfig
from .errors import EXPECTED, AdminAuthError, RequestTooLargeError, error_response, status_of
from .schemas import (AdminOp, ChangeResponse, CoalescerUpdate, HealthResponse, OpRequest,
                      OpResponse, OpsResponse, ReadyResponse, RegisterRequest, ReplicasResponse,
                      StatsResponse, SwapRequest, admin_op, from_tensor, op_infos, stats_total,
                      to_call)

if TYPE_CHECKING:
    from .app import GpuosIngress

Action = Literal["register", "swap", "rollback"]


def build_api(replica: "GpuosIngress") -> FastAPI:
    """The replica's FastAPI app: routes bound to `replica`, error handlers, body size limit."""
    api = FastAPI(title="gpuos-serve", description="Coalesced GPU micro-operations on Ray Serve")
    _install_errors(api, replica)
    api.add_middleware(BodyLimit, limit=replica.args.max_body_bytes(),
                       on_reject=lambda: replica.metrics.error("RequestTooLargeError", 413))
    api.include_router(_health_routes(replica))
    api.include_router(_inference_routes(replica))
    api.include_router(_admin_routes(replica))
    api.include_router(completion_routes(replica))
    return api


def _install_errors(api: FastAPI, replica: "GpuosIngress") -> None:
    async def expected(_: Request, exc: Exception) -> Response:
        status = status_of(exc) or 500
        replica.metrics.error(type(exc).__name__, status)
        return error_response(exc, status)

    async def invalid(request: Request, exc: Exception) -> Response:
        replica.metrics.error("RequestValidationError", 422)
        assert isinstance(exc, RequestValidationError)
        return await request_validation_exception_handler(request, exc)

    for cls in EXPECTED:
        api.add_exception_handler(cls, expected)
    api.add_exception_handler(RequestValidationError, invalid)


class BodyLimit:
    """ASGI middleware: a request whose Content-Length exceeds `limit` gets 413 before its body
    is read or parsed (the element limit is checked after parsing, against `max_elements`)."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[], None]) -> None:
        self.app, self.limit, self.on_reject = app, limit, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _content_length(scope) > self.limit:
            self.on_reject()
            exc = RequestTooLargeError(f"request body over {self.limit} bytes; split the request")
            await error_response(exc, 413)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _content_length(scope: Scope) -> int:
    for key, value in scope["headers"]:
        if key == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def _health_routes(replica: "GpuosIngress") -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    def healthz() -> HealthResponse:
        """Answers 200 once the replica is constructed and able to take requests."""
        return HealthResponse(status="ok", backend=replica.runtime.backend_name)

    @router.get("/readyz", responses={503: {"model": ReadyResponse}})
    def readyz() -> JSONResponse:
        """200 when the replica serves the registry's operators on a working backend, else 503."""
        ready = replica.readiness()
        return JSONResponse(ready.model_dump(), status_code=200 if ready.ready else 503)

    return router


def _inference_routes(replica: "GpuosIngress") -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["inference"])

    @router.get("/ops")
    def list_ops() -> OpsResponse:
        """Every operator: family, interface (arity, scalar parameters) and active version."""
        runtime = replica.runtime
        return OpsResponse(backend=runtime.backend_name, ops=op_infos(runtime.table))

    @router.post("/ops/{op}")
    async def run_op(op: str, body: OpRequest) -> OpResponse:
        """Run `op` on the given tensors, coalesced with concurrent requests into one submission.
        404 unknown op, 413 too many elements, 422 inputs that do not fit, 503 queue full (retry
        after Retry-After), 504 deadline passed."""
        replica.runtime.table.current(op)  # 404 before parsing tensors for an unknown op
        call = to_call(op, body, replica.args.max_elements, replica.runtime.device)
        done = await replica.coalescer.submit(call)
        return OpResponse(op=op, version=done.version, output=from_tensor(done.out),
                          replica=replica.replica_id)

    @router.get("/stats")
    async def stats() -> StatsResponse:
        """Coalescer counters of every replica (batches, tasks, mean batch size) and their sum."""
        replicas, _ = await replica.broadcast("local_stats")
        return StatsResponse(replicas=replicas, total=stats_total(replicas))

    return router


def _admin_routes(replica: "GpuosIngress") -> APIRouter:
    def authorize(authorization: str | None = Header(None)) -> None:
        _check_token(replica.admin_token, authorization)

    router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(authorize)])

    @router.get("/ops")
    def list_ops() -> list[AdminOp]:
        """Every operator with its version history and activation stack."""
        table = replica.runtime.table
        return [admin_op(table, name) for name in sorted(table.names())]

    @router.get("/ops/{name}")
    def get_op(name: str) -> AdminOp:
        replica.runtime.table.current(name)  # 404 for unknown names
        return admin_op(replica.runtime.table, name)

    @router.post("/ops", status_code=201)
    async def register(body: RegisterRequest) -> ChangeResponse:
        """Add an elementwise operator (version 1); 400 with the position for a bad expression,
        409 if the name exists, 403 for raw CUDA unless the app allows it."""
        return await _change(replica, "register", body.name,
                             lambda rt: rt.register(body.name, body.expression, body.arity,
                                                    cuda=body.cuda))

    @router.post("/ops/{name}/swap")
    async def swap(name: str, body: SwapRequest) -> ChangeResponse:
        """Compile (and canary-check) a new version, then make it current on every replica. On
        any failure the old version keeps serving: 400 with the position or compiler log, 422
        with a canary's mismatch."""
        return await _change(replica, "swap", name,
                             lambda rt: rt.swap(name, body.expression, cuda=body.cuda))

    @router.post("/ops/{name}/rollback")
    async def rollback(name: str) -> ChangeResponse:
        """Make the version active before the last change current again on every replica."""
        return await _change(replica, "rollback", name, lambda rt: rt.rollback(name))

    @router.get("/replicas")
    async def replicas() -> ReplicasResponse:
        """Each replica's applied registry state, active versions and coalescer knobs."""
        reports, unreachable = await replica.broadcast("report")
        return ReplicasResponse(replicas=reports, unreachable=unreachable)

    @router.put("/coalescer")
    async def coalescer(body: CoalescerUpdate) -> ReplicasResponse:
        """Set coalescer knobs on every running replica: this replica's knobs updated with the
        given ones (422 if out of range), until a redeploy applies the config's user_config."""
        knobs = {**replica.coalescer.config.model_dump(), **body.model_dump(exclude_none=True)}
        config = CoalescerConfig.model_validate(knobs)
        reports, unreachable = await replica.broadcast("apply_coalescer", config)
        return ReplicasResponse(replicas=reports, unreachable=unreachable)

    return router


def _check_token(expected: str | None, authorization: str | None) -> None:
    if expected is None:
        raise AdminAuthError(f"admin disabled: set {ADMIN_TOKEN_ENV} or the app arg admin_token",
                             403)
    if not authorization:
        raise AdminAuthError("missing 'Authorization: Bearer <token>' header", 401)
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                              expected.encode()):
        raise AdminAuthError("wrong admin token", 403)


async def _change(replica: "GpuosIngress", action: Action, name: str,
                  apply: Callable[[Runtime], OpVersion]) -> ChangeResponse:
    """Make the change here (compile off the event loop), store it, push it to every replica.
    Shielded: a client that hangs up must not stop the push of a change already stored."""
    return await asyncio.shield(_change_everywhere(replica, action, name, apply))


async def _change_everywhere(replica: "GpuosIngress", action: Action, name: str,
                             apply: Callable[[Runtime], OpVersion]) -> ChangeResponse:
    try:
        made, state = await asyncio.to_thread(replica.registry.change, apply)
    except Exception:
        replica.metrics.changed(action, False)
        raise
    replica.metrics.changed(action, True)
    reports, unreachable = await replica.broadcast("apply_registry", state)
    return ChangeResponse(action=action, op=admin_op(replica.runtime.table, name),
                          version=made.version, registry_seq=state.seq, replicas=reports,
                          unreachable=unreachable)
