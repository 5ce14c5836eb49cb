"""The transparent scheduler on the chain add -> mul -> relu -> sigmoid -> div, written as plain
torch code and run n times over rows of `size` elements: under gpuos_core.scheduler with and
without fusion, against torch eager, torch.compile and one batched chain over all rows (the floor),
in the same run. Writes sched.json to --out and prints the ratios.

    python3 bench/sched.py --out bench/results [--backend cuda] [--n 1000] [--size 2048]

Each timed repetition ends with the results written (the scheduler's flush waits for its batches;
torch paths end with a stream synchronize, never a device-wide one).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from gpuos_core import Runtime
from gpuos_core import Scheduler, scheduler
from micro import describe, med, p99, times_ms  # bench/ is the script's directory


def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The benchmarked user code: five elementwise ops."""
    return torch.sigmoid(torch.relu((x + y) * y)) / y


def rows(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: tuple, ys: tuple
         ) -> list[torch.Tensor]:
    return [fn(x, y) for x, y in zip(xs, ys)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def under(sched: Scheduler, xs: tuple, ys: tuple) -> Callable[[], list[torch.Tensor]]:
    """One repetition in an entered scheduler: queue every chain, flush (results written)."""
    def run() -> list[torch.Tensor]:
        outs = rows(chain, xs, ys)
        sched.flush()
        return outs
    return run


def measure(rt: Runtime, n: int, size: int, reps: int, compile: bool) -> dict:
    dev = rt.device
    x, y = torch.randn(n, size, device=dev), torch.rand(n, size, device=dev) + 0.5
    xs, ys = x.unbind(0), y.unbind(0)
    want = chain(x, y)
    result: dict = {"n": n, "size": size, "backend": rt.backend_name}

    def torch_path(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            rows(fn, xs, ys)
            sync(dev)
        return run

    result["eager_ms"] = med(times_ms(torch_path(chain), reps))
    result["floor_ms"] = med(times_ms(lambda: (chain(x, y), sync(dev)), reps))
    compiled = torch_path(torch.compile(chain)) if compile else None
    result["compile_ms"] = med(times_ms(compiled, reps)) if compiled else None
    for fuse in (True, False):
        key = "fused" if fuse else "unfused"
        with scheduler(rt, size_threshold=size, auto_flush_ms=None, fuse=fuse,
                       max_pending=5 * n + 1) as sched:  # one flush a repetition
            run = under(sched, xs, ys)
            times = times_ms(run, reps)
            correct = bool(torch.allclose(torch.stack(run()), want, atol=1e-5, rtol=1e-4))
        stats = sched.stats
        result[key] = {"ms": med(times), "p99_ms": p99(times), "correct": correct,
                       "tasks_per_rep": stats.tasks / (reps + 3),
                       "submissions_per_rep": stats.submissions / (reps + 3),
                       "registered": stats.registered}
        print(f"scheduler {key}: {med(times):.3f} ms, correct {correct}, {stats}", flush=True)
    fused = result["fused"]["ms"]
    result["summary"] = {
        "fused_ms": fused, "unfused_ms": result["unfused"]["ms"], "eager_ms": result["eager_ms"],
        "eager_over_fused": result["eager_ms"] / fused,
        "unfused_over_fused": result["unfused"]["ms"] / fused,
        "compile_over_fused": result["compile_ms"] / fused if compile else None,
        "fused_over_floor": fused / result["floor_ms"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--n", type=int, default=1000, help="chains per repetition")
    parser.add_argument("--size", type=int, default=2048, help="elements per chain")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    with Runtime(args.backend) as rt:
        result = describe() if args.backend == "cuda" else {"device": "cpu"}
        result["chain"] = measure(rt, args.n, args.size, args.reps, not args.no_compile)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sched.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["chain"]["summary"], indent=1))


if __name__ == "__main__":
    main()
