"""Run a load-test scenario against gpuos-serve and write its report.

    python -m loadtest.run micro --users 32 --duration 30            # coalescing on, then off
    python -m loadtest.run swap-storm --users 16 --duration 30
    python -m loadtest.run completions --users 16 --duration 60 --stream-fraction 0.5
    python -m loadtest.run micro --url http://127.0.0.1:8000 --admin-token "$GPUOS_ADMIN_TOKEN"
    python -m loadtest.run micro --ingress haproxy --encoding b64    # HAProxy, base64 tensors

Without --url it starts the app itself (`serve run` of --config on a free port, a fresh operator
registry, a random admin token; --ingress haproxy: behind HAProxy in Serve's throughput-optimized
mode where the haproxy program exists, see loadtest/launch.py) and stops it afterwards; with --url
it puts the coalescer's knobs
back as they were when it ends. After --warmup seconds of unrecorded load, for each coalescing mode
it sets the knob on every replica (PUT /admin/coalescer), runs Locust headless and writes into
--out: <scenario>-<mode>_stats.csv (and Locust's other CSVs and its final JSON),
<scenario>-<mode>.json (RPS, p50/p95/p99 and failures, in all and per request name, mean coalesced
batch size from /v1/stats; for completions also time to first token and generated tokens/s),
summary.json (all modes, with on/off ratios) and <scenario>.png (latency percentiles and RPS over
time; needs matplotlib, the `load` extra). Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from loadtest.completions import (
    COMPLETION,
    MAX_TOKENS,
    MEASURES,
    STREAM,
    STREAM_FRACTION,
    TTFT,
    Generated,
)
from loadtest.launch import (
    APP_REPLICAS,
    ENCODINGS,
    INGRESSES,
    REPO,
    ingress_env,
    replica_pids,
    served,
    thread_cpu_seconds,
)
from loadtest.storm import admin_headers, ensure_registered

SCENARIOS = {  # scenario → Locust user classes
    "micro": ("MicroOpUser",),
    "swap-storm": ("MicroOpUser", "StormUser", "StormAdmin"),
    "completions": ("CompletionUser",),
}
PLOTTED = {"completions": (COMPLETION, STREAM, TTFT)}  # Locust rows plotted (default Aggregated)
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"


@dataclass(frozen=True)
class Target:
    """The app under load."""

    url: str
    admin_token: str
    ingress: str = "proxy"  # what serves its HTTP port (launch.INGRESSES); "" for --url


@dataclass(frozen=True)
class RequestStats:
    """Requests of one Locust entry (or several, merged) during a run."""

    requests: int
    failures: int
    rps: float  # over the whole run's span
    p50_ms: float
    p95_ms: float
    p99_ms: float


@dataclass(frozen=True)
class GenerationSummary:
    """What a completions run generated, from the answers that passed their checks."""

    model: str
    max_tokens: int
    stream_fraction: float
    tokens: int  # usage.completion_tokens of answers, text chunks of streams
    tokens_per_s: float
    ttft_p50_ms: float  # streams' time to the first chunk with text
    ttft_p99_ms: float
    steps: int  # engine steps during the run, all replicas (/v1/stats)
    programs_built: int  # step programs built during the run: each held its step (and
    program_build_s: float  # every stream in it) for the time it took


@dataclass(frozen=True)
class RunSummary:
    """One Locust run (one scenario, one coalescing mode)."""

    scenario: str
    coalescing: str  # "on" or "off"
    users: int
    duration_s: float
    requests: int  # all requests; not the entries in MEASURES (parts of requests)
    failures: int
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch_size: float  # tasks per runtime submission during the run, all replicas
    submissions: int  # runtime submissions during the run
    per_request: dict[str, RequestStats]  # Locust entry name → its requests
    generation: GenerationSummary | None  # completions only
    # CPU ms a request by OS thread name (launch.thread_cpu_seconds), the main app's replicas on
    # this host; empty when none runs here
    replica_thread_cpu_ms: dict[str, float]
    csv_prefix: str


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per mode")
    parser.add_argument("--coalescing", choices=("on", "off", "both"), default="both")
    parser.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds of unrecorded load before the measured runs",
    )
    parser.add_argument("--url", help="an app already running (default: start one)")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("GPUOS_ADMIN_TOKEN"),
        help="its admin token (default $GPUOS_ADMIN_TOKEN)",
    )
    app_arguments(parser, ingress="proxy")
    parser.add_argument(
        "--encoding",
        choices=ENCODINGS,
        default="list",
        help="micro, swap-storm: how calls send tensors (JSON lists, base64)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="completions: max_tokens"
    )
    parser.add_argument(
        "--stream-fraction",
        type=float,
        default=STREAM_FRACTION,
        help="completions: the fraction of requests that stream",
    )
    parser.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="Locust processes generating the load (its --processes): one Python process "
        "caps what Locust can send",
    )
    parser.add_argument("--out", type=Path, help="report folder (default loadtest/results/...)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = report_dir(args.out, args.scenario)
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


def report_dir(out: Path | None, name: str) -> Path:
    """`out`, else loadtest/results/<name>-<time>; made if missing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = (out or REPO / "loadtest" / "results" / f"{name}-{stamp}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def target_app(args: argparse.Namespace, out: Path) -> Iterator[Target]:
    """The app at --url, or one started from --config for the duration of the block."""
    if args.url:
        if not args.admin_token:
            raise SystemExit("--url needs --admin-token (or $GPUOS_ADMIN_TOKEN) to set the knobs")
        target = Target(args.url.rstrip("/"), args.admin_token, ingress="")
        knobs = coalescer_knobs(target)
        try:
            yield target
        finally:  # the app is someone else's: leave its coalescer as it was
            put_coalescer(target, knobs)
        return
    with started_app(args, out) as target:
        yield target


def app_arguments(parser: argparse.ArgumentParser, ingress: str) -> None:
    """The arguments `started_app` reads (--config, --backend, --ingress), `ingress` the
    default ingress."""
    parser.add_argument(
        "--config",
        type=Path,
        default=REPO / "deployments" / "llm.yaml",
        help="Serve config to start when no --url is given",
    )
    parser.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--ingress",
        choices=INGRESSES,
        default=ingress,
        help="the started app's ingress: Ray Serve's proxy (it answers 500 for the requests of "
        "a killed replica), or HAProxy with throughput-optimized Serve (it replays them on "
        "another; falls back to the proxy, saying so, where there is no haproxy program)",
    )


