"""Micro-benchmarks of the GPUOS runtime on a CUDA device (elementwise batches, a fused chain,
attention decode, round trips, device programs, hot swap), each figure beside its baselines measured
in the same run (docs/DESIGN.md "Baselines"). Writes micro.json (device, driver, commit, date, a
flat summary and every table) to --out and prints a short table last.

    python3 bench/micro.py --out bench/results [--quick]

Host timing (perf_counter) around work that ends in a stream-level synchronize: never a device-wide
one, which would also wait for the runtime's worker to finish its lease.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpuos_core import CudaConfig, OpCall, Runtime, RuntimeConfig
from gpuos_core.calls import Prepared
from gpuos_core.program import Program

faulthandler.dump_traceback_later(400, exit=True)
DEV = torch.device("cuda")


def sync() -> None:
    torch.cuda.current_stream().synchronize()


def times_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> list[float]:
    """Wall times of `fn()` in ms (fn must end with its work finished)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - start))
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def graph_of(fn: Callable[[], object]) -> Callable[[], None]:
    """A replay of `fn`'s launches captured in a CUDA graph, synchronised."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (allocations, lazy module loads)
    torch.cuda.current_stream().wait_stream(stream)
    return captured(fn)


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """A replay of `fn`'s launches captured in a CUDA graph, synchronised; `fn` must have run
    once before (its warm-up). Capture runs nothing: the state `fn` works on is unchanged."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        graph.replay()
        sync()

    return replay


def elementwise(
    rt: Runtime, sizes: list[int], n: int, reps: int, compile: bool = True
) -> list[dict]:
    """(a) n × mul(size fp32): runtime vs eager vs graph replay vs one batched kernel vs compile."""
    rows = []
    for size in sizes:
        a, b = torch.randn(n, size, device=DEV), torch.randn(n, size, device=DEV)
        out = torch.empty_like(a)
        ra, rb, ro = a.unbind(0), b.unbind(0), out.unbind(0)

        def launches() -> None:
            for i in range(n):
                torch.mul(ra[i], rb[i], out=ro[i])

        def eager() -> None:
            launches()
            sync()

        def floor() -> None:
            torch.mul(a, b, out=out)
            sync()

        started = time.perf_counter()
        tasks = [rt.prepare(OpCall("mul", (ra[i], rb[i]), out=ro[i])) for i in range(n)]
        prepare_ms = 1e3 * (time.perf_counter() - started)
        work = rt.encode(tasks)  # what a coalescer holds when it flushes
        out.fill_(float("nan"))
        runtime = times_ms(lambda: rt.submit(work).wait(60), reps)
        correct = bool(torch.equal(out, a * b))
        row = {
            "size": size,
            "n": n,
            "runtime_ms": med(runtime),
            "runtime_p99_ms": p99(runtime),
            "runtime_from_prepared_ms": med(times_ms(lambda: rt.submit(tasks).wait(60), reps)),
            "prepare_ms": prepare_ms,
            "correct": correct,
            "eager_ms": med(times_ms(eager, reps)),
            "graph_ms": med(times_ms(graph_of(launches), reps)),
            "floor_ms": med(times_ms(floor, reps)),
        }
        row["compile_ms"] = compiled_per_op(ra, rb, n, reps) if size == 1024 and compile else None
        rows.append(row)
        print(
            f"(a) {n} x mul({size}): runtime {row['runtime_ms']:.3f} ms, eager "
            f"{row['eager_ms']:.2f}, graph {row['graph_ms']:.2f}, floor {row['floor_ms']:.3f}, "
            f"compile {row['compile_ms']}, correct {correct}",
            flush=True,
        )
    return rows


