"""What the load tests' numbers rest on: the ingress they ask for is the one they get (or they say
why not), and the @serve.batch baseline's concatenated torch calls give each request its own
result."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from gpuos_core import OpCall
from loadtest.baselines import grouped, reference, run_group
from loadtest.launch import HAPROXY_ENV, ingress_env


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