@contextmanager
def started_app(
    args: argparse.Namespace, out: Path, deployment: Mapping[str, object] | None = None
) -> Iterator[Target]:
    """The app of --config with --backend behind --ingress, `deployment` merged into its
    deployment's options, on a fresh registry with a random admin token (log and config in
    `out`), for the duration of the block."""
    token = secrets.token_urlsafe(16)
    ingress, env = ingress_env(args.ingress)
    with (
        tempfile.TemporaryDirectory(prefix="gpuos-load-") as state,
        served(
            args.config,
            out,
            {"backend": args.backend, "state_dir": state, "admin_token": token},
            env=env,
            deployment=deployment,
        ) as app,
    ):
        yield Target(app.url, token, ingress)


def run_mode(target: Target, args: argparse.Namespace, mode: str, out: Path) -> RunSummary:
    """One Locust run with coalescing `mode`; its summary JSON is written beside its CSVs."""
    set_coalescing(target, mode == "on")
    if "StormAdmin" in SCENARIOS[args.scenario]:
        ensure_registered(target.url, target.admin_token)  # a compile: not in the measured time
    before, replicas = total_stats(target), replica_pids(APP_REPLICAS)
    threads_before = thread_cpu_seconds(replicas)
    prefix = out / f"{args.scenario}-{mode}"
    run_locust(target, args, prefix, args.duration)
    threads = grown_by_name(threads_before, thread_cpu_seconds(replicas))
    after = total_stats(target)
    summary = summarize(args, mode, prefix, before, after, threads)
    prefix.with_suffix(".json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def set_coalescing(target: Target, enabled: bool) -> None:
    put_coalescer(target, {"enabled": enabled})


def coalescer_knobs(target: Target) -> dict[str, object]:
    """The coalescer knobs in force (the first replica's: this runner sets all alike)."""
    response = requests.get(
        f"{target.url}/admin/replicas", headers=admin_headers(target.admin_token), timeout=60
    )
    response.raise_for_status()
    return response.json()["replicas"][0]["coalescer"]


def put_coalescer(target: Target, knobs: dict[str, object]) -> None:
    """Set `knobs` on every replica; RuntimeError if one did not take them."""
    response = requests.put(
        f"{target.url}/admin/coalescer",
        json=knobs,
        headers=admin_headers(target.admin_token),
        timeout=60,
    )
    response.raise_for_status()
    body = response.json()
    if body["unreachable"] or any(
        r["coalescer"][k] != v for r in body["replicas"] for k, v in knobs.items()
    ):
        raise RuntimeError(f"coalescer knobs {knobs} not set on every replica: {body}")


def total_stats(target: Target) -> dict[str, float]:
    response = requests.get(f"{target.url}/v1/stats", timeout=60)
    response.raise_for_status()
    return response.json()["total"]


def run_locust(target: Target, args: argparse.Namespace, prefix: Path, seconds: float) -> None:
    options = [*completion_options(args, prefix), "--encoding", args.encoding]
    if args.load_processes > 1:
        options += ["--processes", str(args.load_processes)]
    locust(target, args.users, seconds, prefix, [*options, *SCENARIOS[args.scenario]])


def locust(
    target: Target, users: int, seconds: float, prefix: Path, options: Sequence[str]
) -> None:
    """Locust headless against `target`: `users` users, all started at once, for `seconds`; its
    CSVs and final JSON at `prefix`. `options` are the locustfile's options and user classes."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{seconds:g}s",
        "--host",
        target.url,
        "--csv",
        str(prefix),
        "--csv-full-history",
        "--json-file",
        str(prefix) + "_locust",
        "--only-summary",
        "--exit-code-on-error",
        "0",
        "--loglevel",
        "WARNING",
        *options,
    ]
    env = {**os.environ, "GPUOS_ADMIN_TOKEN": target.admin_token}
    subprocess.run(command, check=True, env=env, cwd=REPO)


def completion_options(args: argparse.Namespace, prefix: Path) -> list[str]:
    """The locustfile's CompletionUser options, for scenarios that have it."""
    if "CompletionUser" not in SCENARIOS[args.scenario]:
        return []
    return [
        "--max-tokens",
        str(args.max_tokens),
        "--stream-fraction",
        str(args.stream_fraction),
        "--tokens-out",
        str(tokens_file(prefix)),
    ]


def tokens_file(prefix: Path) -> Path:
    """Where CompletionUser's token counts go (named like Locust's JSON, which stays local);
    each Locust worker process adds `.<pid>` to the name."""
    return Path(f"{prefix}_tokens_locust.json")


def read_generated(prefix: Path) -> Generated:
    """The token counts of every Locust process of the run at `prefix`, summed."""
    first = tokens_file(prefix)
    counts = [
        Generated(**json.loads(path.read_text()))
        for path in sorted(first.parent.glob(first.name + "*"))
    ]
    return Generated(
        model=next((c.model for c in counts if c.model), ""),
        completion_tokens=sum(c.completion_tokens for c in counts),
        stream_tokens=sum(c.stream_tokens for c in counts),
    )


def summarize(
    args: argparse.Namespace,
    mode: str,
    prefix: Path,
    before: dict[str, float],
    after: dict[str, float],
    thread_cpu_s: Mapping[str, float],
) -> RunSummary:
    """The run's totals from Locust's final JSON (its stats CSV is written periodically and can
    miss the last second), the coalescer's counters before and after, for completions the
    locustfile's token counts, and the replicas' CPU seconds by thread name during the run."""
    entries, span = locust_entries(prefix)
    total = request_stats([e for e in entries if e["name"] not in MEASURES], span)
    per_request = {
        name: request_stats([e for e in entries if e["name"] == name], span)
        for name in sorted({e["name"] for e in entries})
    }
    generation = (
        generation_summary(args, prefix, per_request.get(TTFT), span, before, after)
        if "CompletionUser" in SCENARIOS[args.scenario]
        else None
    )
    submissions = int(after["batches"] - before["batches"])
    tasks = after["tasks"] - before["tasks"]
    return RunSummary(
        scenario=args.scenario,
        coalescing=mode,
        users=args.users,
        duration_s=args.duration,
        requests=total.requests,
        failures=total.failures,
        rps=total.rps,
        p50_ms=total.p50_ms,
        p95_ms=total.p95_ms,
        p99_ms=total.p99_ms,
        mean_batch_size=tasks / submissions if submissions else 0.0,
        submissions=submissions,
        per_request=per_request,
        generation=generation,
        replica_thread_cpu_ms={
            name: round(1000 * seconds / total.requests, 4)
            for name, seconds in sorted(thread_cpu_s.items(), key=lambda kv: -kv[1])
            if total.requests and seconds > 0
        },
        csv_prefix=str(prefix),
    )


def grown_by_name(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each name's total grew by from `before` to `after`."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def locust_entries(prefix: Path) -> tuple[list[dict], float]:
    """The entries of Locust's final JSON of the run at `prefix`, and the seconds they span."""
    entries = json.loads(Path(f"{prefix}_locust.json").read_text())
    span = (
        (max(e["last_request_timestamp"] for e in entries) - min(e["start_time"] for e in entries))
        if entries
        else 0.0
    )
    return entries, span


def request_stats(entries: Sequence[dict], span: float) -> RequestStats:
    """Counts and percentiles of Locust's final JSON `entries`, merged; RPS over `span` seconds."""
    count = sum(e["num_requests"] for e in entries)
    times = merged_response_times(entries)
    return RequestStats(
        requests=count,
        failures=sum(e["num_failures"] for e in entries),
        rps=count / span if span else 0.0,
        p50_ms=percentile(times, 0.50),
        p95_ms=percentile(times, 0.95),
        p99_ms=percentile(times, 0.99),
    )


def generation_summary(
    args: argparse.Namespace,
    prefix: Path,
    ttft: RequestStats | None,
    span: float,
    before: Mapping[str, float],
    after: Mapping[str, float],
) -> GenerationSummary:
    """Tokens/s over `span` from the locustfile's counts; TTFT percentiles of its entry (zeros
    when no stream passed); the engines' steps and program builds between the /v1/stats totals
    `before` and `after`."""
    grown = grown_by_name(before, after)
    generated = read_generated(prefix)
    return GenerationSummary(
        model=generated.model,
        max_tokens=args.max_tokens,
        stream_fraction=args.stream_fraction,
        tokens=generated.tokens,
        tokens_per_s=generated.tokens / span if span else 0.0,
        ttft_p50_ms=ttft.p50_ms if ttft else 0.0,
        ttft_p99_ms=ttft.p99_ms if ttft else 0.0,
        steps=int(grown.get("llm_steps", 0)),  # an app without the counter: 0
        programs_built=int(grown.get("llm_programs", 0)),
        program_build_s=grown.get("llm_program_build_ms", 0) / 1000,
    )


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
    ratio = {
        "rps_on_over_off": on.rps / off.rps if off.rps else 0.0,
        "p99_on_over_off": on.p99_ms / off.p99_ms if off.p99_ms else 0.0,
    }
    if on.generation and off.generation:
        on_tps, off_tps = on.generation.tokens_per_s, off.generation.tokens_per_s
        ratio["tokens_per_s_on_over_off"] = on_tps / off_tps if off_tps else 0.0
    return ratio


def describe(target: Target) -> dict[str, object]:
    """Where the numbers come from: backend, ingress, host, commit."""
    backend = requests.get(f"{target.url}/healthz", timeout=30).json()["backend"]
    return {"backend": backend, "url": target.url, "ingress": target.ingress, **host_facts()}


def host_facts() -> dict[str, object]:
    """The host, its CPUs, the commit and the time."""
    # $GPUOS_COMMIT first: a copied working tree (the GPU host) may carry a stale .git.
    commit = (
        os.environ.get("GPUOS_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True
        ).stdout.strip()
    )
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "commit": commit,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def plot(runs: Sequence[RunSummary], path: Path) -> None:
    """Latency percentiles of each plotted Locust row (PLOTTED, default Aggregated) and RPS over
    time, one color per mode (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[load]'): no plot", file=sys.stderr)
        return
    rows = PLOTTED.get(runs[0].scenario, ("Aggregated",))
    fig, axes = plt.subplots(len(rows) + 1, 1, figsize=(9, 3.5 * (len(rows) + 1)), sharex=True)
    *latencies, rps = axes
    for run, color in zip(runs, ("tab:blue", "tab:orange")):
        for row, lat in zip(rows, latencies):
            t, series = history(Path(f"{run.csv_prefix}_stats_history.csv"), row)
            for pct, style in (("50%", ":"), ("95%", "--"), ("99%", "-")):
                lat.plot(
                    t,
                    series[pct],
                    style,
                    color=color,
                    label=f"coalescing {run.coalescing} p{pct[:-1]}",
                )
            if row not in MEASURES:  # a TTFT is not a request
                label = f"coalescing {run.coalescing}" + ("" if len(rows) == 1 else f" {row}")
                rps.plot(
                    t,
                    series["Requests/s"],
                    ("-", "--", "-.")[rows.index(row)],
                    color=color,
                    label=label,
                )
    for row, lat in zip(rows, latencies):
        lat.set_ylabel("latency (ms)" if row == "Aggregated" else f"{row} (ms)")
        lat.legend(fontsize="small")
    latencies[0].set_title(f"{runs[0].scenario}: {runs[0].users} users")
    rps.set_ylabel("requests/s")
    rps.set_xlabel("seconds")
    rps.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def history(path: Path, name: str = "Aggregated") -> tuple[list[float], dict[str, list[float]]]:
    """Seconds since the first request and per-second series of Locust's history rows named
    `name`."""
    with path.open() as source:
        rows = [r for r in csv.DictReader(source) if r["50%"] != "N/A"]
    start = float(rows[0]["Timestamp"]) if rows else 0.0
    rows = [r for r in rows if r["Name"] == name]
    keys = ("50%", "95%", "99%", "Requests/s")
    return (
        [float(r["Timestamp"]) - start for r in rows],
        {k: [float(r[k]) for r in rows] for k in keys},
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.exit(main())
