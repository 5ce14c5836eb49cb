"""Kernel benchmarks of the runtime's matmul-class operators on a CUDA device: each figure beside
torch's in the same run and beside the device's copy bandwidth measured in that run. Writes
kernels-<device>-<commit>.json (device, commit, every row, a flat summary) to --out and prints a
table per section.

    python3 bench/kernels.py --out bench/results [--quick]

Timing. Ours: one runtime submission of back-to-back tasks (encoded once, rt.submit(...).wait()).
Torch's: the same calls replayed from one CUDA graph. Each side is timed at CALLS and at 2 CALLS
calls, and a call's time is the difference over CALLS: what one more call costs, without the
submission's or the graph launch's fixed cost. Calls rotate over copies of the weights (the KV
caches) spanning several times the L2, so that every call reads them from device memory, as a
decode step does.
Host timing around work that ends in a stream synchronize, never a device-wide one (it would wait
for the worker's lease); torch's graphs are captured before the runtime starts its worker
(capture synchronizes the device and empties torch's cache).

Sections (issue 12; each a Section in SECTIONS: its `baseline` runs before the runtime exists,
`measure` with it; its summary keys join the summary):
  linear     x @ W^T at GPT-2 and Llama-3.2-1B shapes vs F.linear, decode rows (1 to 64);
  prefill    the same at a prefill chunk's rows (128 and 512), where arithmetic bounds it: TFLOP/s
             beside torch's (summary.linear_prefill_vs_torch_worst);
  attention  decode attention of R requests (1, 8, 64) x 32 query heads over 32 or 8 KV heads,
             head dim 128 (and 64), fp16, ragged lengths 64..2048 in caches of 2048, vs SDPA over
             the padded cache with a length mask; GB/s count the K and V bytes the lengths
             cover (summary.attn_r64_bw_frac: 64 requests x 32 heads against the copy bandwidth).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import math
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from micro import describe, graph_of, med, sync, times_ms  # bench/ is the script's directory

from gpuos_core import CudaConfig, OpCall, Runtime, RuntimeConfig

faulthandler.dump_traceback_later(540, exit=True)  # a hang prints where it stuck, then exits
DEV = torch.device("cuda")
CALLS = 100  # calls per timed submission / graph (and twice as many)
L2_SPAN = 4  # the rotated weights span this many times the L2
LINEAR_SHAPES = [
    (768, 2304),
    (768, 3072),
    (3072, 768),
    (768, 50257),
    (2048, 2048),
    (2048, 8192),
    (8192, 2048),
]  # (K, N): input dim x output dim
LINEAR_ROWS = [1, 8, 32, 64]
PREFILL_ROWS = [128, 512]  # rows of a prefill chunk's matmul (the engine's step is 512 tokens)
DECODE_ROWS = 64  # rows of a decode step's matmul, at most (summary.linear_min_bw_frac)
BIG_WEIGHTS = 16 << 20  # ... over weights of at least this many bytes
ATTN_REQUESTS = [1, 8, 64]  # requests (rows of the engine's attention call)
ATTN_HEADS = [(32, 32), (32, 8)]  # (query heads, KV heads): multi-head and grouped-query
ATTN_CAPACITY = 2048  # keys a request's cache holds (L)
ATTN_LENGTHS = (64, 2048)  # ragged lengths, uniform in this range


@dataclass
class Context:
    """What every section's measurement shares."""

    copy_gbps: float  # device-to-device copy, bytes read plus written per second, / 1e9
    reps: int  # timed repetitions (medians are reported)
    l2_bytes: int


@dataclass
class Case:
    """One measured shape: torch's figures in its row, and how to make and check our calls (which
    hold its tensors)."""

    row: dict[str, Any]  # what the JSON and the table show
    make_calls: Callable[[int], list[OpCall]]  # n calls of our operator, outputs preallocated
    check: Callable[[list[OpCall]], float]  # relative error of our first call's output


@dataclass(frozen=True)
class Section:
    name: str
    baseline: Callable[[Context, bool], list[Case]]  # tensors and torch's timings; no runtime yet
    measure: Callable[[Runtime, Case, Context], None]  # our timings into case.row
    summarise: Callable[[list[dict]], dict[str, float]]
    show: Callable[[dict], str]  # one table line per row


def copy_bandwidth(reps: int) -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read plus written), median of `reps`."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = med(times_ms(lambda: (dst.copy_(src), sync()), reps))
    return 2 * src.numel() / ms / 1e6


def per_call_ms(run: Callable[[int], Callable[[], object]], reps: int) -> tuple[float, float]:
    """(ms one more call costs, ms per call at CALLS calls): `run(n)` returns a function that makes
    n calls and waits for them."""
    one, two = run(CALLS), run(2 * CALLS)
    t1, t2 = med(times_ms(one, reps)), med(times_ms(two, reps))
    return (t2 - t1) / CALLS, t1 / CALLS


