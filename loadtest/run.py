"""Run a load-test scenario against gpuos-serve and write its report.

    python -m loadtest.run micro --users 32 --duration 30            # coalescing on, then off
    python -m loadtest.run swap-storm --users 16 --duration 30
    python -m loadtest.run micro --url http://127.0.0.1:8000 --admin-token "$GPUOS_ADMIN_TOKEN"

Without --url it starts the app itself (`serve run` of --config on a free port, a fresh operator
registry, a random admin token) and stops it afterwards. After --warmup seconds of unrecorded
load, for each coalescing mode it sets the knob on every replica (PUT /admin/coalescer), runs
Locust headless and writes into --out: <scenario>-<mode>_stats.csv (and Locust's other CSVs and
its final JSON), <scenario>-<mode>.json (RPS, p50/p95/p99, failures, mean coalesced batch size
from /v1/stats), summary.json (all modes, with on/off ratios) and <scenario>.png (latency
percentiles and RPS over time; needs matplotlib, the `load` extra). Exits 1 when any request
failed.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from loadtest.launch import REPO, free_port, start_serve, write_config
from loadtest.storm import ensure_registered

SCENARIOS = {  # scenario → Locust user classes
    "micro": ("MicroOpUser",),
    "swap-storm": ("MicroOpUser", "StormUser", "StormAdmin"),
}
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


@dataclass(frozen=True)
class Target:
    """The app under load."""

    url: str
    admin_token: str


@dataclass(frozen=True)
class RunSummary:
    """One Locust run (one scenario, one coalescing mode)."""

    scenario: str
    coalescing: str            # "on" or "off"
    users: int
    duration_s: float
    requests: int
    failures: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch_size: float     # tasks per runtime submission during the run, all replicas
    submissions: int           # runtime submissions during the run
    csv_prefix: str


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per mode")
    parser.add_argument("--coalescing", choices=("on", "off", "both"), default="both")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds of unrecorded load before the measured runs")
    parser.add_argument("--url", help="an app already running (default: start one)")
    parser.add_argument("--admin-token", default=os.environ.get("GPUOS_ADMIN_TOKEN"),
                        help="its admin token (default $GPUOS_ADMIN_TOKEN)")
    parser.add_argument("--config", type=Path, default=REPO / "deployments" / "llm.yaml",
                        help="Serve config to start when no --url is given")
    parser.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", type=Path, help="report folder (default loadtest/results/...)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO / "loadtest" / "results" / f"{args.scenario}-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    modes = ("on", "off") if args.coalescing == "both" else (args.coalescing,)
    with target_app(args, out) as target:
        if args.warmup > 0:  # a fresh app's first seconds (imports, connections) skew mode 1
            run_locust(target, args, out / "warmup" / args.scenario, args.warmup)
        runs = [run_mode(target, args, mode, out) for mode in modes]
        environment = describe(target)
    summary = {"environment": environment, "runs": [asdict(r) for r in runs], **ratios(runs)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(runs, out / f"{args.scenario}.png")
    print(json.dumps(summary, indent=2))
    print(f"report: {out / 'summary.json'}")
    return 1 if any(r.failures for r in runs) else 0


@contextmanager
def target_app(args: argparse.Namespace, out: Path) -> Iterator[Target]:
    """The app at --url, or one started from --config for the duration of the block."""
    if args.url:
        if not args.admin_token:
            raise SystemExit("--url needs --admin-token (or $GPUOS_ADMIN_TOKEN) to set the knobs")
        yield Target(args.url.rstrip("/"), args.admin_token)
        return
    token, port = secrets.token_urlsafe(16), free_port()
    with tempfile.TemporaryDirectory(prefix="gpuos-load-") as state:
        config = write_config(args.config, out / "serve.yaml", port,
                              {"backend": args.backend, "state_dir": state, "admin_token": token})
        app = start_serve(config, port, out / "serve.log")
        try:
            app.wait_until_up()
            yield Target(app.url, token)
        finally:
            app.stop()


def run_mode(target: Target, args: argparse.Namespace, mode: str, out: Path) -> RunSummary:
    """One Locust run with coalescing `mode`; its summary JSON is written beside its CSVs."""
    set_coalescing(target, mode == "on")
    if "StormAdmin" in SCENARIOS[args.scenario]:
        ensure_registered(target.url, target.admin_token)  # a compile: not in the measured time
    before = total_stats(target)
    prefix = out / f"{args.scenario}-{mode}"
    run_locust(target, args, prefix, args.duration)
    after = total_stats(target)
    summary = summarize(args, mode, prefix, before, after)
    prefix.with_suffix(".json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def set_coalescing(target: Target, enabled: bool) -> None:
    response = requests.put(f"{target.url}/admin/coalescer", json={"enabled": enabled},
                            headers={"Authorization": f"Bearer {target.admin_token}"}, timeout=60)
    response.raise_for_status()
    body = response.json()
    if body["unreachable"] or any(r["coalescer"]["enabled"] != enabled for r in body["replicas"]):
        raise RuntimeError(f"coalescing not set on every replica: {body}")


def total_stats(target: Target) -> dict[str, float]:
    response = requests.get(f"{target.url}/v1/stats", timeout=60)
    response.raise_for_status()
    return response.json()["total"]


def run_locust(target: Target, args: argparse.Namespace, prefix: Path, seconds: float) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
               "-u", str(args.users), "-r", str(args.users), "-t", f"{seconds:g}s",
               "--host", target.url, "--csv", str(prefix), "--csv-full-history",
               "--json-file", str(prefix) + "_locust",
               "--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING",
               *SCENARIOS[args.scenario]]
    env = {**os.environ, "GPUOS_ADMIN_TOKEN": target.admin_token}
    subprocess.run(command, check=True, env=env, cwd=REPO)


def summarize(args: argparse.Namespace, mode: str, prefix: Path, before: dict[str, float],
              after: dict[str, float]) -> RunSummary:
    """The run's totals from Locust's final JSON (its stats CSV is written periodically and can
    miss the last second) and the coalescer's counters before and after."""
    entries = json.loads(Path(f"{prefix}_locust.json").read_text())
    requests_ = sum(e["num_requests"] for e in entries)
    span = (max(e["last_request_timestamp"] for e in entries)
            - min(e["start_time"] for e in entries)) if entries else 0.0
    times = merged_response_times(entries)
    submissions = int(after["batches"] - before["batches"])
    tasks = after["tasks"] - before["tasks"]
    return RunSummary(
        scenario=args.scenario, coalescing=mode, users=args.users, duration_s=args.duration,
        requests=requests_, failures=sum(e["num_failures"] for e in entries),
        rps=requests_ / span if span else 0.0, p50_ms=percentile(times, 0.50),
        p95_ms=percentile(times, 0.95), p99_ms=percentile(times, 0.99),
        mean_batch_size=tasks / submissions if submissions else 0.0,
        submissions=submissions, csv_prefix=str(prefix))


