"""Soak: micro-ops and completions mixed, past saturation, on two replicas, one of them killed.

    python -m loadtest.soak                                   # 10 min, 256 users, kill at 5 min
    python -m loadtest.soak --gpus-per-replica 0.5            # both replicas on one GPU
    python -m loadtest.soak --backend cpu --duration 90 --users 32 --settle 20   # a short look

Starts deployments/llm.yaml (--config) with --replicas replicas, puts --users closed-loop users on
it (MicroOpUser and CompletionUser, half each, every answer's content checked), SIGKILLs one
replica's process at --kill-at seconds (Serve starts a replacement) and samples every replica's
resident memory and, where nvidia-smi exists, each one's GPU memory and the GPU's total every
--sample-s seconds. Load shed as the API promises (503 with Retry-After, 504) is counted apart
(locustfile's --shed-ok); anything else that is not a checked 200 is a failure, a stream the kill
cut included (behind HAProxy, the default ingress, requests the killed replica had not answered
are replayed on the other one: loadtest/launch.py; completions, streams begun included, are sent
again by the completions gateway: serving/gateway.py). The default load is twice the saturating
one: one replica's micro-op throughput grows only 12% from 64 to 256 users (1794 to 2016 req/s,
loadtest/results/compare-h200-2dc9c63), so two saturate at about 128.

Writes soak.json into --out (statuses, failures by message, the kill and when the replacement
process appeared, memory samples and each replica's memory after --settle seconds and at the end)
beside Locust's CSVs and the instance's log. Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from loadtest.completions import MEASURES
from loadtest.launch import APP_REPLICAS, ENCODINGS, replica_pids
from loadtest.run import (
    Target,
    app_arguments,
    describe,
    locust,
    locust_entries,
    report_dir,
    request_stats,
    started_app,
)
from loadtest.statuses import SHED

SHED_PREFIX = f"{SHED} "  # the locustfile's entries of shed answers: "shed 503", "shed 504"
USERS = ("MicroOpUser", "CompletionUser")


@dataclass(frozen=True)
class Sample:
    """Memory at one moment: per replica process (by pid), and the GPU's total in use."""

    t_s: float  # seconds since the load started
    rss_mb: dict[int, float]
    gpu_mb: dict[int, float]  # per replica process, where nvidia-smi lists it
    gpu_used_mb: float | None  # the whole GPU (None without nvidia-smi)


@dataclass
class Kill:
    """The replica killed mid-soak."""

    at_s: float
    pid: int
    replaced_after_s: float | None = None  # when a replica process not seen before appeared


@dataclass
class Soak:
    """What the soak saw, as soak.json has it."""

    environment: dict[str, object]
    users: int
    duration_s: float
    replicas: int
    answered_200: int
    shed: dict[str, int]  # "503", "504" → answers
    failures: int
    failures_by_message: dict[str, int]
    rps: float
    p50_ms: float
    p99_ms: float
    kill: Kill | None
    memory: dict[str, object]  # per replica at settle and end; the GPU's total
    samples: list[Sample] = field(repr=False)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--users", type=int, default=256, help="closed-loop users, both kinds")
    parser.add_argument("--kill-at", type=float, default=300.0, help="seconds in; <0: no kill")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        help="GPUs each replica reserves (0.5 packs two on one GPU; default: the app's choice)",
    )
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--settle", type=float, default=60.0, help="memory's start: seconds in")
    app_arguments(parser, ingress="haproxy")
    parser.add_argument("--encoding", choices=ENCODINGS, default="b64")
    parser.add_argument("--max-tokens", type=int, default=16, help="completions' max_tokens")
    parser.add_argument(
        "--stream-fraction", type=float, default=0.5, help="completions that stream"
    )
    parser.add_argument("--out", type=Path, help="report folder (default loadtest/results/...)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = report_dir(args.out, "soak")
    with started_app(args, out, deployment_options(args)) as target:
        wait_for_replicas(args.replicas)
        samples, kill = soak(target, args, out / "soak")
        environment = describe(target)
    report = summarize(args, out / "soak", samples, kill, environment)
    (out / "soak.json").write_text(json.dumps(asdict(report), indent=2))
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "samples"}, indent=2))
    print(f"report: {out / 'soak.json'}")
    return 1 if report.failures else 0


def deployment_options(args: argparse.Namespace) -> dict[str, object]:
    """The deployment's replicas and, when asked, the GPUs each reserves."""
    options: dict[str, object] = {"num_replicas": args.replicas}
    if args.gpus_per_replica is not None:
        options["ray_actor_options"] = {"num_gpus": args.gpus_per_replica, "num_cpus": 1}
    return options


def wait_for_replicas(count: int, timeout_s: float = 300.0) -> None:
    """Until `count` replica processes run (the app answers once the first is up)."""
    deadline = time.monotonic() + timeout_s
    while len(replica_pids(APP_REPLICAS)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} replicas not running after {timeout_s:.0f} s")
        time.sleep(1.0)


