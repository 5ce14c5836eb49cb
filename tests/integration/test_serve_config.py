"""The shipped Serve config run the way a user runs it (`serve run`), reached over HTTP."""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pydantic
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serving.app import Backend, GpuosIngress, build_app, replica_gpus

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deployments" / "llm.yaml"
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_when_up(url: str, timeout_s: float) -> httpx.Response | None:
    """GETs `url` until it answers 200 (the proxy refuses, then answers 404, until the app is up).

    Returns the last response, or None when nothing ever answered.
    """
    deadline, response = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=5.0)
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    return response


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stops `serve run` so that it tears its Ray cluster down; kills the whole group if stuck.

    SIGTERM, not SIGINT: a process started from a background job inherits SIGINT ignored.
    """
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def local_config(tmp_dir: Path, port: int) -> Path:
    """The shipped config with its port moved to `port` and the backend fixed to cpu."""
    config = yaml.safe_load(CONFIG.read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["backend"] = "cpu"
    path = tmp_dir / "llm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass(frozen=True)
class ServeRun:
    """A running `serve run`."""

    url: str  # base URL of its HTTP proxy
    log: Path  # its stdout and stderr

    def log_tail(self) -> str:
        """The end of its log, for assertion messages."""
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    """`serve run` on the shipped config (its own Ray cluster, a free port); stopped afterwards."""
    tmp_dir, port = tmp_path_factory.mktemp("serve"), free_port()
    run = ServeRun(url=f"http://127.0.0.1:{port}", log=tmp_dir / "serve.log")
    serve_cli = Path(sys.executable).with_name("serve")  # the venv's, whatever PATH says
    with run.log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(serve_cli), "run", str(local_config(tmp_dir, port))],
            cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
    yield run
    stop(proc)


def test_healthz_answers_ok_with_backend(served: ServeRun) -> None:
    response = get_when_up(f"{served.url}/healthz", STARTUP_TIMEOUT_S)
    assert response is not None and response.status_code == 200, served.log_tail()
    assert response.json() == {"status": "ok", "backend": "cpu"}


def test_shipped_config_names_a_builder_and_its_deployment() -> None:
    schema = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app_schema,) = schema.applications
    module_name, attr = app_schema.import_path.split(":")
    assert getattr(importlib.import_module(module_name), attr) is build_app
    # Serve rejects a config whose deployment names do not exist in the built app.
    assert [d.name for d in app_schema.deployments] == [GpuosIngress.name]


@pytest.mark.parametrize("args", [{"backend": "tpu"}, {"backend": "cpu", "bakend": "cuda"}])
def test_build_app_rejects_bad_args(args: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        build_app(args)


@pytest.mark.parametrize(
    ("backend", "cluster_gpus", "expected"),
    [("auto", 0.0, 0), ("auto", 2.0, 1), ("cuda", 1.0, 1), ("cpu", 4.0, 0)],
)
def test_replicas_reserve_a_gpu_only_when_one_exists_and_may_be_used(
    backend: Backend, cluster_gpus: float, expected: int
) -> None:
    assert replica_gpus(backend, cluster_gpus) == expected
