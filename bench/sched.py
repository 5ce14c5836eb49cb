"""The transparent scheduler on the chain add -> mul -> relu -> sigmoid -> div, written as plain
torch code and run n times over rows of `size` elements: under gpuos_core.scheduler with and
without fusion, traced (one repetition over all rows is the region: recorded once, then replayed
as one device program), against torch eager, torch.compile and one batched chain over all rows
(the floor), in the same run. Writes sched.json to --out and prints the summary (`summary` says
how its ratios read; `intercept_us_per_op` is what queueing one op costs on today's path).

    python3 bench/sched.py --out bench/results [--backend cuda] [--n 1000] [--size 2048]

Each timed repetition ends with the results written (the scheduler's flush waits for its batches,
a replay for its program; torch paths end with a stream synchronize, never a device-wide one).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from micro import describe, med, p99, times_ms  # bench/ is the script's directory

from gpuos_core import Runtime, Scheduler, SchedulerConfig, scheduler

OPS = 5  # aten ops in one chain


def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The benchmarked user code: five elementwise ops."""
    return torch.sigmoid(torch.relu((x + y) * y)) / y


def rows(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: tuple, ys: tuple
) -> list[torch.Tensor]:
    return [fn(x, y) for x, y in zip(xs, ys)]


def repetition(xs: tuple, ys: tuple) -> list[torch.Tensor]:
    """One repetition, the traced region: the chain over every row."""
    return rows(chain, xs, ys)


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


def queue_us_per_op(sched: Scheduler, xs: tuple, ys: tuple, reps: int) -> float:
    """What queueing one op costs (interception alone: the flush after each repetition is not
    timed), median over `reps` repetitions."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = rows(chain, xs, ys)
        times.append(time.perf_counter() - start)
        sched.flush()
        del outs
    return 1e6 * med(times) / (OPS * len(xs))


def scheduled(rt: Runtime, xs: tuple, ys: tuple, want: torch.Tensor, reps: int, fuse: bool) -> dict:
    """Today's path: every op intercepted and queued, one flush a repetition."""
    with scheduler(
        rt,
        size_threshold=xs[0].numel(),
        auto_flush_ms=None,
        fuse=fuse,
        max_pending=OPS * len(xs) + 1,
    ) as sched:  # one flush a repetition
        run = under(sched, xs, ys)
        times = times_ms(run, reps)
        correct = bool(torch.allclose(torch.stack(run()), want, atol=1e-5, rtol=1e-4))
        queue_us = queue_us_per_op(sched, xs, ys, reps)
    stats = sched.stats
    runs = 2 * reps + 3  # times_ms's warm-up and reps, the checked run, the queueing reps
    print(
        f"scheduler {'fused' if fuse else 'unfused'}: {med(times):.3f} ms, queueing "
        f"{queue_us:.2f} us/op, correct {correct}, {stats}",
        flush=True,
    )
    return {
        "ms": med(times),
        "p99_ms": p99(times),
        "correct": correct,
        "intercept_us_per_op": queue_us,
        "tasks_per_rep": stats.tasks / runs,
        "submissions_per_rep": stats.submissions / runs,
        "registered": stats.registered,
    }


def replayed(rt: Runtime, xs: tuple, ys: tuple, want: torch.Tensor, reps: int) -> dict:
    """The repetition traced: its first call records (today's path), every later one replays."""
    sched = Scheduler(rt, SchedulerConfig(size_threshold=xs[0].numel(), auto_flush_ms=None))
    region = sched.trace(repetition)
    times = times_ms(lambda: region(xs, ys), reps)
    correct = bool(torch.allclose(torch.stack(region(xs, ys)), want, atol=1e-5, rtol=1e-4))
    stats = region.stats
    print(f"traced, replayed: {med(times):.3f} ms, correct {correct}, {stats}", flush=True)
    return {
        "ms": med(times),
        "p99_ms": p99(times),
        "correct": correct,
        "replayed": stats.replayed,
        "recorded": stats.recorded,
        "not_replayable": dict(stats.not_replayable),
    }


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
    result["fused"] = scheduled(rt, xs, ys, want, reps, fuse=True)
    result["unfused"] = scheduled(rt, xs, ys, want, reps, fuse=False)
    result["replay"] = replayed(rt, xs, ys, want, reps)
    result["summary"] = summary(result)
    return result


def summary(result: dict) -> dict:
    """The headline figures. `replay_over_X` is X's time over the replay's (above 1: the replay
    is faster); the older keys are the first path's time over the second's (`eager_over_fused`:
    eager ms / fused ms, `fused_over_floor`: fused ms / floor ms)."""
    fused, replay, eager = result["fused"]["ms"], result["replay"]["ms"], result["eager_ms"]
    compiled = result["compile_ms"]
    return {
        "fused_ms": fused,
        "unfused_ms": result["unfused"]["ms"],
        "eager_ms": eager,
        "replay_ms": replay,
        "compile_ms": compiled,
        "replay_over_eager": eager / replay,
        "replay_over_compile": compiled / replay if compiled else None,
        "replay_over_fused": fused / replay,
        "eager_over_fused": eager / fused,
        "unfused_over_fused": result["unfused"]["ms"] / fused,
        "compile_over_fused": compiled / fused if compiled else None,
        "fused_over_floor": fused / result["floor_ms"],
        "intercept_us_per_op": result["fused"]["intercept_us_per_op"],
    }


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