def compiled_per_op(ra: tuple, rb: tuple, n: int, reps: int) -> float:
    """torch.compile of the op, called once per op as a user would (one compile, n calls)."""
    fn = torch.compile(lambda x, y: x * y)

    def run() -> None:
        for i in range(n):
            fn(ra[i], rb[i])
        sync()

    return med(times_ms(run, max(2, reps // 2)))


CHAIN = "sigmoid(relu((A + B) * B)) / B"  # add -> mul -> relu -> sigmoid -> div


def chain_eager(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(torch.relu((x + y) * y)) / y


def chain(rt: Runtime, n: int, size: int, reps: int) -> dict:
    """(b) n × the 5-op chain: runtime one stage per submission vs fused expression vs torch."""
    x, y = torch.randn(n, size, device=DEV), torch.rand(n, size, device=DEV) + 0.5
    rx, ry = x.unbind(0), y.unbind(0)
    want = chain_eager(x, y)
    stages = [torch.empty_like(x) for _ in range(5)]
    steps = [
        ("add", lambda i: (rx[i], ry[i])),
        ("mul", lambda i: (stages[0][i], ry[i])),
        ("relu", lambda i: (stages[1][i],)),
        ("sigmoid", lambda i: (stages[2][i],)),
        ("div", lambda i: (stages[3][i], ry[i])),
    ]
    batches = [
        rt.encode([rt.prepare(OpCall(op, args(i), out=stages[k][i])) for i in range(n)])
        for k, (op, args) in enumerate(steps)
    ]
    if "chain5" not in rt.table.names():
        rt.register("chain5", CHAIN)
    fused_out = torch.empty_like(x)
    fused = rt.encode(
        [rt.prepare(OpCall("chain5", (rx[i], ry[i]), out=fused_out[i])) for i in range(n)]
    )

    def unfused() -> None:
        for batch in batches:  # each stage reads the previous one's outputs
            rt.submit(batch).wait(60)

    compiled = torch.compile(chain_eager)

    def eager() -> None:
        for i in range(n):
            chain_eager(rx[i], ry[i])
        sync()

    def compiled_calls() -> None:
        for i in range(n):
            compiled(rx[i], ry[i])
        sync()

    result = {
        "n": n,
        "size": size,
        "runtime_unfused_ms": med(times_ms(unfused, reps)),
        "runtime_fused_ms": med(times_ms(lambda: rt.submit(fused).wait(60), reps)),
        "eager_ms": med(times_ms(eager, reps)),
        "compile_ms": med(times_ms(compiled_calls, reps)),
        "floor_eager_stacked_ms": med(times_ms(lambda: (chain_eager(x, y), sync()), reps)),
        "correct_unfused": bool(torch.allclose(stages[4], want, atol=1e-5, rtol=1e-5)),
        "correct_fused": bool(torch.allclose(fused_out, want, atol=1e-5, rtol=1e-5)),
    }
    print(f"(b) chain: {result}", flush=True)
    return result


def attention(rt: Runtime, requests: list[int], heads: int, dim: int, reps: int) -> list[dict]:
    """(c) fused attention decode for R requests × H heads over ragged KV lengths."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for r in requests:
        lengths = torch.randint(64, 2049, (r,), generator=gen).tolist()
        qs = [torch.randn(heads, dim, device=DEV, dtype=torch.float16) for _ in lengths]
        ks = [torch.randn(heads, n, dim, device=DEV, dtype=torch.float16) for n in lengths]
        vs = [torch.randn(heads, n, dim, device=DEV, dtype=torch.float16) for n in lengths]
        scale = dim**-0.5
        tasks = [rt.prepare(OpCall("attention_decode", (q, k, v))) for q, k, v in zip(qs, ks, vs)]

        def naive() -> None:
            for q, k, v in zip(qs, ks, vs):
                p = torch.softmax((k @ q.unsqueeze(-1)).squeeze(-1).float() * scale, -1)
                (p.unsqueeze(1).to(v.dtype) @ v).squeeze(1)
            sync()

        def sdpa() -> None:
            for q, k, v in zip(qs, ks, vs):
                F.scaled_dot_product_attention(q.unsqueeze(1), k, v)
            sync()

        batch = rt.submit(tasks).wait(60)
        err = max(
            (
                batch.result(i).float()
                - F.scaled_dot_product_attention(q.unsqueeze(1), k, v).squeeze(1).float()
            )
            .abs()
            .max()
            .item()
            for i, (q, k, v) in enumerate(zip(qs, ks, vs))
        )
        row = {
            "requests": r,
            "heads": heads,
            "dim": dim,
            "kv_tokens": sum(lengths),
            "runtime_ms": med(times_ms(lambda: rt.submit(tasks).wait(60), reps)),
            "naive_ms": med(times_ms(naive, reps)),
            "sdpa_ms": med(times_ms(sdpa, reps)),
            "max_abs_err_vs_sdpa": err,
        }
        kv_bytes = 2 * sum(lengths) * heads * dim * 2
        row["runtime_gbps"] = kv_bytes / row["runtime_ms"] / 1e6
        rows.append(row)
        print(f"(c) attention R={r}: {row}", flush=True)
    return rows


def roundtrip(rt: Runtime, counts: list[int], reps: int) -> list[dict]:
    """(d) submit → complete for n tasks, against torch's own op + stream sync; for one task also
    the host's share: submit alone (the wait not timed)."""
    rows = []
    x = torch.randn(1024, device=DEV)
    for n in counts:
        tasks = [rt.prepare(OpCall("mul", (x, x))) for _ in range(n)]
        samples = [v * 1e3 for v in times_ms(lambda: rt.submit(tasks).wait(10), reps, warmup=20)]
        rows.append({"tasks": n, "p50_us": med(samples), "p99_us": p99(samples)})
    rows[0]["submit_only_p50_us"] = med(submit_only_us(rt, rt.prepare(OpCall("mul", (x, x))), reps))
    torch_us = [v * 1e3 for v in times_ms(lambda: (torch.mul(x, x), sync()), reps, warmup=20)]
    rows.append(
        {
            "tasks": 1,
            "baseline": "torch op + stream sync",
            "p50_us": med(torch_us),
            "p99_us": p99(torch_us),
        }
    )
    print(f"(d) roundtrip: {rows}", flush=True)
    return rows


def submit_only_us(rt: Runtime, task: Prepared, reps: int) -> list[float]:
    """Time of rt.submit([task]) alone, each batch waited for outside the timing."""
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        batch = rt.submit([task])
        out.append(1e6 * (time.perf_counter() - start))
        batch.wait(10)
    return out


def driver_call_us(reps: int = 2000) -> dict[str, float]:
    """Host cost of each driver call a one-task submit makes (cuda.bindings), per call."""
    from cuda.bindings import driver as cu

    stream = cu.cuStreamCreate(1)[1]
    dev = int(cu.cuMemAlloc(4096)[1])
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    raw = torch._C._cuda_getCurrentRawStream
    calls = {
        "cuStreamQuery": lambda: cu.cuStreamQuery(stream),
        "cuMemcpyHtoDAsync_528B": lambda: cu.cuMemcpyHtoDAsync(dev, host.data_ptr(), 528, stream),
        "cuStreamWriteValue64": lambda: cu.cuStreamWriteValue64(stream, dev, 1, 0),
        "torch_current_raw_stream": lambda: raw(0),
        "cuCtxGetCurrent": cu.cuCtxGetCurrent,
    }
    costs = {}
    for name, call in calls.items():
        costs[name] = 1e3 * med(times_ms(lambda: [call() for _ in range(100)], 20)) / 100
    cu.cuStreamSynchronize(stream)
    cu.cuMemFree(dev)
    print(f"driver calls (us): {costs}", flush=True)
    return costs


def swap(rt: Runtime, rounds: int) -> dict:
    """(e) swap breakdown and rollback time, under load from another thread (every answer checked
    against the version it reports)."""
    base = f"swapme{os.getpid()}"
    rt.register(base, "A * 2")
    factors = {1: 2.0}
    wrong, done, stop = [], [0], threading.Event()
    x = torch.randn(4096, device=DEV)

    def load() -> None:
        while not stop.is_set():
            batch = rt.submit([rt.prepare(OpCall(base, (x,))) for _ in range(16)]).wait(30)
            for i, version in enumerate(batch.versions):
                done[0] += 1
                if not torch.equal(batch.result(i), x * factors[version]):
                    wrong.append(version)

    thread = threading.Thread(target=load)
    thread.start()
    reports, rollbacks = [], []
    for k in range(rounds):
        factor = 3.0 + k + time.time() % 1  # a new constant: a real compile, not a cache hit
        factors[len(rt.history(base)) + 1] = factor
        rt.swap(base, f"A * {factor!r}")
        reports.append(rt.last_change)
        started = time.perf_counter()
        rt.rollback(base)
        rollbacks.append(1e6 * (time.perf_counter() - started))
        time.sleep(0.05)
    stop.set()
    thread.join()
    result = {
        "rounds": rounds,
        "compile_ms": med([r.compile_ms for r in reports]),
        "canary_ms": med([r.canary_ms for r in reports]),
        "link_ms": med([r.link_ms for r in reports]),
        "pause_ms": med([r.pause_ms for r in reports]),
        "pause_max_ms": max(r.pause_ms for r in reports),
        "load_ms": med([r.load_ms for r in reports]),
        "rollback_us": med(rollbacks),
        "rollback_max_us": max(rollbacks),
        "tasks_under_load": done[0],
        "wrong_or_failed": len(wrong),
    }
    print(f"(e) swap: {result}", flush=True)
    return result


def occupancy(reps: int) -> list[dict]:
    """(a) again at 1024 with more worker blocks per SM: latency hiding against room for torch."""
    rows = []
    for blocks in (2, 4):
        config = RuntimeConfig(backend="cuda", cuda=CudaConfig(blocks_per_sm=blocks))
        with Runtime(config=config) as rt:
            row = elementwise(rt, [1024], 10_000, reps, compile=False)[0]
        rows.append(
            {
                "blocks_per_sm": blocks,
                "runtime_ms": row["runtime_ms"],
                "eager_over_runtime": row["eager_ms"] / row["runtime_ms"],
            }
        )
    return rows


def dependent_chain(rt: Runtime, n: int, reps: int) -> dict:
    """(f) n dependent add(1024 fp32) tasks: one device program vs one submission per task vs
    torch eager vs CUDA-graph replay of the same torch ops. The cost of an edge is the program's
    time per task beyond the first, the dependent task's own run included."""
    x = torch.randn(1024, device=DEV)
    outs = [torch.empty_like(x) for _ in range(n)]

    def call(k: int) -> OpCall:
        return OpCall("add", (outs[k - 1] if k else x, x), out=outs[k])

    def launches() -> None:
        for k in range(n):
            torch.add(*call(k).inputs, out=outs[k])

    def program_of(count: int) -> Program:
        build = rt.program()
        for k in range(count):
            build.add(call(k))
        return build.build()

    program, single = program_of(n), program_of(1)
    staged = [rt.encode([rt.prepare(call(k))]) for k in range(n)]

    def per_stage() -> None:
        for work in staged:  # each task reads the one before: a submit and a wait each
            rt.submit(work).wait(60)

    outs[-1].fill_(float("nan"))
    ms = times_ms(lambda: rt.submit(program).wait(60), reps)
    result = {
        "n": n,
        "program_ms": med(ms),
        "program_p99_ms": p99(ms),
        "correct": bool(torch.allclose(outs[-1], x * (n + 1), rtol=1e-4, atol=1e-3)),
        "program1_ms": med(times_ms(lambda: rt.submit(single).wait(60), 5 * reps)),
        "per_stage_submit_ms": med(times_ms(per_stage, max(2, reps // 2))),
        "eager_ms": med(times_ms(lambda: (launches(), sync()), reps)),
        "graph_ms": med(times_ms(graph_of(launches), reps)),
    }
    result["edge_us"] = 1e3 * (result["program_ms"] - result["program1_ms"]) / (n - 1)
    print(f"(f) chain of {n}: {result}", flush=True)
    return result


def layered(rt: Runtime, layers: int, stages: int, width: int, reps: int) -> dict:
    """(g) layers x stages x width small tasks (1024 fp32): task (s, i) of an even stage adds
    results i and i+1 of the stage before (fan-in 2), of an odd stage takes its sigmoid. One
    program vs one submission per stage vs torch eager vs CUDA-graph replay of the torch ops."""
    depth = layers * stages
    first = torch.randn(width, 1024, device=DEV)
    cur = [torch.empty(depth, 1024, device=DEV) for _ in range(width)]
    steps = []  # (op, inputs, out) in program order
    for s in range(depth):
        prev = [first[i] for i in range(width)] if s == 0 else [cur[i][s - 1] for i in range(width)]
        for i in range(width):
            args = (prev[i], prev[(i + 1) % width]) if s % 2 == 0 else (prev[i],)
            steps.append(("add" if s % 2 == 0 else "sigmoid", args, cur[i][s]))

    def launches() -> None:
        for op, args, out in steps:
            getattr(torch, op)(*args, out=out)

    started = time.perf_counter()
    build = rt.program()
    for op, args, out in steps:
        build.add(OpCall(op, args, out=out))
    program = build.build()
    build_ms = 1e3 * (time.perf_counter() - started)
    staged = [
        rt.encode(
            [
                rt.prepare(OpCall(op, args, out=out))
                for op, args, out in steps[s * width : (s + 1) * width]
            ]
        )
        for s in range(depth)
    ]

    def per_stage() -> None:
        for work in staged:
            rt.submit(work).wait(60)

    launches()
    sync()
    want = torch.stack([c[-1] for c in cur]).clone()
    for c in cur:
        c.fill_(float("nan"))
    ms = times_ms(lambda: rt.submit(program).wait(60), reps)
    result = {
        "layers": layers,
        "stages": stages,
        "width": width,
        "tasks": len(steps),
        "records": len(program.tasks.records),
        "build_ms": build_ms,
        "program_ms": med(ms),
        "program_p99_ms": p99(ms),
        "correct": bool(torch.equal(torch.stack([c[-1] for c in cur]), want)),
        "per_stage_submit_ms": med(times_ms(per_stage, reps)),
        "eager_ms": med(times_ms(lambda: (launches(), sync()), reps)),
        "graph_ms": med(times_ms(graph_of(launches), reps)),
    }
    print(f"(g) layered DAG: {result}", flush=True)
    return result


def program_claims(claims: list[int], reps: int) -> list[dict]:
    """(f) and (g) again with each claim limit for programs (CudaConfig.program_claim): fewer
    records per claim spread a program's parallel tasks over more blocks at the cost of more
    contended claims."""
    rows = []
    for claim in claims:
        config = RuntimeConfig(backend="cuda", cuda=CudaConfig(program_claim=claim))
        with Runtime(config=config) as rt:
            chain_ms = dependent_chain(rt, 1000, reps)
            dag = layered(rt, 12, 8, 64, reps)
        rows.append(
            {
                "program_claim": claim,
                "chain1000_ms": chain_ms["program_ms"],
                "edge_us": chain_ms["edge_us"],
                "layered_ms": dag["program_ms"],
                "graph_over_layered": dag["graph_ms"] / dag["program_ms"],
            }
        )
    return rows


def describe() -> dict:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "device": torch.cuda.get_device_name(),
        "driver": smi,
        "torch": torch.__version__,
        "commit": os.environ.get("GPUOS_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--occupancy", action="store_true", help="also 2 and 4 blocks per SM")
    parser.add_argument(
        "--program-claims",
        default="",
        help="comma-separated program claim limits to rerun (f) and (g) with",
    )
    args = parser.parse_args()
    reps = 3 if args.quick else 7
    with Runtime("cuda") as rt:
        result = describe()
        result["elementwise"] = elementwise(
            rt, [1024] if args.quick else [256, 1024, 4096, 16384], 10_000, reps
        )
        result["chain"] = chain(rt, 1000, 2048, reps)
        result["attention"] = attention(rt, [1, 8, 32, 64], 32, 128, reps)
        result["roundtrip"] = roundtrip(rt, [1, 8, 64], 300)
        result["program_chain"] = dependent_chain(rt, 1000, reps)
        result["program_layered"] = layered(rt, 12, 8, 64, reps)
        result["swap"] = swap(rt, 5)
        result["driver_call_us"] = driver_call_us()
    if args.occupancy:
        result["blocks_per_sm"] = occupancy(reps)
    if args.program_claims:
        result["program_claims"] = program_claims(
            [int(c) for c in args.program_claims.split(",")], reps
        )
    mul = next(r for r in result["elementwise"] if r["size"] == 1024)
    one = result["roundtrip"][0]
    result["summary"] = {
        "mul10k_1024_ms": mul["runtime_ms"],
        "eager_over_runtime": mul["eager_ms"] / mul["runtime_ms"],
        "graph_over_runtime": mul["graph_ms"] / mul["runtime_ms"],
        "runtime_over_floor": mul["runtime_ms"] / mul["floor_ms"],
        "roundtrip1_p50_us": one["p50_us"],
        "roundtrip1_p99_us": one["p99_us"],
        "submit1_p50_us": one["submit_only_p50_us"],
        "swap_pause_ms": result["swap"]["pause_ms"],
        "rollback_us": result["swap"]["rollback_us"],
        "program_chain1000_ms": result["program_chain"]["program_ms"],
        "edge_us": result["program_chain"]["edge_us"],
        "program_layered_ms": result["program_layered"]["program_ms"],
        "graph_layered_ms": result["program_layered"]["graph_ms"],
        "graph_over_program_layered": (
            result["program_layered"]["graph_ms"] / result["program_layered"]["program_ms"]
        ),
        "stages_over_program_layered": (
            result["program_layered"]["per_stage_submit_ms"]
            / result["program_layered"]["program_ms"]
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "micro.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