def merged_response_times(entries: Sequence[dict]) -> dict[float, int]:
    """Locust's response-time histograms (ms, rounded as Locust rounds them) of all entries."""
    merged: dict[float, int] = {}
    for entry in entries:
        for ms, count in entry["response_times"].items():
            merged[float(ms)] = merged.get(float(ms), 0) + count
    return merged


def percentile(histogram: dict[float, int], q: float) -> float:
    """The smallest response time with at least a fraction `q` of requests at or below it."""
    total, seen = sum(histogram.values()), 0
    for ms in sorted(histogram):
        seen += histogram[ms]
        if seen >= q * total:
            return ms
    return 0.0


def ratios(runs: Sequence[RunSummary]) -> dict[str, float]:
    """Coalescing on over off, when both ran."""
    by_mode = {r.coalescing: r for r in runs}
    if {"on", "off"} - set(by_mode):
        return {}
    on, off = by_mode["on"], by_mode["off"]
    return {"rps_on_over_off": on.rps / off.rps if off.rps else 0.0,
            "p99_on_over_off": on.p99_ms / off.p99_ms if off.p99_ms else 0.0}


def describe(target: Target) -> dict[str, object]:
    """Where the numbers come from: backend, host, commit."""
    backend = requests.get(f"{target.url}/healthz", timeout=30).json()["backend"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                            capture_output=True).stdout.strip()
    return {"backend": backend, "url": target.url, "host": platform.node(),
            "cpus": os.cpu_count(), "commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def plot(runs: Sequence[RunSummary], path: Path) -> None:
    """Latency percentiles and RPS over time, one line per mode (skipped without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[load]'): no plot", file=sys.stderr)
        return
    fig, (lat, rps) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for run, color in zip(runs, ("tab:blue", "tab:orange")):
        t, series = history(Path(f"{run.csv_prefix}_stats_history.csv"))
        for pct, style in (("50%", ":"), ("95%", "--"), ("99%", "-")):
            lat.plot(t, series[pct], style, color=color,
                     label=f"coalescing {run.coalescing} p{pct[:-1]}")
        rps.plot(t, series["Requests/s"], color=color, label=f"coalescing {run.coalescing}")
    lat.set_ylabel("latency (ms)")
    lat.set_title(f"{runs[0].scenario}: {runs[0].users} users")
    lat.legend(fontsize="small")
    rps.set_ylabel("requests/s")
    rps.set_xlabel("seconds")
    rps.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def history(path: Path) -> tuple[list[float], dict[str, list[float]]]:
    """Seconds since start and per-second series of Locust's Aggregated history rows."""
    with path.open() as source:
        rows = [r for r in csv.DictReader(source)
                if r["Name"] == "Aggregated" and r["50%"] != "N/A"]
    start = float(rows[0]["Timestamp"]) if rows else 0.0
    keys = ("50%", "95%", "99%", "Requests/s")
    return ([float(r["Timestamp"]) - start for r in rows],
            {k: [float(r[k]) for r in rows] for k in keys})


if __name__ == "__main__":
    sys.exit(main())
