"""Where the LLM engine's host time goes, a decode step at a time: the wall time of each phase of
the step loop (and of the runtime calls under it), timed in the threads that run them, and each
thread's CPU time. Needs CUDA for the figures that matter; --backend cpu runs it as a check.

    python3 bench/host_phases.py --out bench/results [--shape gpt2] [--rows 1 8 32 64]
        [--new 48] [--reps 3]

Per row count: the engine's decode step (bench/llm.py's protocol: every prompt submitted at
once, each stream's mean gap between tokens) and its host and wait time a step, then per phase
its calls a step, its median µs a call and its µs a step (phases nest: StepProgram.start holds
the write and the submit, result() the wait and the readback). Phases run by the runtime's
poller thread are counted apart (name@poller). Thread CPU from /proc's schedstat: run and
run-queue ms a step and context switches a step, per thread. The step and its phases move
with the host's speed (the H200's hosts have differed 2x between calls, bench/NOTES.md):
compare row counts and trees within one run only. Writes host-phases-<device>-<commit>.json
to --out (bench/llm.py's run info and naming).
The timers wrap the methods by name, which adds ~1 µs a call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from kernels import slug  # bench/ is the script's directory
from llm import OURS, engine_run, make_model, new_engine, prompts, reference_tokens, run_info

from gpuos_core import Runtime, RuntimeConfig
from gpuos_core.backends.cuda import POLLER_THREAD, CudaBackend
from gpuos_core.batch import Batch
from serving.llm.device_step import Launched, Layout, StepInputs, StepProgram
from serving.llm.engine import STEP_THREAD, Engine, EngineConfig

# (class, method): the phases timed, outermost first
PHASES: list[tuple[type, str]] = [
    (Engine, "step"),
    (Engine, "_schedule"),
    (Engine, "_launch"),
    (StepProgram, "start"),
    (Layout, "place"),
    (StepInputs, "write"),
    (Runtime, "submit"),
    (CudaBackend, "launch"),
    (CudaBackend, "_publish"),
    (Batch, "wait"),
    (Batch, "check"),
    (CudaBackend, "read"),
    (Engine, "_collect"),
    (CudaBackend, "poll"),
    (Batch, "complete"),
    (CudaBackend, "_watchdog"),
]
# How phases are listed: PHASES' order, the poller's calls after the engine thread's
ORDER = [f"{o.__name__}.{n}{at}" for o, n in PHASES for at in ("", "@poller")] + ["result()"]
# The threads by the names their owners give them (Engine, CudaBackend; the poller's phases
# are counted apart)
THREADS = {"engine": STEP_THREAD, "poller": POLLER_THREAD, "main": "MainThread"}


class Timers:
    """Wall ns of every call of the PHASES, by phase (and apart where the poller made it)."""

    def __init__(self) -> None:
        self.calls: defaultdict[str, list[int]] = defaultdict(list)

    def wrap(self, owner: type, name: str) -> None:
        original = getattr(owner, name)
        label = f"{owner.__name__}.{name}"
        calls = self.calls

        def timed(*args: object, **kwargs: object) -> object:
            began = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                poller = threading.current_thread().name == THREADS["poller"]
                calls[label + ("@poller" if poller else "")].append(time.perf_counter_ns() - began)

        setattr(owner, name, timed)

    def wrap_result(self) -> None:
        """Time the call a launched step hands back (a closure of StepProgram.start) too."""
        start = StepProgram.start
        calls = self.calls

        def timed_start(program: StepProgram, *args: object, **kwargs: object) -> Launched:
            launched = start(program, *args, **kwargs)
            result = launched.result

            def timed_result() -> object:
                began = time.perf_counter_ns()
                try:
                    return result()
                finally:
                    calls["result()"].append(time.perf_counter_ns() - began)

            return Launched(launched.picks, timed_result)

        StepProgram.start = timed_start


def schedstat(tid: int) -> np.ndarray:
    """ns run, ns waiting to run, and voluntary + involuntary context switches of a thread
    (Linux's /proc)."""
    run, wait, _ = map(int, Path(f"/proc/self/task/{tid}/schedstat").read_text().split())
    status = Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
    switches = sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
    return np.array([run, wait, switches], dtype=np.int64)


def threads() -> dict[str, int]:
    """The native ids of THREADS that run (the poller only on CUDA)."""
    ids = {t.name: t.native_id for t in threading.enumerate()}
    return {k: ids[name] for k, name in THREADS.items() if ids.get(name) is not None}


def measure(engine: Engine, timers: Timers, rows: int, new: int, reps: int, ref: list[int]) -> dict:
    batch = prompts(rows, 32)
    for _ in range(2):  # each layout of this row count built, for both parities
        engine_run(engine, OURS, batch, 3, ref)
    ids = threads()
    timers.calls.clear()
    before = {k: schedstat(t) for k, t in ids.items()}
    steps = engine.steps
    runs = [engine_run(engine, OURS, batch, new, ref) for _ in range(reps)]
    steps = max(1, engine.steps - steps)
    cpu = {}
    for k, t in ids.items():
        run, queued, switches = (schedstat(t) - before[k]) / steps
        cpu[k] = {"run_ms": run / 1e6, "queued_ms": queued / 1e6, "switches": switches}
    return {
        "rows": rows,
        "steps": steps,
        "step_ms": sorted(r["step_ms"] for r in runs),
        "host_ms": sorted(r["host_ms_per_step"] for r in runs),
        "wait_ms": sorted(r["wait_ms_per_step"] for r in runs),
        "agree": [r["agree"] for r in runs],
        "phases": {
            name: {
                "calls_per_step": len(ns) / steps,
                "median_us": statistics.median(ns) / 1e3,
                "us_per_step": sum(ns) / 1e3 / steps,
            }
            for name, ns in sorted(timers.calls.items(), key=lambda kv: ORDER.index(kv[0]))
        },
        "thread_cpu_per_step": cpu,
    }


def show(r: dict) -> None:
    med = statistics.median
    print(
        f"\n== {r['rows']} rows: step {med(r['step_ms']):.3f} ms, host {med(r['host_ms']):.3f}"
        f", wait {med(r['wait_ms']):.3f} ms a step ({r['steps']} steps)"
    )
    print(f"{'phase':>28} {'calls/step':>10} {'median us':>10} {'us/step':>9}")
    for name, p in r["phases"].items():
        print(
            f"{name:>28} {p['calls_per_step']:>10.2f} {p['median_us']:>10.1f}"
            f" {p['us_per_step']:>9.1f}"
        )
    for name, c in r["thread_cpu_per_step"].items():
        print(
            f"{'thread ' + name:>28} run {c['run_ms']:.3f} ms, queued {c['queued_ms']:.3f} ms,"
            f" {c['switches']:.2f} switches a step"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="gpt2")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--new", type=int, default=48, help="generated tokens a stream")
    ap.add_argument("--reps", type=int, default=3, help="timed runs a row count")
    args = ap.parse_args()
    timers = Timers()
    for owner, name in PHASES:
        timers.wrap(owner, name)
    timers.wrap_result()
    device = "cuda" if args.backend == "cuda" else "cpu"
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = make_model(args.shape, device, Path(tmp) / args.shape)
        ref = reference_tokens(model, prompts(1, 32)[0], args.new)
        with Runtime(config=RuntimeConfig(backend=args.backend)) as rt:
            engine = new_engine(model, rt, args.rows, 32, args.new, EngineConfig.max_step_tokens, 1)
            try:
                for rows in args.rows:
                    results.append(measure(engine, timers, rows, args.new, args.reps, ref))
                    show(results[-1])
            finally:
                engine.close()
    info = run_info(args.backend)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-phases-{slug(info['device'])}-{info['commit']}.json"
    path.write_text(json.dumps({**info, "shape": args.shape, "results": results}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