def measure(rt: Runtime, case: Case, ctx: Context) -> None:
    """Our per-call time: CALLS (and 2 CALLS) of the case's tasks, encoded once, one submission
    each; GB/s of the row's bytes, on both sides and against the copy bandwidth."""
    work = {}

    def submission(count: int) -> Callable[[], None]:
        calls = case.make_calls(count)
        work[count] = (calls, rt.encode([rt.prepare(c) for c in calls]))
        return lambda: rt.submit(work[count][1]).wait(120)

    ours_ms, ours_raw = per_call_ms(submission, ctx.reps)
    row = case.row
    row.update(
        ours_ms=ours_ms,
        ours_ms_at_100=ours_raw,
        ours_over_torch=ours_ms / row["torch_ms"],
        ours_gbps=row["bytes"] / ours_ms / 1e6,
        torch_gbps=row["bytes"] / row["torch_ms"] / 1e6,
        rel_error=case.check(work[CALLS][0]),
    )
    row.update(
        ours_bw_frac=row["ours_gbps"] / ctx.copy_gbps,
        torch_bw_frac=row["torch_gbps"] / ctx.copy_gbps,
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ---- linear -----------------------------------------------------------------------------------


def linear_weights(k: int, n: int, ctx: Context, seed: int) -> list[torch.Tensor]:
    """Copies of one fp16 weight [n, k], enough to span L2_SPAN times the L2 (at most 2 CALLS)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    first = (torch.randn(n, k, generator=gen, device=DEV) / math.sqrt(k)).half()
    copies = min(2 * CALLS, max(1, math.ceil(L2_SPAN * ctx.l2_bytes / first.nbytes)))
    return [first] + [first.clone() for _ in range(copies - 1)]


def linear_calls(
    x: torch.Tensor, weights: list[torch.Tensor], outs: torch.Tensor, count: int
) -> list[OpCall]:
    """`count` calls x @ W.T, rotating over the weights, each into its own output."""
    return [OpCall("linear", (x, weights[i % len(weights)]), out=outs[i]) for i in range(count)]


def graph_of_calls(call: Callable[[int], object], count: int) -> Callable[[], None]:
    """A replay of `count` torch calls call(0), call(1), ... captured in one CUDA graph,
    synchronised."""
    return graph_of(lambda: [call(i) for i in range(count)])


def first_error(ref: torch.Tensor, calls: list[OpCall]) -> float:
    return rel_error(calls[0].out, ref)


def linear_baseline(rows: list[int], ctx: Context, quick: bool) -> list[Case]:
    """Every (K, N, M) case, M in `rows`, with torch's per-call time (F.linear from a CUDA
    graph)."""
    cases = []
    shapes = LINEAR_SHAPES[::3] if quick else LINEAR_SHAPES
    for seed, (k, n) in enumerate(shapes):
        weights = linear_weights(k, n, ctx, seed)
        for m in rows[::3] if quick else rows:
            x = torch.randn(m, k, device=DEV).half()
            graph = functools.partial(
                graph_of_calls, lambda i: F.linear(x, weights[i % len(weights)])
            )
            torch_ms, torch_raw = per_call_ms(graph, ctx.reps)
            row = {
                "k": k,
                "n": n,
                "m": m,
                "weight_mb": weights[0].nbytes / 2**20,
                "copies": len(weights),
                "torch_ms": torch_ms,
                "torch_ms_at_100": torch_raw,
                "bytes": weights[0].nbytes + x.nbytes + 2 * m * n,
                "flop": 2 * m * n * k,
            }
            outs = torch.empty(2 * CALLS, m, n, dtype=torch.float16, device=DEV)
            ref = F.linear(x.float(), weights[0].float())
            cases.append(
                Case(
                    row,
                    functools.partial(linear_calls, x, weights, outs),
                    functools.partial(first_error, ref),
                )
            )
            print(f"torch linear K={k} N={n} M={m}: {1e3 * torch_ms:.1f} us/call", flush=True)
    return cases


def linear_summary(rows: list[dict]) -> dict[str, float]:
    big = [
        r["ours_bw_frac"]
        for r in rows
        if r["m"] <= DECODE_ROWS and r["weight_mb"] * 2**20 >= BIG_WEIGHTS
    ]
    return {
        "linear_min_bw_frac": min(big, default=float("nan")),
        "linear_vs_torch_worst": max(r["ours_over_torch"] for r in rows),
        # the same ratio with each side's fixed cost in (one submission, one graph launch)
        "linear_vs_torch_worst_at_100": max(
            r["ours_ms_at_100"] / r["torch_ms_at_100"] for r in rows
        ),
        "linear_max_rel_error": max(r["rel_error"] for r in rows),
    }


def prefill_summary(rows: list[dict]) -> dict[str, float]:
    return {
        "linear_prefill_vs_torch_worst": max(r["ours_over_torch"] for r in rows),
        "linear_prefill_min_tflops": min(tflops(r, "ours_ms") for r in rows),
        "linear_prefill_max_rel_error": max(r["rel_error"] for r in rows),
    }


def tflops(r: dict, side: str) -> float:
    return r["flop"] / r[side] / 1e9


def timings(r: dict) -> str:
    """The table's columns every section shares: ours and torch's per-call time, GB/s and
    fraction of the copy bandwidth, their ratio and our error."""
    return (
        f"ours {1e3 * r['ours_ms']:8.2f} us {r['ours_gbps']:6.0f} GB/s {r['ours_bw_frac']:5.2f}"
        f" | torch {1e3 * r['torch_ms']:8.2f} us {r['torch_gbps']:6.0f} GB/s "
        f"{r['torch_bw_frac']:5.2f} | ours/torch {r['ours_over_torch']:5.2f} | "
        f"err {r['rel_error']:.1e}"
    )


def linear_show(r: dict) -> str:
    return f"K={r['k']:5d} N={r['n']:5d} M={r['m']:3d} {r['weight_mb']:6.1f} MB | {timings(r)}"


def prefill_show(r: dict) -> str:
    return (
        f"K={r['k']:5d} N={r['n']:5d} M={r['m']:3d} | ours {1e3 * r['ours_ms']:8.2f} us "
        f"{tflops(r, 'ours_ms'):5.0f} TFLOP/s | torch {1e3 * r['torch_ms']:8.2f} us "
        f"{tflops(r, 'torch_ms'):5.0f} TFLOP/s | ours/torch {r['ours_over_torch']:5.2f} | "
        f"err {r['rel_error']:.1e}"
    )


# ---- attention ------------------------------------------------------------------------------


def attention_cases(quick: bool) -> list[tuple[int, int, int, int]]:
    """(requests, query heads, KV heads, head dim), in the order measured."""
    cases = [(r, h, kv, 128) for r in ATTN_REQUESTS for h, kv in ATTN_HEADS]
    cases += [(max(ATTN_REQUESTS), h, kv, 64) for h, kv in ATTN_HEADS]
    return [c for c in cases if c[0] == max(ATTN_REQUESTS)][:2] if quick else cases


def kv_caches(
    requests: int, kv_heads: int, d: int, used: int, ctx: Context
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one fp16 cache (K, V) [requests, kv_heads, ATTN_CAPACITY, d], enough that the
    `used` bytes each call reads span L2_SPAN times the L2 (at most 2 CALLS)."""
    shape = (requests, kv_heads, ATTN_CAPACITY, d)
    first = tuple(torch.randn(shape, device=DEV).half() for _ in range(2))
    copies = min(2 * CALLS, max(1, math.ceil(L2_SPAN * ctx.l2_bytes / used)))
    return [first] + [(first[0].clone(), first[1].clone()) for _ in range(copies - 1)]


