"""The Serve application: `build_app`, named by deployments/*.yaml, and its ingress deployment.

Each replica holds one runtime, one coalescer and its view of the operator registry. Its HTTP API
(serving/routes.py) is built per replica and handed to Serve by `__serve_build_asgi_app__`, so
routes close over the services of the replica they use. The methods below the routes are called
through a DeploymentHandle: `broadcast` reaches every replica (registry pushes, coalescer knobs,
statistics, reports), and `relay_address` tells the completions gateway (serving/gateway.py)
where this replica's relay channel listens (serving/channel.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from fastapi import FastAPI
from prometheus_client.metrics_core import Metric
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from gpuos_core import Runtime, RuntimeConfig

from .channel import ChannelServer
from .coalescer import Coalescer
from .completions import (
    COMPLETION_PATHS,
    CompletionServices,
    LlmService,
    completion_hot_routes,
    completion_routes,
)
from .config import AppArgs, Backend, CoalescerConfig
from .errors import RegistryDivergedError
from .metrics import ReplicaMetrics
from .registry import ChangeNote, RegistryState, RegistryStore, ReplicaRegistry
from .routes import JsonRoute, Services, build_api, relay_entry
from .schemas import ChangeResponse, ReadyResponse, ReplicaReport, ReplicaStats, admin_op
from .watch import SwapWatch

__all__ = ["AppArgs", "Backend", "GpuosIngress", "GpuosReplica", "build_app", "replica_gpus"]
log = logging.getLogger("gpuos.serving")
BROADCAST_TIMEOUT_S = 120.0  # a push compiles on every replica (and canary-checks on CUDA)
T = TypeVar("T")


@serve.ingress()
class GpuosReplica:
    """One replica: HTTP front door, runtime, coalescer and registry view. Deployed as
    `GpuosIngress`."""

    def __init__(self, args: AppArgs) -> None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)  # before any thread starts
        self.args = args
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._peers: DeploymentHandle | None = None  # handle to this deployment, made on first use
        self._ip = ray.util.get_node_ip_address()
        self._channel: asyncio.Future[asyncio.Server] | None = None  # started by relay_address
        self._deployment = (context.deployment, context.app_name)
        self.runtime = Runtime(
            config=RuntimeConfig(backend=args.backend, allow_raw_cuda=args.allow_raw_cuda)
        )
        self.metrics = ReplicaMetrics()
        self.coalescer = Coalescer(self.runtime, CoalescerConfig(), self.metrics)
        self.admin_token = args.resolved_admin_token()
        self.registry = ReplicaRegistry(self.runtime, RegistryStore(args.resolved_state_dir()))
        applied = self.registry.catch_up()  # a broken state file fails the replica's start
        self.watch = SwapWatch(self.registry, args.watch_s, self.change, self.metrics.auto_rollback)
        self.llm = (
            LlmService(args.llm, self.runtime, args.resolved_state_dir())
            if args.llm.enabled
            else None
        )
        self.api = self._build_api()
        log.info(
            "replica %s: %s; registry %s at seq %d",
            self.replica_id,
            self.runtime.backend_reason,
            self.registry.store.path,
            applied.seq,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.api

    def _build_api(self) -> FastAPI:
        services = Services(
            args=self.args,
            replica_id=self.replica_id,
            admin_token=self.admin_token,
            runtime=self.runtime,
            coalescer=self.coalescer,
            registry=self.registry,
            watch=self.watch,
            metrics=self.metrics,
            readiness=self.readiness,
            change=self.change,
            broadcast=self.broadcast,
        )
        completions = CompletionServices(self.llm, self.metrics.llm, self.watch)
        return build_api(
            services,
            [completion_routes(completions, JsonRoute)],
            completion_hot_routes(completions),
        )

    # -- Serve hooks -----------------------------------------------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's `user_config` (the coalescer knobs), at start
        and whenever the config changes; a bad key or value fails the deploy."""
        self.coalescer.reconfigure(CoalescerConfig.model_validate(user_config))

    async def check_health(self) -> None:
        """Fails when the backend stalled or the registry cannot be applied, so Serve replaces
        the replica; also applies a registry change this replica missed."""
        await asyncio.to_thread(self.registry.catch_up_unless_busy)  # raises if it cannot apply
        reason = self.readiness().reason
        if reason:
            raise RuntimeError(reason)

    async def __del__(self) -> None:  # Serve awaits it on the replica's loop at shutdown
        if self._channel is not None and self._channel.done() and not self._channel.exception():
            self._channel.result().close()
        if self.llm is not None:
            self.llm.close()
        self.coalescer.flush()
        self.runtime.close()

    # -- called through a DeploymentHandle ------------------------------------------------------
    async def relay_address(self) -> tuple[str, int]:
        """Where this replica's relay channel listens (serving/channel.py: how the completions
        gateway reaches it); the first call starts it, on this replica's event loop."""
        if self._channel is None:
            server = ChannelServer(relay_entry(self.api), COMPLETION_PATHS)
            self._channel = asyncio.ensure_future(
                asyncio.start_server(server.serve, host=self._ip, port=0)
            )
        listening = await asyncio.shield(self._channel)
        return self._ip, int(listening.sockets[0].getsockname()[1])

    # -- called through DeploymentHandle.broadcast ------------------------------------------------
    async def apply_registry(self, state: RegistryState) -> ReplicaReport:
        """Apply a pushed registry state (ignored if not newer); the report says if it failed."""
        try:
            await asyncio.to_thread(self.registry.apply, state)
        except RegistryDivergedError as exc:
            log.error(
                "replica %s cannot apply registry seq %d: %s", self.replica_id, state.seq, exc
            )
        return self.report()

    async def apply_coalescer(self, config: CoalescerConfig) -> ReplicaReport:
        """Use these coalescer knobs until the next `reconfigure`."""
        self.coalescer.reconfigure(config)
        return self.report()

    def report(self) -> ReplicaReport:
        table = self.runtime.table
        return ReplicaReport(
            replica=self.replica_id,
            registry_seq=self.registry.applied.seq,
            versions={n: table.current(n).version for n in sorted(table.names())},
            diverged=self.registry.diverged,
            coalescer=self.coalescer.config,
        )

    def local_metrics(self) -> tuple[str, list[Metric]]:
        """This replica's id and metric families now (GET /metrics merges every replica's)."""
        if self.llm is not None:
            stats = self.llm.engine.stats()
            self.metrics.llm.load(self.llm.model_id, stats["running"], stats["waiting"])
        return self.replica_id, self.metrics.collect()

    def local_stats(self) -> ReplicaStats:
        s = self.coalescer.stats
        llm = {f"llm_{k}": v for k, v in self.llm.engine.stats().items()} if self.llm else {}
        return ReplicaStats(
            replica=self.replica_id,
            requests=s.requests,
            batches=s.batches,
            tasks=s.tasks,
            mean_batch_size=s.mean_batch_size,
            max_batch_seen=s.max_batch_seen,
            rejected=s.rejected,
            expired=s.expired,
            queue_depth=self.coalescer.queue_depth,
            sizes=dict(s.sizes),
            config=self.coalescer.config,
            **llm,
        )

    # -- helpers for the routes ------------------------------------------------------------------
    def readiness(self) -> ReadyResponse:
        """Ready unless the backend stalled or the registry could not be applied."""
        reason = self.runtime.broken or self.registry.diverged
        return ReadyResponse(
            ready=reason is None,
            replica=self.replica_id,
            registry_seq=self.registry.applied.seq,
            reason=reason,
        )

    async def change(
        self, note: ChangeNote, apply: Callable[[Runtime], T]
    ) -> tuple[T, ChangeResponse]:
        """Make the change `note` describes with `apply` here (compiles off the event loop), store
        it, push it to every replica. Shielded: a client that hangs up must not stop the push of
        a change already stored."""
        return await asyncio.shield(self._change_everywhere(note, apply))

    async def _change_everywhere(
        self, note: ChangeNote, apply: Callable[[Runtime], T]
    ) -> tuple[T, ChangeResponse]:
        try:
            made, state = await asyncio.to_thread(self.registry.change, apply, note)
        except Exception:
            self.metrics.changed(note.action, False)
            raise
        self.metrics.changed(note.action, True)
        reports, unreachable = await self.broadcast("apply_registry", state)
        return made, ChangeResponse(
            action=note.action,
            op=admin_op(self.runtime.table, note.op, state.log),
            version=state.log[-1].version,
            registry_seq=state.seq,
            replicas=reports,
            unreachable=unreachable,
        )

    async def broadcast(self, method: str, *args: Any) -> tuple[list[Any], list[str]]:
        """Call `method` on every replica of this deployment: (results, failures as text)."""
        if self._peers is None:  # made lazily: the first broadcast comes after start-up
            self._peers = serve.get_deployment_handle(*self._deployment)
        results = await self._peers.broadcast(method, *args).results_async(
            timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
        )
        failed = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
        return [r for r in results if not isinstance(r, BaseException)], failed


# A function call rather than a class decorator: type checkers see the Deployment it makes.
GpuosIngress = serve.deployment(name="GpuosIngress")(GpuosReplica)


def replica_gpus(backend: Backend, cluster_gpus: float) -> int:
    """GPUs one replica reserves: 1 when its backend may use CUDA and the cluster has a GPU,
    else 0."""
    return 1 if backend != "cpu" and cluster_gpus > 0 else 0


def build_app(args: dict[str, object]) -> Application:
    """Serve app builder: validates `args` as `AppArgs` and binds the ingress deployment.

    Raises pydantic.ValidationError naming the bad key or value. Needs a connected Ray (Serve's
    controller runs builders inside it; in a script call `ray.init()` first): the cluster's GPU
    count decides whether replicas reserve a GPU, so the same config runs on machines without one.
    """
    config = AppArgs.model_validate(args)
    gpus = replica_gpus(config.backend, ray.cluster_resources().get("GPU", 0.0))
    options = {"num_gpus": gpus, "num_cpus": config.num_cpus}
    return GpuosIngress.options(ray_actor_options=options).bind(config)
