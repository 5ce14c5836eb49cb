"""The Serve application: `build_app`, named by deployments/llm.yaml, and its HTTP ingress."""
from __future__ import annotations

from typing import Literal

import ray
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application

from gpuos_core import Runtime

Backend = Literal["auto", "cuda", "cpu"]


class AppArgs(BaseModel):
    """The `args:` block of a Serve config. Unknown keys are rejected so a typo cannot pass silently."""

    model_config = ConfigDict(extra="forbid")

    backend: Backend = "auto"  # runtime backend of every replica; auto = cuda when a GPU is visible


class HealthResponse(BaseModel):
    """Body of `GET /healthz`."""

    status: Literal["ok"]
    backend: str  # the backend the replica serves with


api = FastAPI(title="gpuos-serve")


@serve.deployment
@serve.ingress(api)
class GpuosIngress:
    """HTTP front door of one replica; owns that replica's GPUOS runtime."""

    def __init__(self, backend: Backend) -> None:
        self._runtime = Runtime(backend)

    @api.get("/healthz")
    def healthz(self) -> HealthResponse:
        """Answers 200 once the replica is constructed and able to take requests."""
        return HealthResponse(status="ok", backend=self._runtime.backend_name)


def replica_gpus(backend: Backend, cluster_gpus: float) -> int:
    """GPUs one replica reserves: 1 when its backend may use CUDA and the cluster has a GPU, else 0."""
    return 1 if backend != "cpu" and cluster_gpus > 0 else 0


def build_app(args: dict[str, object]) -> Application:
    """Serve app builder: validates `args` as `AppArgs` and binds the ingress deployment.

    Raises pydantic.ValidationError naming the bad key or value. Needs a connected Ray (Serve's
    controller runs builders inside it; in a script call `ray.init()` first): the cluster's GPU
    count decides whether replicas reserve a GPU, so the same config runs on machines without one.
    """
    config = AppArgs.model_validate(args)
    gpus = replica_gpus(config.backend, ray.cluster_resources().get("GPU", 0.0))
    return GpuosIngress.options(ray_actor_options={"num_gpus": gpus}).bind(config.backend)
