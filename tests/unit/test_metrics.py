"""Replica metrics: one Prometheus exposition of every replica's samples, labelled by replica, with
the LLM's metrics under vLLM's names and units."""

from __future__ import annotations

import pickle

from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import ReplicaMetrics, exposition

VLLM = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
}


def scrape(*replicas: tuple[str, ReplicaMetrics]) -> dict[str, list]:
    """name -> samples, as Prometheus reads GET /metrics (families pickled as between replicas)."""
    text = exposition((name, pickle.loads(pickle.dumps(m.collect()))) for name, m in replicas)
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def test_a_scrape_has_every_replica_and_vllm_names() -> None:
    first, second = ReplicaMetrics(), ReplicaMetrics()
    first.llm.load("tiny", running=2, waiting=1)
    first.llm.finished(
        "tiny",
        started=10.0,
        token_times=[10.5, 10.6, 10.8],
        ended=11.0,
        prompt_tokens=7,
        reason="length",
    )
    second.flushed(size=4, window_wait_s=1e-4, queue_depth=0)
    second.error("TensorDataError", 422)
    second.auto_rollback("gelu_tanh")
    families = scrape(("r1", first), ("r2", second))
    assert VLLM <= set(families)
    value = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for samples in families.values()
        for s in samples
    }
    tiny = (("model_name", "tiny"), ("replica", "r1"))
    assert value[("vllm:num_requests_running", tiny)] == 2
    assert value[("vllm:time_to_first_token_seconds_sum", tiny)] == 0.5
    assert value[("vllm:inter_token_latency_seconds_count", tiny)] == 2
    assert value[("vllm:e2e_request_latency_seconds_sum", tiny)] == 1.0
    assert value[("vllm:prompt_tokens_total", tiny)] == 7
    assert value[("vllm:generation_tokens_total", tiny)] == 3
    assert value[("vllm:request_success_total", (("finished_reason", "length"), *tiny))] == 1
    assert value[("gpuos_coalesced_batch_size_count", (("replica", "r2"),))] == 1
    assert (
        value[
            (
                "gpuos_request_errors_total",
                (("kind", "TensorDataError"), ("replica", "r2"), ("status", "422")),
            )
        ]
        == 1
    )
    assert (
        value[("gpuos_operator_auto_rollbacks_total", (("op", "gelu_tanh"), ("replica", "r2")))]
        == 1
    )
    assert {s.labels["replica"] for s in families["process_resident_memory_bytes"]} == {"r1", "r2"}
    assert not any(s.name.endswith("_created") for samples in families.values() for s in samples)
