"""Replica metrics in Prometheus' format, served by GET /metrics on the serving port.

Each replica keeps its own prometheus_client registry (no Ray needed: the coalescer and its tests
use it bare). A scrape asks every replica for its samples (`DeploymentHandle.broadcast`) and writes
them as one exposition with a `replica` label, so one scrape of the Serve port covers the whole
deployment. The LLM's metrics carry vLLM's names and units, so dashboards made for vLLM work.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WAIT_BOUNDS_S = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1)
TTFT_BOUNDS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)  # vLLM's buckets
ITL_BOUNDS_S = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BOUNDS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ReplicaMetrics:
    """The metrics of one replica. The coalescer calls `flushed` once per submission, the routes
    the rest; `collect` reads them all (the LLM's gauges are set from the engine first)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        self._batch = Histogram(
            "gpuos_coalesced_batch_size",
            "tasks per runtime submission",
            buckets=SIZE_BOUNDS,
            registry=r,
        )
        self._wait = Histogram(
            "gpuos_coalescer_window_wait_seconds",
            "how long the oldest task of a submission waited for it",
            buckets=WAIT_BOUNDS_S,
            registry=r,
        )
        self._depth = Gauge(
            "gpuos_coalescer_queue_depth",
            "tasks waiting for a flush, after the last flush",
            registry=r,
        )
        self._changes = Counter(
            "gpuos_operator_changes",
            "register/swap/rollback by outcome",
            ("action", "outcome"),
            registry=r,
        )
        self._auto = Counter(
            "gpuos_operator_auto_rollbacks",
            "operators rolled back by the swap watch, by operator",
            ("op",),
            registry=r,
        )
        self._errors = Counter(
            "gpuos_request_errors",
            "requests answered with an error, by error class and status",
            ("kind", "status"),
            registry=r,
        )
        self.llm = LlmMetrics(r)

    def flushed(self, size: int, window_wait_s: float, queue_depth: int) -> None:
        self._batch.observe(size)
        self._wait.observe(window_wait_s)
        self._depth.set(queue_depth)

    def changed(self, action: str, ok: bool) -> None:
        self._changes.labels(action, "ok" if ok else "failed").inc()

    def auto_rollback(self, op: str) -> None:
        self._auto.labels(op).inc()

    def error(self, kind: str, status: int) -> None:
        self._errors.labels(kind, str(status)).inc()

    def collect(self) -> list[Metric]:
        """Every metric family with its samples now (picklable: sent between replicas)."""
        return list(self.registry.collect())


class LlmMetrics:
    """vLLM's request metrics (names, units and label `model_name` as vLLM exports them)."""

    def __init__(self, r: CollectorRegistry) -> None:
        model = ("model_name",)
        self.running = Gauge(
            "vllm:num_requests_running", "requests decoding now", model, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "requests waiting for a KV slot", model, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "request arrival to its first generated token",
            model,
            buckets=TTFT_BOUNDS_S,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "time between consecutive generated tokens of a request",
            model,
            buckets=ITL_BOUNDS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "request arrival to its last token",
            model,
            buckets=E2E_BOUNDS_S,
            registry=r,
        )
        self.prompt = Counter(
            "vllm:prompt_tokens", "prompt tokens of finished requests", model, registry=r
        )
        self.generation = Counter(
            "vllm:generation_tokens", "generated tokens of finished requests", model, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "finished requests by finish reason",
            ("model_name", "finished_reason"),
            registry=r,
        )

        self._by_model: dict[str, _Children] = {}
        self._success: dict[tuple[str, str], Counter] = {}  # (model, reason): its child

    def _children(self, model: str) -> _Children:
        """`model`'s labelled children of the request metrics, looked up once: a labels() call
        costs the event loop microseconds, six of them a request."""
        children = self._by_model.get(model)
        if children is None:
            children = self._by_model[model] = _Children(
                self.ttft.labels(model),
                self.itl.labels(model),
                self.e2e.labels(model),
                self.prompt.labels(model),
                self.generation.labels(model),
            )
        return children

    def load(self, model: str, running: int, waiting: int) -> None:
        """The engine's queue now (set just before a scrape reads it)."""
        self.running.labels(model).set(running)
        self.waiting.labels(model).set(waiting)

    def finished(
        self,
        model: str,
        started: float,
        token_times: Sequence[float],
        ended: float,
        prompt_tokens: int,
        reason: str,
    ) -> None:
        """One request (one choice) done: `started`, `token_times` and `ended` are
        time.perf_counter() readings; `reason` its finish reason."""
        m = self._children(model)
        if token_times:
            m.ttft.observe(token_times[0] - started)
            for before, after in zip(token_times, token_times[1:]):
                m.itl.observe(after - before)
        m.e2e.observe(ended - started)
        m.prompt.inc(prompt_tokens)
        m.generation.inc(len(token_times))
        success = self._success.get((model, reason))
        if success is None:
            success = self._success[model, reason] = self.success.labels(model, reason)
        success.inc()


class _Children(NamedTuple):
    """One model's children of LlmMetrics' request metrics."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prompt: Counter
    generation: Counter


def exposition(per_replica: Iterable[tuple[str, Sequence[Metric]]]) -> bytes:
    """One Prometheus text exposition of every replica's families, each sample labelled with its
    replica (`_created` timestamps left out: they would only change at every replica start)."""
    families: dict[str, Metric] = {}
    for replica, metrics in per_replica:
        for metric in metrics:
            merged = families.setdefault(
                metric.name, Metric(metric.name, metric.documentation, metric.type, metric.unit)
            )
            merged.samples.extend(
                s._replace(labels={**s.labels, "replica": replica})
                for s in metric.samples
                if not s.name.endswith("_created")
            )
    return generate_latest(_Families(list(families.values())))


class _Families:
    """A collector of fixed families: what generate_latest reads."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
