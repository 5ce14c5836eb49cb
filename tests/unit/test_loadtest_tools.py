"""What the load tests' numbers rest on: the ingress they ask for is the one they get (or they say
why not), the @serve.batch baseline's concatenated torch calls give each request its own result,
the soak counts only promised load shedding as shed, its memory figures follow each replica
process across a kill, CPU is reported by the OS names our threads carry, and the tokens of every
load-generating process are counted."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from gpuos_core import OpCall
from gpuos_core.threads import OS_NAME_BYTES, daemon
from loadtest.baselines import grouped, reference, run_group
from loadtest.completions import Generated
from loadtest.launch import HAPROXY_ENV, ingress_env, thread_cpu_seconds
from loadtest.run import read_generated, tokens_file
from loadtest.soak import Sample, memory_summary
from loadtest.statuses import SHED, shed


def test_haproxy_is_turned_on_only_where_the_program_exists(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    assert ingress_env("proxy") == ("proxy", {})
    program = tmp_path / "haproxy"
    program.write_text("#!/bin/sh\n")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(program))  # not executable
    with caplog.at_level(logging.WARNING):
        assert ingress_env("haproxy") == ("proxy", {})
    assert "HAProxy ingress off: no haproxy program" in caplog.text
    program.chmod(0o755)
    assert ingress_env("haproxy") == ("haproxy", HAPROXY_ENV)


def test_the_serve_batch_baseline_concatenates_only_calls_that_line_up() -> None:
    calls = [OpCall("softmax", (torch.randn(rows, 64),)) for rows in (1, 3, 8)]
    calls += [OpCall("add", (torch.randn(256), torch.randn(256))) for _ in range(2)]
    calls += [
        OpCall("add", (torch.randn(4, 1), torch.randn(1, 4))),  # broadcasts: alone
        OpCall("sum", (torch.randn(4, 4),), dims=(1,)),  # a reduction: alone
        OpCall("softmax", (torch.randn(2, 32),)),  # another width
        OpCall("leaky_relu", (torch.randn(9),), scalars={"negative_slope": 0.2}),
        OpCall("leaky_relu", (torch.randn(9),), scalars={"negative_slope": 0.3}),
    ]
    groups = grouped(calls)
    assert groups == [[0, 1, 2], [3, 4], [5], [6], [7], [8], [9]]
    for members in groups:
        for i, out in zip(members, run_group([calls[i] for i in members])):
            torch.testing.assert_close(out, reference(calls[i]))


class _Answer:
    """What `shed` reads and writes of a Locust response."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status_code, self.headers = status, headers
        self.request_meta = {"name": "/v1/ops/softmax"}
        self.succeeded = False

    def success(self) -> None:
        self.succeeded = True


@pytest.mark.parametrize(
    ("status", "headers", "is_shed"),
    [
        (503, {"Retry-After": "1"}, True),
        (504, {}, True),
        (503, {}, False),  # a 503 that does not say when to come back is a failure
        (500, {"Retry-After": "1"}, False),
        (429, {}, False),
        (200, {}, False),
    ],
)
def test_only_the_promised_load_shedding_counts_as_shed(
    status: int, headers: dict[str, str], is_shed: bool
) -> None:
    answer = _Answer(status, headers)
    assert shed(answer) is is_shed
    assert answer.succeeded is is_shed
    assert answer.request_meta["name"] == (f"{SHED} {status}" if is_shed else "/v1/ops/softmax")


def test_soak_memory_follows_each_replica_process_across_a_kill() -> None:
    samples = [
        Sample(0.0, {1: 900.0, 2: 900.0}, {1: 5000.0}, 9000.0),  # before --settle: start-up
        Sample(60.0, {1: 400.0, 2: 410.0}, {1: 700.0, 2: 700.0}, 1500.0),
        Sample(120.0, {1: 405.0, 2: 420.0}, {1: 700.0, 2: 700.0}, 1500.0),  # 1 killed after
        Sample(180.0, {2: 425.0, 3: 380.0}, {2: 700.0, 3: 690.0}, 1490.0),
        Sample(240.0, {2: 430.0, 3: 400.0}, {2: 700.0, 3: 700.0}, 1500.0),
    ]
    summary = memory_summary(samples, settle_s=60.0)
    replicas = summary["replicas"]
    assert isinstance(replicas, dict)
    assert replicas["1"] == {
        "from_s": 60.0,
        "to_s": 120.0,
        "rss_mb_start": 400.0,
        "rss_mb_end": 405.0,
        "gpu_mb_start": 700.0,
        "gpu_mb_end": 700.0,
    }
    assert (replicas["2"]["rss_mb_start"], replicas["2"]["rss_mb_end"]) == (410.0, 430.0)
    assert (replicas["3"]["from_s"], replicas["3"]["rss_mb_start"]) == (180.0, 380.0)
    assert (summary["gpu_used_mb_start"], summary["gpu_used_mb_end"]) == (1500.0, 1500.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names from /proc")
def test_cpu_is_reported_by_the_os_names_our_threads_carry() -> None:
    """`top -H` and the load test's replica_thread_cpu_ms tell the engine and the runtime's
    threads apart by these names."""
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()  # named by now: daemon names the OS thread before it runs its target
        while not stop.is_set():
            sum(range(1000))

    name = "gpuos-test-spinner"
    thread = daemon(spin, name)
    started.wait(5)
    before = thread_cpu_seconds([os.getpid()])
    time.sleep(0.5)
    after = thread_cpu_seconds([os.getpid()])
    stop.set()
    thread.join()
    short = name[:OS_NAME_BYTES]  # the OS keeps 15 bytes
    assert thread.name == name
    assert after[short] - before[short] > 0.2  # it spun most of the half second


def test_the_tokens_of_every_load_process_are_summed(tmp_path: Path) -> None:
    """With --load-processes, each Locust worker writes its own counts (the master none): the
    run's tokens are their sum, and another run's files beside them are not counted."""
    prefix = tmp_path / "completions-on"
    counts = [Generated("", 0, 0), Generated("tiny", 10, 5), Generated("tiny", 7, 1)]
    for suffix, generated in zip(("", ".101", ".102"), counts):
        Path(f"{tokens_file(prefix)}{suffix}").write_text(json.dumps(asdict(generated)))
    Path(f"{tokens_file(tmp_path / 'completions-off')}.103").write_text(
        json.dumps(asdict(Generated("tiny", 1000, 1000)))
    )
    assert read_generated(prefix) == Generated("tiny", 17, 6)
