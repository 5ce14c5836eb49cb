"""The baselines of loadtest/compare.py: Ray Serve apps that answer POST /v1/ops/{op} in
gpuos-serve's request and answer formats, parsed and written by the same code (serving.schemas,
serving.tensors, serving.routes.JsonRoute, serving.jsonfast), without the runtime or its coalescer:

    torch        per request: parse, one torch call (the operator's torch reference), answer
    serve-batch  `@serve.batch` (64 calls or 200 µs, the coalescer's defaults) + torch: calls of one
                 operator whose tensors line up are concatenated into one torch call
    echo         parse the request (tensors on the device) and answer its first input: what the
                 HTTP path and the tensor encoding cost alone

`serve run` of a config naming `loadtest.baselines:build_app` with args `{"kind": ...}` starts one
(compare.py writes such configs). GET /v1/stats counts the torch calls and the requests they
answered, of the replica that answers it, in the shape of gpuos-serve's `total`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Literal

import ray
import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from gpuos_core import OpCall, UnknownOperatorError
from gpuos_core.catalogue import CATALOGUE, run_reference
from serving.app import replica_gpus
from serving.config import Backend
from serving.errors import error_response
from serving.jsonfast import json_response
from serving.routes import JsonRoute
from serving.schemas import OpRequest
from serving.tensors import answer_encoding, from_tensor, request_budgets, to_call

Kind = Literal["torch", "serve-batch", "echo"]
KINDS: tuple[Kind, ...] = ("torch", "serve-batch", "echo")
DEPLOYMENT = "BaselineIngress"
ROW_FAMILIES = ("softmax", "log_softmax")  # rows of the last dim, each on its own


class BaselineArgs(BaseModel):
    """The `args:` of a baseline app."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    backend: Backend = "auto"  # cpu, or cuda when a GPU is visible (auto)
    max_elements: int = Field(1 << 20, ge=1)  # as gpuos-serve's: most input elements a request
    num_cpus: float = Field(1.0, ge=0)  # CPUs one replica reserves


@serve.ingress()
class Baseline:
    """One replica of a baseline app: its HTTP API answers with `compute` of each call."""

    def __init__(self, args: BaselineArgs) -> None:
        self.args = args
        usable = args.backend != "cpu" and torch.cuda.is_available()
        self.device = torch.device("cuda" if usable else "cpu")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.batches = self.tasks = 0  # torch calls made, requests they answered
        methods: dict[Kind, Callable[[OpCall], Awaitable[torch.Tensor]]] = {
            "torch": self.per_request,
            "serve-batch": self.batched,
            "echo": self.echo,
        }
        self.compute = methods[args.kind]

    def __serve_build_asgi_app__(self) -> FastAPI:
        return baseline_api(self)

    async def answer(self, op: str, body: OpRequest) -> dict[str, Any]:
        """The answer to POST /v1/ops/`op` (version 0: no runtime versions here)."""
        call = to_call(op, body, request_budgets(self.args.max_elements).inputs, self.device)
        out = await self.compute(call)
        return {
            "op": op,
            "version": 0,
            "output": from_tensor(out, answer_encoding(body)),
            "replica": self.replica_id,
        }

    def stats(self) -> dict[str, float]:
        return {
            "requests": self.tasks,
            "batches": self.batches,
            "tasks": self.tasks,
            "mean_batch_size": self.tasks / self.batches if self.batches else 0.0,
        }

    async def per_request(self, call: OpCall) -> torch.Tensor:
        self.batches, self.tasks = self.batches + 1, self.tasks + 1
        return reference(call)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=200e-6)
    async def batched(self, calls: list[OpCall]) -> list[torch.Tensor]:
        groups = grouped(calls)
        self.batches, self.tasks = self.batches + len(groups), self.tasks + len(calls)
        results: list[torch.Tensor] = [torch.empty(0)] * len(calls)
        for members in groups:
            for i, out in zip(members, run_group([calls[i] for i in members])):
                results[i] = out
        return results

    async def echo(self, call: OpCall) -> torch.Tensor:
        return call.inputs[0]


