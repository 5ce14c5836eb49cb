"""Replica metrics through `ray.serve.metrics` (Prometheus at the Ray metrics port, tagged with the
deployment and replica by Serve). Created in the replica: Ray's metrics need a connected worker."""
from __future__ import annotations

from ray.serve import metrics

SIZE_BOUNDS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
WAIT_BOUNDS_MS = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]
TTFT_BOUNDS_MS = [5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]


class ReplicaMetrics:
    """The serving layer's own metrics; the coalescer calls `flushed` once per submission."""

    def __init__(self) -> None:
        self._batch = metrics.Histogram(
            "gpuos_coalesced_batch_size", "tasks per runtime submission", SIZE_BOUNDS)
        self._wait = metrics.Histogram(
            "gpuos_coalescer_window_wait_ms",
            "how long the oldest task of a submission waited for it", WAIT_BOUNDS_MS)
        self._depth = metrics.Gauge(
            "gpuos_coalescer_queue_depth", "tasks waiting for a flush, after the last flush")
        self._changes = metrics.Counter(
            "gpuos_operator_changes_total", "register/swap/rollback requests by outcome",
            tag_keys=("action", "outcome"))
        self._errors = metrics.Counter(
            "gpuos_request_errors_total", "requests answered with an error, by error class",
            tag_keys=("kind", "status"))

        self._completions = metrics.Counter(
            "gpuos_completion_requests_total", "completion requests by mode",
            tag_keys=("stream",))
        self._tokens = metrics.Counter(
            "gpuos_generated_tokens_total", "tokens generated for completions")
        self._ttft = metrics.Histogram(
            "gpuos_time_to_first_token_ms", "streamed completions: request to first chunk",
            TTFT_BOUNDS_MS)

    def completion(self, prompts: int, stream: bool) -> None:
        self._completions.inc(prompts, tags={"stream": str(stream).lower()})

    def generated(self, tokens: int) -> None:
        if tokens:
            self._tokens.inc(tokens)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(1e3 * seconds)

    def flushed(self, size: int, window_wait_s: float, queue_depth: int) -> None:
        self._batch.observe(size)
        self._wait.observe(1e3 * window_wait_s)
        self._depth.set(queue_depth)

    def changed(self, action: str, ok: bool) -> None:
        self._changes.inc(tags={"action": action, "outcome": "ok" if ok else "failed"})

    def error(self, kind: str, status: int) -> None:
        self._errors.inc(tags={"kind": kind, "status": str(status)})