def soak(
    target: Target, args: argparse.Namespace, prefix: Path
) -> tuple[list[Sample], Kill | None]:
    """Locust for --duration in a thread; meanwhile memory samples and the kill."""
    options = [
        "--shed-ok",
        *("--encoding", args.encoding),
        *("--max-tokens", str(args.max_tokens)),
        *("--stream-fraction", str(args.stream_fraction)),
    ]
    load = threading.Thread(
        target=locust, args=(target, args.users, args.duration, prefix, [*options, *USERS])
    )
    samples: list[Sample] = []
    kill: Kill | None = None
    seen: set[int] = set()
    start = time.monotonic()
    load.start()
    while load.is_alive():
        now = time.monotonic() - start
        sample = memory_sample(now)
        samples.append(sample)
        if kill is None and 0 <= args.kill_at <= now:
            kill = kill_one(now)
        elif kill is not None and kill.replaced_after_s is None and set(sample.rss_mb) - seen:
            kill.replaced_after_s = now - kill.at_s
        seen |= set(sample.rss_mb)
        load.join(timeout=max(0.0, args.sample_s - (time.monotonic() - start - now)))
    return samples, kill


def kill_one(now: float) -> Kill:
    """SIGKILL the first replica process: a crash, no graceful shutdown."""
    pid = replica_pids(APP_REPLICAS)[0]
    os.kill(pid, signal.SIGKILL)
    return Kill(at_s=now, pid=pid)


def memory_sample(now: float) -> Sample:
    """Every replica's RSS and, with nvidia-smi, its GPU memory and the GPU's total."""
    rss = {}
    for pid in replica_pids(APP_REPLICAS):
        try:
            rss[pid] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:  # killed or replaced between the listing and now
            continue
    per_process, used = gpu_memory()
    return Sample(now, rss, {p: mb for p, mb in per_process.items() if p in rss}, used)


def gpu_memory() -> tuple[dict[int, float], float | None]:
    """(MiB per process, MiB in use on GPU 0) from nvidia-smi; ({}, None) without it."""
    if shutil.which("nvidia-smi") is None:
        return {}, None
    apps = _smi("--query-compute-apps=pid,used_memory")
    total = _smi("--query-gpu=memory.used")
    per_process = {int(row[0]): float(row[1]) for row in apps if len(row) == 2}
    return per_process, float(total[0][0]) if total else None


def _smi(query: str) -> list[list[str]]:
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if line]


def summarize(
    args: argparse.Namespace,
    prefix: Path,
    samples: list[Sample],
    kill: Kill | None,
    environment: dict[str, object],
) -> Soak:
    """Locust's final counts split into checked 200s, shed answers and failures; memory at
    --settle seconds and at the end."""
    entries, span = locust_entries(prefix)
    shed = {
        e["name"].removeprefix(SHED_PREFIX): e["num_requests"]
        for e in entries
        if e["name"].startswith(SHED_PREFIX)
    }
    answered = [
        e for e in entries if e["name"] not in MEASURES and not e["name"].startswith(SHED_PREFIX)
    ]
    stats = request_stats(answered, span)
    return Soak(
        environment=environment,
        users=args.users,
        duration_s=args.duration,
        replicas=args.replicas,
        answered_200=stats.requests - stats.failures,
        shed=shed,
        failures=stats.failures,
        failures_by_message=failure_messages(prefix),
        rps=stats.rps,
        p50_ms=stats.p50_ms,
        p99_ms=stats.p99_ms,
        kill=kill,
        memory=memory_summary(samples, args.settle),
        samples=samples,
    )


def failure_messages(prefix: Path) -> dict[str, int]:
    """Locust's failures by message (its failures CSV)."""
    path = Path(f"{prefix}_failures.csv")
    if not path.exists():
        return {}
    with path.open() as rows:
        return {f"{r['Name']}: {r['Error']}": int(r["Occurrences"]) for r in csv.DictReader(rows)}


def memory_summary(samples: list[Sample], settle_s: float) -> dict[str, object]:
    """Each replica's RSS (and GPU MiB) at its first sample after `settle_s` and at its last; the
    GPU's total in use at those two moments."""
    settled = [s for s in samples if s.t_s >= settle_s] or samples[-1:]
    if not settled:
        return {}
    replicas: dict[str, dict[str, float]] = {}
    for pid in sorted({p for s in settled for p in s.rss_mb}):
        seen = [s for s in settled if pid in s.rss_mb]
        first, last = seen[0], seen[-1]
        replicas[str(pid)] = {
            "from_s": first.t_s,
            "to_s": last.t_s,
            "rss_mb_start": first.rss_mb[pid],
            "rss_mb_end": last.rss_mb[pid],
            "gpu_mb_start": first.gpu_mb.get(pid, 0.0),
            "gpu_mb_end": last.gpu_mb.get(pid, 0.0),
        }
    return {
        "replicas": replicas,
        "gpu_used_mb_start": settled[0].gpu_used_mb,
        "gpu_used_mb_end": settled[-1].gpu_used_mb,
    }


if __name__ == "__main__":
    raise SystemExit(main())