def baseline_api(replica: Baseline) -> FastAPI:
    """The routes of a baseline replica: /v1/ops/{op}, /healthz, /v1/stats."""
    api = FastAPI(title=f"gpuos-serve baseline: {replica.args.kind}")
    router = APIRouter(route_class=JsonRoute)

    @router.post("/v1/ops/{op}", response_model=None)
    async def run_op(op: str, body: OpRequest) -> Response:
        return json_response(await replica.answer(op, body))

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "backend": replica.device.type}

    @router.get("/v1/stats")
    def stats() -> dict[str, dict[str, float]]:
        return {"total": replica.stats()}

    async def error(request: Request, exc: Exception) -> Response:
        return error_response(exc, request.url.path)

    api.include_router(router)
    api.add_exception_handler(Exception, error)
    return api


def reference(call: OpCall) -> torch.Tensor:
    """`call` by its operator's torch reference: one torch call, as a plain app would make."""
    spec = CATALOGUE.get(call.op)
    if spec is None:
        raise UnknownOperatorError(
            f"unknown operator {call.op!r}; the baselines have the catalogue's only"
        )
    out = run_reference(spec, call)
    return out if call.out_dtype is None else out.to(call.out_dtype)


def grouped(calls: Sequence[OpCall]) -> list[list[int]]:
    """The calls' indices in groups that run as one torch call each (`concat_key`), in order."""
    groups: dict[Hashable, list[int]] = {}
    for i, call in enumerate(calls):
        key = concat_key(call)
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    return list(groups.values())


def concat_key(call: OpCall) -> tuple[Hashable, ...] | None:
    """Calls with one key give the right results from one torch call on their inputs
    concatenated (`row_width`); None for a call that has to run alone."""
    width = row_width(call)
    if width is None:
        return None
    return (
        call.op,
        width,
        tuple(x.dtype for x in call.inputs),
        tuple(sorted(call.scalars.items())),
        call.out_dtype,
    )


def row_width(call: OpCall) -> int | None:
    """Elements of `call`'s inputs that its operator treats as one row, for calls whose inputs
    all have one shape: 1 for elementwise operators, the last dim for softmax; else None."""
    spec = CATALOGUE.get(call.op)
    if spec is None or len({x.shape for x in call.inputs}) != 1:
        return None
    if spec.family == "map":
        return 1
    x = call.inputs[0]
    return x.shape[-1] if spec.family in ROW_FAMILIES and x.dim() and x.shape[-1] else None


def run_group(calls: Sequence[OpCall]) -> list[torch.Tensor]:
    """The results of calls of one `concat_key`: one torch call on their inputs concatenated."""
    if len(calls) == 1:
        return [reference(calls[0])]
    first, width = calls[0], row_width(calls[0]) or 1
    inputs = tuple(
        torch.cat([c.inputs[k].reshape(-1, width) for c in calls]) for k in range(len(first.inputs))
    )
    joined = reference(OpCall(first.op, inputs, scalars=first.scalars, out_dtype=first.out_dtype))
    pieces = joined.split([c.inputs[0].numel() // width for c in calls])
    return [piece.reshape(c.inputs[0].shape) for piece, c in zip(pieces, calls)]


BaselineIngress = serve.deployment(name=DEPLOYMENT)(Baseline)


def build_app(args: dict[str, object]) -> Application:
    """Serve app builder (as serving.app.build_app): one GPU per replica where the cluster has
    one and the backend may use it."""
    config = BaselineArgs.model_validate(args)
    gpus = replica_gpus(config.backend, ray.cluster_resources().get("GPU", 0.0))
    options = {"num_gpus": gpus, "num_cpus": config.num_cpus}
    return BaselineIngress.options(ray_actor_options=options).bind(config)
