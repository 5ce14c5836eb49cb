"""Start a Serve config with `serve run` the way a user does, on a free port, and stop it cleanly.
Used by loadtest/run.py and by the integration tests."""
from __future__ import annotations

import os
import signal
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(base: Path, dest: Path, port: int, args: Mapping[str, object],
                 deployment: Mapping[str, object] | None = None) -> Path:
    """`base` with its HTTP port set to `port`, `args` merged into the app's args and
    `deployment` into its (first) deployment; written to `dest`."""
    config = yaml.safe_load(base.read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"].update(args)
    app["deployments"][0].update(deployment or {})
    dest.write_text(yaml.safe_dump(config))
    return dest


@dataclass
class ServeProcess:
    """A running `serve run` (its own local Ray cluster)."""

    url: str                          # base URL of its HTTP proxy
    log: Path                         # its stdout and stderr
    proc: subprocess.Popen[bytes]

    def log_tail(self, chars: int = 4000) -> str:
        """The end of its log, for error messages."""
        return self.log.read_text(errors="replace")[-chars:]

    def wait_until_up(self, path: str = "/healthz", timeout_s: float = 180.0) -> None:
        """Block until GET `path` answers 200; RuntimeError with the log if it never does or
        the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if _answers_200(self.url + path):
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.url}{path} not up after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop `serve run` so that it tears its Ray cluster down; kill the group if stuck.
        SIGTERM, not SIGINT: a process started from a background job inherits SIGINT ignored."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_serve(config: Path, port: int, log: Path,
                env: Mapping[str, str] | None = None) -> ServeProcess:
    """`serve run config` from the repository root in its own process group, logging to `log`."""
    serve_cli = Path(sys.executable).with_name("serve")  # the venv's, whatever PATH says
    if not serve_cli.exists():  # an interpreter whose packages came from elsewhere (PYTHONPATH)
        serve_cli = Path(shutil.which("serve") or "serve")
    with log.open("wb") as sink:
        proc = subprocess.Popen([str(serve_cli), "run", str(config)], cwd=REPO, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})})
    return ServeProcess(url=f"http://127.0.0.1:{port}", log=log, proc=proc)


@contextmanager
def served(base: Path, tmp: Path, args: Mapping[str, object], ready: str = "/healthz"
           ) -> Iterator[ServeProcess]:
    """`serve run` of config `base` on a free port with `args` merged into the app's args (config
    and log written into `tmp`), once GET `ready` answers 200; stopped when the block ends."""
    port = free_port()
    config = write_config(base, tmp / base.name, port, args)
    process = start_serve(config, port, tmp / "serve.log")
    try:
        process.wait_until_up(ready)
        yield process
    finally:
        process.stop()


def _answers_200(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False
