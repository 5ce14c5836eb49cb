"""Where a device program's time goes, record by record: the worker's own trace
(CudaConfig.trace) of the LLM decode step program and of chains of one operator (and of four
in turn), read as stages (a task's records) along the program's critical path. Needs CUDA.

    python3 bench/step_trace.py --out bench/results [--shape gpt2] [--rows 1 64] [--reps 30]
        [--max-len 128] [--steps N] [--prefill PROMPTS TOKENS] [--raw DIR]

Per program: the median wall time of a run (submit to completion, traced worker), then along the
critical path of its last run (walking back from the last record to finish, each time to the
producer that finished last): per stage, its edge (its first record's waits met, after its latest
producer's last record was done), its span (first record ready to last record done) and its
records' median run time. Sums by operator name say what the step spends its time on; so does
the SM time each operator's records ran, which for a prefill step (many stages side by side)
says more than its path. Writes
step-trace-<device>.json.gz to --out (gzip: a trace is ~250 KB of JSON, ~15 KB packed; read it
with zcat or gzip.open), and with --raw every record's times and marks (.npz, one per program)
for questions the sums do not answer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from llm import make_model  # bench/ is the script's directory

from gpuos_core import OpCall, Runtime, RuntimeConfig
from gpuos_core.config import CudaConfig
from gpuos_core.program import Arena, Program
from serving.llm.device_step import Layout, StepChain, StepProgram, StepWork, fusable
from serving.llm.forward import Span
from serving.llm.model import KVPool, rotary_tables

TICKET = (1 << 48) - 1


@dataclass(frozen=True)
class Records:
    """The traced times (µs from the run's first claim) of one run's records, in program order."""

    sm: np.ndarray
    claimed: np.ndarray
    ready: np.ndarray
    done: np.ndarray
    marks: np.ndarray  # [records, 8]: an operator's GPUOS_MARK points, µs after ready (before
    # it: an early operator's work before its wait); NaN: none

    @classmethod
    def last_run(cls, table: np.ndarray, n: int) -> Records:
        """The `n` highest tickets of the trace table: the latest run of an n-record program."""
        rows = table[table[:, 0] != 0]
        tickets = (rows[:, 0] & np.uint64(TICKET)).astype(np.int64) - 1
        order = np.argsort(tickets)[-n:]
        rows, tickets = rows[order], tickets[order]
        assert len(rows) == n and tickets[-1] - tickets[0] == n - 1, "trace lacks the last run"
        t0 = rows[:, 2].min()  # the first record ready (idle blocks take tickets before they
        # are published, so a claim may precede the run)
        us = [(rows[:, k].astype(np.float64) - float(t0)) / 1e3 for k in (1, 2, 3)]
        marks = (rows[:, 4:].astype(np.float64) - rows[:, 2:3].astype(np.float64)) / 1e3
        # stale: from an earlier record of the slot (an early operator's marks precede ready)
        marks[(rows[:, 4:] < rows[:, 1:2]) | (rows[:, 4:] > rows[:, 3:4])] = np.nan
        return cls((rows[:, 0] >> np.uint64(48)).astype(np.int64), *us, marks)


@dataclass(frozen=True)
class Stage:
    task: int
    op: str
    records: int
    ready: float  # first record's waits met
    done: float  # last record done
    run_med: float  # median record run time (ready to done)
    run_max: float
    marks: list  # median µs after ready at which its records reached each GPUOS_MARK


def stages(program: Program, rec: Records) -> dict[int, Stage]:
    tl = program.tasks
    by_task: dict[int, list[int]] = defaultdict(list)
    for r, task in enumerate(tl.owners.tolist()):
        by_task[task].append(r)
    out = {}
    for task, rs in by_task.items():
        run = rec.done[rs] - rec.ready[rs]
        marks = [
            float(np.median(m[~np.isnan(m)])) if (~np.isnan(m)).any() else None
            for m in rec.marks[rs].T
        ]
        out[task] = Stage(
            task,
            tl.op_names[tl.op_of_task[task]],
            len(rs),
            float(rec.ready[rs].min()),
            float(rec.done[rs].max()),
            float(np.median(run)),
            float(run.max()),
            marks,
        )
    return out


def critical_path(program: Program, found: dict[int, Stage]) -> list[dict]:
    """From the stage that finished last back to the first, each time through the producer that
    finished last; per stage its edge and span in µs."""
    path, at = [], max(found.values(), key=lambda s: s.done)
    while True:
        deps = program.deps[at.task]
        before = max((found[d] for d in deps if d in found), key=lambda s: s.done, default=None)
        edge = at.ready - before.done if before else at.ready
        path.append(
            {
                "task": at.task,
                "op": at.op,
                "records": at.records,
                "edge_us": edge,
                "span_us": at.done - at.ready,
                "run_med_us": at.run_med,
                "run_max_us": at.run_max,
                "marks_us": at.marks,
            }
        )
        if before is None:
            return path[::-1]
        at = before


def by_op(path: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for s in path:
        o = out.setdefault(s["op"], {"stages": 0, "edge_us": 0.0, "span_us": 0.0})
        o["stages"] += 1
        o["edge_us"] += s["edge_us"]
        o["span_us"] += s["span_us"]
    return dict(sorted(out.items(), key=lambda kv: -(kv[1]["edge_us"] + kv[1]["span_us"])))


def record_ops(program: Program) -> np.ndarray:
    """The operator name of each of the program's records, in program order."""
    tl = program.tasks
    return np.array([tl.op_names[tl.op_of_task[t]] for t in tl.owners.tolist()])


def busy(program: Program, rec: Records) -> dict[str, float]:
    """µs of SM time each operator's records ran (ready to done), summed over all records: where
    a step's time goes when many stages run side by side (a prefill step), unlike its path."""
    ops = record_ops(program)
    run = rec.done - rec.ready
    out = {str(op): float(run[ops == op].sum()) for op in np.unique(ops)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def measure(rt: Runtime, name: str, program: Program, reps: int, raw: Path | None) -> dict:
    """Median wall ms of `reps` runs, then the trace of the last (its records into `raw`)."""
    rt.submit(program).wait(60).check()  # first run: warm
    walls = []
    for _ in range(reps):
        started = time.perf_counter()
        rt.submit(program).wait(60).check()
        walls.append(1e3 * (time.perf_counter() - started))
    rec = Records.last_run(rt.backend.trace(), len(program.tasks.records))
    path = critical_path(program, stages(program, rec))
    if raw is not None:
        save_raw(raw / f"{len(list(raw.glob('*.npz'))):02d}.npz", name, program, rec)
    device_ms = rec.done.max() / 1e3  # first record ready to last done
    result = {
        "name": name,
        "records": len(rec.ready),
        "tasks": len(program),
        "wall_ms": statistics.median(walls),
        "device_ms": device_ms,
        "path_stages": len(path),
        "path": path,
        "by_op": by_op(path),
        "busy_us_by_op": busy(program, rec),
        "sms_used": int(len(np.unique(rec.sm))),
        "claim_to_ready_med_us": float(np.median(rec.ready - rec.claimed)),
    }
    show(result)
    return result


def save_raw(path: Path, name: str, program: Program, rec: Records) -> None:
    """The run's records in program order: SM, claimed, ready, done (µs), marks (µs after ready,
    stale ones NaN), and each record's task and operator name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        name=name,
        sm=rec.sm,
        claimed=rec.claimed,
        ready=rec.ready,
        done=rec.done,
        marks=rec.marks,
        task=program.tasks.owners,
        op=record_ops(program),
    )


def show(r: dict) -> None:
    print(
        f"\n== {r['name']}: {r['records']} records, {r['tasks']} tasks; wall {r['wall_ms']:.3f} ms,"
        f" device {r['device_ms']:.3f} ms; critical path {r['path_stages']} stages",
        flush=True,
    )
    print(f"{'op':>16} {'stages':>6} {'edge us':>9} {'span us':>9} {'per stage':>10}")
    for op, o in r["by_op"].items():
        per = (o["edge_us"] + o["span_us"]) / o["stages"]
        print(f"{op:>16} {o['stages']:>6} {o['edge_us']:>9.1f} {o['span_us']:>9.1f} {per:>10.2f}")
    sm_us = r["sms_used"] * r["device_ms"] * 1e3
    busy = ", ".join(f"{op} {us / sm_us:.1%}" for op, us in list(r["busy_us_by_op"].items())[:8])
    print(f"busy SM time (of {r['sms_used']} SMs x device time): {busy}")
    edges = [s["edge_us"] for s in r["path"][1:]]
    if edges:
        print(f"edges: median {statistics.median(edges):.2f} us, total {sum(edges):.1f} us")
    shown = set()
    for s in r["path"]:  # one stage per operator: where its records' time went
        if s["op"] in shown or not any(m is not None for m in s["marks_us"]):
            continue
        shown.add(s["op"])
        marks = " ".join("-" if m is None else f"{m:.2f}" for m in s["marks_us"])
        print(
            f"  {s['op']} ({s['records']} records): marks at {marks}; "
            f"done {s['run_med_us']:.2f} us after ready (medians)"
        )


def chain(rt: Runtime, ops: list[str], n: int, hidden: int, dtype: torch.dtype) -> Program:
    """n dependent calls on one row of `hidden`, call i of ops[i % len(ops)] (attention: 12 heads
    of 64 over 65 of 128 keys, GPT-2's decode of one row at position 64)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, hidden, device="cuda", dtype=dtype, generator=gen)
    weight = torch.randn(hidden, hidden, device="cuda", dtype=dtype, generator=gen) / hidden**0.5
    ones, zeros = torch.ones(hidden, device="cuda", dtype=dtype), torch.zeros_like(x[0])
    keys, values = (
        torch.randn(12, 128, 64, device="cuda", dtype=dtype, generator=gen) for _ in range(2)
    )
    lengths = torch.full((12,), 65, device="cuda", dtype=torch.int32)
    build = rt.program()
    for i in range(n):
        op, x = ops[i % len(ops)], x.view(1, hidden)
        if op == "attention_decode":
            x = build.add(
                OpCall(op, (x.view(12, 64), keys, values, lengths), scalars={"scale": 0.125})
            )
        elif op == "linear":
            x = build.add(OpCall("linear", (x, weight)))
        elif op == "layernorm":
            x = build.add(OpCall("layernorm", (x, ones, zeros), scalars={"eps": 1e-5}))
        else:
            x = build.add(OpCall(op, (x, x)))
    return build.build()


def step(
    rt: Runtime, shape: str, spans: list[Span], max_len: int, steps: int, where: Path
) -> Program:
    """The step program of `spans` (one KV slot each, numbered from 0) in KV slots of `max_len`
    tokens, run `steps` times (decode spans only beyond one), its inputs written once."""
    model = make_model(shape, "cuda", where / shape)
    slots = len(spans)
    pool = KVPool.allocate(model.config, slots, max_len, model.dtype, "cuda")
    pool.keys.normal_()
    pool.values.normal_()
    layout = Layout.of(spans, slots, steps)
    chain = StepChain(layout.picks, layout.steps, rt.device)
    tables = rotary_tables(model, max_len)
    arena = Arena(rt.device)
    sp = StepProgram(rt, model, pool, layout, tables, chain, 0, arena, fusable(rt.table))
    params = np.zeros((len(spans), 3), dtype=np.float32)
    rng = np.zeros((len(spans), 3), dtype=np.int32)
    work = StepWork(spans, [layout.steps] * len(spans), params, rng, keep_logits=False)
    # every run waits for a clock value of 0 (its own ticks only move the clock past it)
    sp.inputs.write(work, sp.layout.place(spans), pool.max_len, expect=0)
    sp.inputs.device.copy_(sp.inputs.host)  # once: the runs below submit the program alone
    return sp.program


def decoding(rows: int) -> list[Span]:
    """`rows` decode rows, every one at position 64."""
    return [Span(slot, 64, (1,)) for slot in range(rows)]


def prefilling(prompts: int, tokens: int) -> list[Span]:
    """`prompts` prompts of `tokens` tokens each, all at once (as bench/llm.py admits them)."""
    return [Span(slot, 0, tuple(range(1, tokens + 1))) for slot in range(prompts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--shape", default="gpt2")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-len", type=int, default=128, help="tokens a KV slot holds")
    ap.add_argument(
        "--steps", type=int, default=1, help="decode steps a decode program runs back to back"
    )
    ap.add_argument(
        "--prefill",
        type=int,
        nargs=2,
        metavar=("PROMPTS", "TOKENS"),
        help="also a step of PROMPTS prompts of TOKENS tokens (a prefill step)",
    )
    ap.add_argument(
        "--raw", type=Path, help="also write each program's records (µs, marks, ops) as .npz here"
    )
    args = ap.parse_args()
    rt = Runtime(config=RuntimeConfig(backend="cuda", cuda=CudaConfig(trace=True)))
    results = []
    with tempfile.TemporaryDirectory() as tmp, rt:
        ops = ["add", "layernorm", "linear", "attention_decode"]
        # each alone, then in turn: what a record pays for following another operator
        for name, cycle in [(op, [op]) for op in ops] + [(" / ".join(ops), ops)]:
            results.append(
                measure(
                    rt,
                    f"chain of 48 {name} (1 x 768)",
                    chain(rt, cycle, 48, 768, torch.float16),
                    args.reps,
                    args.raw,
                )
            )
        times = f" x {args.steps} steps" if args.steps > 1 else ""
        steps = [(f"{rows} decode rows{times}", decoding(rows), args.steps) for rows in args.rows]
        if args.prefill:
            prompts, tokens = args.prefill
            steps.append((f"{prompts} prompts of {tokens}", prefilling(prompts, tokens), 1))
        for what, spans, runs in steps:
            results.append(
                measure(
                    rt,
                    f"{args.shape} step, {what}, slots of {args.max_len}",
                    step(rt, args.shape, spans, args.max_len, runs, Path(tmp)),
                    args.reps,
                    args.raw,
                )
            )
    device = torch.cuda.get_device_name().split()[-1].lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step-trace-{device}.json.gz"
    with gzip.open(path, "wt") as out:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, out, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
