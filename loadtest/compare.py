"""gpuos-serve against plain Ray Serve baselines, on one ingress, with the project's MicroOpUser.

    python -m loadtest.compare --users 64 256 --duration 20 --out loadtest/results/compare-h200
    python -m loadtest.compare --backend cpu --users 64 --duration 10 --ingress proxy

Each configuration runs on a fresh Serve instance (`serve run` of its own local Ray cluster) on
the same ingress (--ingress; haproxy falls back to Ray Serve's proxy, saying so, where there is no
haproxy program): `ours` (deployments/llm.yaml, coalescer on, the LLM off) and the baselines of
loadtest/baselines.py (`torch` per request, `serve-batch`, `echo`), each with --replicas replicas
and the same replica limits. For each user count: --warmup seconds of unrecorded load, then
--duration seconds of Locust (headless, MicroOpUser, tensors as --encoding; the echo's answers are
checked for their shape only). Writes compare.json (environment, one row per configuration and
user count: RPS, p50/p99, failures, mean batch size from /v1/stats, `ratio_vs_serve_batch`, the
CPU cores Locust and the replicas kept busy (is the load generator the bound?), and a
`summary` of ours at 64 users) and compare.md (the table) into --out, with Locust's CSVs and each
instance's log beside them. Needs no network. Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import resource
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest.baselines import DEPLOYMENT, KINDS
from loadtest.launch import (
    ENCODINGS,
    INGRESSES,
    REPO,
    cpu_seconds,
    ingress_env,
    replica_pids,
    served,
)
from loadtest.run import (
    Target,
    describe,
    host_facts,
    locust,
    locust_entries,
    report_dir,
    request_stats,
    total_stats,
)

CONFIGS = ("ours", *KINDS)
BASE = REPO / "deployments" / "llm.yaml"
SUMMARY_USERS = 64
SHARED = ("max_ongoing_requests", "max_queued_requests")  # replica limits every config gets


@dataclass(frozen=True)
class Row:
    """One configuration under one user count."""

    config: str
    users: int
    requests: int
    failures: int
    rps: float
    p50_ms: float
    p99_ms: float
    mean_batch_size: float  # requests per torch call or runtime submission (0: the echo's none)
    # CPU cores busy over the run (CPU seconds / seconds): Locust (all its processes) and the
    # replicas; Locust near its process count means the load, not the app, set the pace
    locust_cores: float
    replica_cores: float
    ratio_vs_serve_batch: float | None  # rps / serve-batch's rps at the same users


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=3.0, help="unrecorded seconds before each")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--ingress", choices=INGRESSES, default="haproxy")
    parser.add_argument("--encoding", choices=ENCODINGS, default="b64")
    parser.add_argument(
        "--backend",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="ours' runtime backend and the baselines' torch device (auto: cuda "
        "where a GPU is visible; a replica then reserves one GPU)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="replicas of each configuration")
    parser.add_argument(
        "--locust-processes",
        type=int,
        default=1,
        help="Locust processes (one core each): more where one cannot keep up",
    )
    parser.add_argument("--out", type=Path, help="report folder (default loadtest/results/...)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = report_dir(args.out, "compare")
    ingress, env = ingress_env(args.ingress)
    rows, backends = [], {}
    for config in args.configs:
        with tempfile.TemporaryDirectory(prefix="gpuos-compare-") as state:
            token = secrets.token_urlsafe(16)
            (out / config).mkdir(exist_ok=True)
            base = write_base(config, args, Path(state), token)
            with served(base, out / config, {}, env=env) as app:
                target = Target(app.url, token, ingress)
                backends[config] = describe(target)["backend"]
                rows += [measure(target, config, users, args, out) for users in args.users]
    report = with_ratios(rows)
    document = {
        "environment": environment(args, ingress, backends),
        "runs": report,
        "summary": summary(report, args.users),
    }
    (out / "compare.json").write_text(json.dumps(document, indent=2))
    (out / "compare.md").write_text(table(report, document["environment"]))
    print((out / "compare.md").read_text())
    print(f"report: {out / 'compare.json'} and {out / 'compare.md'}")
    return 1 if any(r["failures"] for r in report) else 0


def write_base(config: str, args: argparse.Namespace, state: Path, token: str) -> Path:
    """The Serve config of `config` (`served` sets its port), written into `state`, the
    instance's own temporary folder (ours keeps its operator registry there)."""
    base = yaml.safe_load(BASE.read_text())
    ours = base["applications"][0]
    limits = {key: ours["deployments"][0][key] for key in SHARED}
    if config == "ours":
        ours["args"].update(
            {
                "backend": args.backend,
                "state_dir": str(state),
                "admin_token": token,
                "llm": {"enabled": False},
            }
        )
        ours["deployments"][0]["num_replicas"] = args.replicas
        base["applications"] = [ours]  # without the completions gateways: no model here
    else:
        base["applications"] = [
            {
                "name": "baseline",
                "route_prefix": "/",
                "import_path": "loadtest.baselines:build_app",
                "args": {"kind": config, "backend": args.backend},
                "deployments": [{"name": DEPLOYMENT, "num_replicas": args.replicas, **limits}],
            }
        ]
    path = state / f"{config}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def measure(
    target: Target, config: str, users: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """Locust's MicroOpUser against `target` with `users` users: the row's measured fields."""
    check = "shape" if config == "echo" else "values"  # an echo answers its input
    options = ["--encoding", args.encoding, "--check", check, "MicroOpUser"]
    if args.locust_processes > 1:
        options = ["--processes", str(args.locust_processes), *options]
    if args.warmup > 0:  # a fresh instance's first seconds (imports, connections) are slower
        locust(target, users, args.warmup, out / config / "warmup" / f"{users}u", options)
    before = total_stats(target)
    prefix = out / config / f"{users}u"
    replicas = replica_pids()
    locust_cpu, replica_cpu = children_cpu_seconds(), cpu_seconds(replicas)
    started = time.perf_counter()
    locust(target, users, args.duration, prefix, options)
    wall = time.perf_counter() - started
    locust_cores = (children_cpu_seconds() - locust_cpu) / wall
    replica_cores = (cpu_seconds(replicas) - replica_cpu) / wall
    after = total_stats(target)
    total = request_stats(*locust_entries(prefix))
    batches, tasks = after["batches"] - before["batches"], after["tasks"] - before["tasks"]
    return {
        "config": config,
        "users": users,
        "requests": total.requests,
        "failures": total.failures,
        "rps": total.rps,
        "p50_ms": total.p50_ms,
        "p99_ms": total.p99_ms,
        "mean_batch_size": tasks / batches if batches else 0.0,
        "locust_cores": locust_cores,
        "replica_cores": replica_cores,
    }


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (Locust, and the workers it waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def with_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` as `Row`s: each with its RPS over serve-batch's at the same user count."""
    batch_rps = {r["users"]: r["rps"] for r in rows if r["config"] == "serve-batch"}
    return [
        asdict(
            Row(
                **r,
                ratio_vs_serve_batch=(
                    r["rps"] / batch_rps[r["users"]] if batch_rps.get(r["users"]) else None
                ),
            )
        )
        for r in rows
    ]


def summary(rows: Sequence[dict[str, Any]], users: Sequence[int]) -> dict[str, Any]:
    """Ours at 64 users (else at the first user count): what the issue's targets read."""
    at = SUMMARY_USERS if SUMMARY_USERS in users else users[0]
    ours = next((r for r in rows if r["config"] == "ours" and r["users"] == at), None)
    return {
        "users": at,
        **(
            {
                key: ours[key]
                for key in (
                    "rps",
                    "ratio_vs_serve_batch",
                    "p50_ms",
                    "p99_ms",
                    "failures",
                    "mean_batch_size",
                )
            }
            if ours
            else {"rps": None, "ratio_vs_serve_batch": None}
        ),
    }


def environment(args: argparse.Namespace, ingress: str, backends: dict[str, str]) -> dict[str, Any]:
    """Where the numbers come from: the host, the commit, the software, the options."""
    return {
        **host_facts(),
        "ingress": ingress,
        "encoding": args.encoding,
        "replicas": args.replicas,
        "backends": backends,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "locust_processes": args.locust_processes,
        "ray": importlib.metadata.version("ray"),
        "orjson": importlib.util.find_spec("orjson") is not None,
        "gpu": gpu_name(),
    }


def gpu_name() -> str | None:
    """The first GPU's name, None without one."""
    import torch  # here: seconds to import, and only the report needs it

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def table(rows: Sequence[dict[str, Any]], env: dict[str, Any]) -> str:
    """The report as a markdown table, with where it was measured."""
    lines = [
        f"# ours vs Ray Serve baselines ({env['ingress']} ingress, {env['encoding']} "
        f"tensors, {env['replicas']} replica(s), {env['gpu'] or 'CPU'}, commit "
        f"{env['commit']})",
        "",
        "| config | users | req/s | p50 ms | p99 ms | failures | mean batch | vs @serve.batch "
        "| Locust cores | replica cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = "" if r["ratio_vs_serve_batch"] is None else f"{r['ratio_vs_serve_batch']:.2f}x"
        lines.append(
            f"| {r['config']} | {r['users']} | {r['rps']:.0f} | {r['p50_ms']:.0f} | "
            f"{r['p99_ms']:.0f} | {r['failures']} | {r['mean_batch_size']:.1f} | "
            f"{ratio} | {r['locust_cores']:.2f} | {r['replica_cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.exit(main())