def sdpa(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """torch's attention of q [R, Hkv, G, D] over the padded cache, keys past each length masked
    (grouped heads through enable_gqa); [R, Hkv, G, D]."""
    r, kv_heads, group, d = q.shape
    out = F.scaled_dot_product_attention(
        q.reshape(r, kv_heads * group, 1, d), *kv, attn_mask=mask, enable_gqa=group > 1
    )
    return out.view(q.shape)


def attention_calls(
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    lengths: torch.Tensor,
    outs: torch.Tensor,
    count: int,
) -> list[OpCall]:
    """`count` decode steps' attention (the engine's call), rotating over the caches."""
    calls = []
    for i in range(count):
        k, v = caches[i % len(caches)]
        calls.append(
            OpCall("attention_decode", (q, k[:, :, None], v[:, :, None], lengths), out=outs[i])
        )
    return calls


def attention_baseline(ctx: Context, quick: bool) -> list[Case]:
    """Every (R, heads, D) case over ragged lengths, with torch's per-call time (SDPA over the
    padded cache with a length mask, from a CUDA graph)."""
    cases = []
    for seed, (r, heads, kv_heads, d) in enumerate(attention_cases(quick)):
        gen = torch.Generator().manual_seed(seed)
        n = torch.randint(ATTN_LENGTHS[0], ATTN_LENGTHS[1] + 1, (r,), generator=gen)
        used = int(n.sum()) * kv_heads * d * 2 * 2  # bytes of K and V read
        caches = kv_caches(r, kv_heads, d, used, ctx)
        q = torch.randn(r, kv_heads, heads // kv_heads, d, device=DEV).half()
        mask = (torch.arange(ATTN_CAPACITY) < n[:, None]).to(DEV)[:, None, None, :]
        graph = functools.partial(graph_of_calls, lambda i: sdpa(q, caches[i % len(caches)], mask))
        torch_ms, torch_raw = per_call_ms(graph, ctx.reps)
        row = {
            "requests": r,
            "heads": heads,
            "kv_heads": kv_heads,
            "d": d,
            "copies": len(caches),
            "mean_length": float(n.float().mean()),
            "torch_ms": torch_ms,
            "torch_ms_at_100": torch_raw,
            "bytes": used,
        }
        lengths = n.to(device=DEV, dtype=torch.int32).view(r, 1, 1)
        outs = torch.empty((2 * CALLS,) + tuple(q.shape), dtype=torch.float16, device=DEV)
        ref = sdpa(q.float(), tuple(t.float() for t in caches[0]), mask)
        cases.append(
            Case(
                row,
                functools.partial(attention_calls, q, caches, lengths, outs),
                functools.partial(first_error, ref),
            )
        )
        print(
            f"torch attention R={r} H={heads}/{kv_heads} D={d}: {1e3 * torch_ms:.1f} us/call",
            flush=True,
        )
    return cases


def attention_summary(rows: list[dict]) -> dict[str, float]:
    def frac(kv_heads: int) -> float:
        found = [
            r["ours_bw_frac"]
            for r in rows
            if r["requests"] == max(ATTN_REQUESTS) and r["kv_heads"] == kv_heads and r["d"] == 128
        ]
        return found[0] if found else float("nan")

    return {
        "attn_r64_bw_frac": frac(32),  # 64 requests x 32 heads, ragged 64..2048 (issue 12)
        "attn_r64_gqa_bw_frac": frac(8),
        "attn_vs_sdpa_worst": max(r["ours_over_torch"] for r in rows),
        "attn_max_rel_error": max(r["rel_error"] for r in rows),
    }


def attention_show(r: dict) -> str:
    return (
        f"R={r['requests']:3d} H={r['heads']:2d}/{r['kv_heads']:2d} D={r['d']:3d} "
        f"{r['bytes'] / 2**20:7.1f} MB | {timings(r)}"
    )


SECTIONS = (
    Section(
        "linear",
        functools.partial(linear_baseline, LINEAR_ROWS),
        measure,
        linear_summary,
        linear_show,
    ),
    Section(
        "prefill",
        functools.partial(linear_baseline, PREFILL_ROWS),
        measure,
        prefill_summary,
        prefill_show,
    ),
    Section("attention", attention_baseline, measure, attention_summary, attention_show),
)


# ---- driver -----------------------------------------------------------------------------------


def commit() -> str:
    """GPUOS_COMMIT as describe() reads it, else the checkout's HEAD, else 'unknown'."""
    described = describe()["commit"]
    if described != "unknown":
        return described
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() or "unknown"


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"


def blocks_argument(parser: argparse.ArgumentParser) -> None:
    """--blocks-per-sm: the runtime's worker blocks per SM (CudaConfig.blocks_per_sm)."""
    parser.add_argument(
        "--blocks-per-sm", type=int, default=CudaConfig().blocks_per_sm, help="worker blocks per SM"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument(
        "--sections",
        nargs="+",
        default=[s.name for s in SECTIONS],
        choices=[s.name for s in SECTIONS],
    )
    blocks_argument(parser)
    args = parser.parse_args()
    sections = [s for s in SECTIONS if s.name in args.sections]
    reps = 3 if args.quick else 7
    ctx = Context(copy_bandwidth(reps), reps, torch.cuda.get_device_properties(DEV).L2_cache_size)
    print(
        f"copy bandwidth {ctx.copy_gbps:.0f} GB/s (read + written), L2 {ctx.l2_bytes >> 20} MB",
        flush=True,
    )
    cases = {s.name: s.baseline(ctx, args.quick) for s in sections}  # before the worker exists
    config = RuntimeConfig(backend="cuda", cuda=CudaConfig(blocks_per_sm=args.blocks_per_sm))
    with Runtime(config=config) as rt:
        for s in sections:
            for case in cases[s.name]:
                s.measure(rt, case, ctx)
                print(f"{s.name}: {s.show(case.row)}", flush=True)
    result = {
        **describe(),
        "commit": commit(),
        "copy_gbps": ctx.copy_gbps,
        "calls": CALLS,
        "blocks_per_sm": args.blocks_per_sm,
        "summary": {},
    }
    for s in sections:
        rows = [c.row for c in cases[s.name]]
        result[s.name] = rows
        result["summary"].update(s.summarise(rows))
        print(f"\n== {s.name} (copy bandwidth {ctx.copy_gbps:.0f} GB/s)")
        print("\n".join(s.show(r) for r in rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels-{slug(result['device'])}-{result['commit']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
