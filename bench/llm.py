"""LLM decode (issue 13): the engine, its step one device program on the runtime, against a torch
decode loop replayed from CUDA graphs and Hugging Face `generate`, measured in the same run on the
same model. Per shape and per R concurrent streams: decode step ms, tokens/s including prefill, the
ratios, and the weights-read floor of a step. Writes llm-<device>-<commit>.json (every row; summary
per shape, summary[shape]["R<r>"], and gpt2's also at summary["R<r>"]) to --out, rewritten after
every phase, and prints a table per shape.

    python3 bench/llm.py --out bench/results [--shapes gpt2 llama] [--streams 1 8] [--with-256]
    python3 bench/llm.py --backend cpu --shapes gpt2 llama --streams 1 2 --prompt 8 --new 4  # smoke

Protocol. A random model of the shape, saved and loaded through the Hugging Face path, fp16 on CUDA
(bf16 for llama-1b, fp32 on the CPU backend); prompts of --prompt tokens, --new tokens each, greedy,
all R prompts at once; ours and the graph loop keep the median of --reps timed runs (3), the
other two one. Ways:
- engine+runtime (ours): step ms = median gap between consecutive tokens of a stream, tokens/s =
  R*new / wall from submission to the last token; one untimed run of the same R first (it builds
  the step programs of that R's layouts).
- graph loop: the model's forward (forward.py) over `LoopOps`: rows [R streams x T tokens], a
  static KV cache per layer [R, kv_heads, max_len, d], torch SDPA, F.linear and the model's
  norms; one CUDA graph per decode position captured ahead, batched prefill eager (warmed once),
  token ids read back every step. Step ms = median of (replay + readback). On the CPU backend the
  loop runs eagerly (no graphs).
- engine+torch: the engine with its micro-ops launched by torch; hf generate: when `transformers`
  imports (its step ms = (wall at new - wall at 1 token) / (new - 1)).
floor_ms = bytes a step reads (every weight but the gathered tables) / the device-to-device copy
bandwidth measured in the run (bytes read plus written per second, as bench/kernels.py).

Order: every baseline of every shape first, then one Runtime for the engines: graph capture
synchronizes the device, and the runtime's worker must not be running then. A CPU check at the
start runs the loop eagerly on tiny models of both families against forward_tokens and stops the
run unless their greedy tokens agree. `agree` in a row: leading tokens of stream 0 equal to
forward_tokens' greedy tokens (fp16 noise may part them late).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import signal
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from kernels import blocks_argument, commit, copy_bandwidth, slug  # bench/ is the script's dir
from micro import captured, describe, p99

from gpuos_core import CudaConfig, Runtime, RuntimeConfig
from serving.llm import ByteTokenizer, Model, forward_tokens, load_model
from serving.llm.engine import Engine, EngineConfig
from serving.llm.forward import TorchOps, forward
from serving.llm.model import (
    TINY,
    ModelConfig,
    parse_config,
    random_weights,
    rotary_cos_sin,
    save_pretrained,
    weights_to_hf,
)
from serving.llm.sampling import Detokenizer, SamplingParams

LLAMA = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "max_position_embeddings": 1024,
}
GPT2 = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {  # family, config.json overrides of TINY's
    "gpt2": ("gpt2", GPT2),  # vocab 256: the byte tokenizer decodes every id
    "gpt2-vocab": ("gpt2", {**GPT2, "vocab_size": 50257, "eos_token_id": 50256}),
    "llama": ("llama", LLAMA),
    # Llama-3.2-1B less its rope_scaling, which the loader does not support (it changes the
    # rotary frequencies, not the step's work)
    "llama-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "max_position_embeddings": 2048,
        },
    ),
}
TARGET_STEP_MS, TARGET_OVER_GRAPH = 0.4, 1.5  # gpt2 at R <= 64; tokens/s at R in 8, 32, 64
OURS = "engine+runtime"  # the way of the engine on the runtime (at the first --decode-steps)
BASELINE_S, ENGINE_S = 240, 240  # a phase (one shape) hung past this: print stacks and exit


def deadline(seconds: float) -> None:
    """A hang past `seconds` from now prints every thread's stack and exits; the JSON holds what
    the phases before measured."""
    faulthandler.dump_traceback_later(seconds, exit=True)


# ---- model and prompts ------------------------------------------------------------------------


def shape_dtype(shape: str, device: str) -> torch.dtype:
    if device == "cpu":
        return torch.float32
    return torch.bfloat16 if shape == "llama-1b" else torch.float16


def make_model(shape: str, device: str, where: Path) -> Model:
    """A random model of `shape` saved at `where` (Hugging Face format) and loaded from it."""
    family, overrides = SHAPES[shape]
    dtype = shape_dtype(shape, device)
    raw = {**TINY[family], **overrides, "torch_dtype": str(dtype).removeprefix("torch.")}
    tensors = weights_to_hf(parse_config(raw), random_weights(parse_config(raw), seed=0))
    # in the run's dtype: a 1B model's fp32 file would be twice the bytes to write and read
    save_pretrained(where, raw, {k: v.to(dtype) for k, v in tensors.items()})
    return load_model(where, dtype=dtype, device=device)


def prompts(r: int, length: int) -> list[list[int]]:
    """Stream i's prompt depends on i alone, so stream 0's reference serves every R."""
    return [
        torch.randint(1, 256, (length,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(r)
    ]


def reference_tokens(model: Model, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens of one request by forward_tokens (the torch reference)."""
    device = model.weights.embed.device
    cache = model.new_cache(len(prompt) + new)
    out = [int(forward_tokens(model, torch.tensor(prompt, device=device), cache)[-1].argmax())]
    for start in range(len(prompt), len(prompt) + new - 1):
        ids = torch.tensor(out[-1:], device=device)
        out.append(int(forward_tokens(model, ids, cache, start)[-1].argmax()))
    return out


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's."""
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
        min(len(tokens), len(reference)),
    )


class IdChars:
    """Tokenizer stand-in for vocabularies past the byte tokenizer's 256: every id one character
    (the engine detokenizes each token; the text is never read)."""

    eos_id = None
    eos_ids: frozenset[int] = frozenset()
    bos_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 95) for i in ids)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


def step_bytes(model: Model) -> int:
    """Bytes of the weights one decode step reads whole: the embedding and position tables are
    only gathered (unless the embedding is also the LM head)."""
    w = model.weights
    gathered = {id(w.positions)} | ({id(w.embed)} if w.embed is not w.lm_head else set())
    return sum(t.nbytes for t in w.tensors() if id(t) not in gathered)


def sync(device: str) -> None:
    """Wait for the device's work (a stream-level wait on CUDA)."""
    if device != "cpu":
        torch.cuda.current_stream().synchronize()


# ---- the torch decode loop (the CUDA-graph baseline) -------------------------------------------


class LoopOps(TorchOps):
    """MicroOps over rows [R streams x T tokens] (stream-major) at positions start..start+T-1 of
    every stream (prompts are equally long), a static KV cache [layers, R, kv_heads, max_len, d]
    and SDPA. Norms, linears and activations are TorchOps' (the model's reference functions)."""

    def __init__(
        self,
        config: ModelConfig,
        kv: tuple[torch.Tensor, torch.Tensor],
        tokens: torch.Tensor,
        start: int,
        count: int,
    ) -> None:
        self.config, self.kv, self.tokens = config, kv, tokens
        self.start, self.count, self.streams = start, count, tokens.shape[0] // count
        self.positions = torch.arange(start, start + count, device=tokens.device).repeat(
            self.streams
        )
        if config.rope_theta is not None:  # fixed per position: computed here, not in the graph
            cos, sin = rotary_cos_sin(self.positions, config.head_dim, config.rope_theta)
            self.cos, self.sin = (t[:, None].to(kv[0].dtype) for t in (cos, sin))

    def rotary(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)  # apply_rotary's rotate-half, with cos/sin hoisted
        return x * self.cos + torch.cat([-x2, x1], dim=-1) * self.sin

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        c, r, t, end = self.config, self.streams, self.count, self.start + self.count
        cached = []
        for new, cache in zip((k, v), (self.kv[0][layer], self.kv[1][layer])):
            cache[:, :, self.start : end] = new.view(r, t, c.kv_heads, c.head_dim).transpose(1, 2)
            cached.append(cache[:, :, :end])
        group = c.heads // c.kv_heads
        if t == 1:  # decode: every cached key is visible; a kv head's query group attends as rows
            out = F.scaled_dot_product_attention(q.view(r, c.kv_heads, group, c.head_dim), *cached)
            return out.reshape(r, c.heads, c.head_dim)
        assert self.start == 0, "prefill starts at position 0"
        keys, values = (x.repeat_interleave(group, dim=1) for x in cached)
        out = F.scaled_dot_product_attention(
            q.view(r, t, c.heads, c.head_dim).transpose(1, 2), keys, values, is_causal=True
        )
        return out.transpose(1, 2).reshape(r * t, c.heads, c.head_dim)

    def logits(self, h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        # each stream's last row; argmax needs no fp32 copy
        return F.linear(h.view(self.streams, self.count, -1)[:, -1], head)


@dataclass
class LoopRun:
    """One run of the loop."""

    tokens: list[list[int]]  # [streams][new]
    steps_s: list[float]  # per decode step: replay (or eager forward) + token readback
    wall_s: float  # prompts in to the last token read back


class TorchLoop:
    """Greedy decode of R equal-length prompts: one batched prefill, then one step per position,
    each replayed from a CUDA graph when `graphs` (else run eagerly). A step's graph is captured
    right after the step first ran eagerly (its warm-up) in the first run: graphs of every
    position captured ahead, before the prefill, replayed index kernels out of bounds on the
    H200 (torch 2.11), which captures made after the state they read was written do not."""

    def __init__(self, model: Model, streams: int, prompt: int, new: int, graphs: bool) -> None:
        c, w = model.config, model.weights.embed
        shape = (c.layers, streams, c.kv_heads, prompt + new, c.head_dim)
        kv = (
            torch.zeros(shape, dtype=w.dtype, device=w.device),
            torch.zeros(shape, dtype=w.dtype, device=w.device),
        )
        self.prompt_ids = torch.zeros(streams * prompt, dtype=torch.long, device=w.device)
        self.ids = torch.zeros(streams, dtype=torch.long, device=w.device)  # next step's input
        self.prefill = self._step(model, LoopOps(c, kv, self.prompt_ids, 0, prompt))
        self.steps = [
            self._step(model, LoopOps(c, kv, self.ids, p, 1))
            for p in range(prompt, prompt + new - 1)
        ]
        self.graphs = graphs
        self.replays: list[Callable[[], None] | None] = [None] * len(self.steps)

    def _step(self, model: Model, ops: LoopOps) -> Callable[[], object]:
        # The step holds `ids`, not the loop: a loop that held itself through its steps was freed
        # by the cyclic collector whenever it ran, once in the middle of the next R's capture,
        # which freeing its graphs invalidated (cudaErrorStreamCaptureInvalidated on the H200).
        ids = self.ids
        return lambda: ids.copy_(forward(model, ops).argmax(-1))

    def run(self, batch: list[list[int]]) -> LoopRun:
        started = time.perf_counter()
        self.prompt_ids.copy_(torch.tensor(batch).flatten())
        self.prefill()
        out, steps = [self.ids.tolist()], []
        for i, step in enumerate(self.steps):
            t0 = time.perf_counter()
            replay = self.replays[i]
            if replay is not None:
                replay()
            else:
                step()
                self.replays[i] = captured(step) if self.graphs else None
            out.append(self.ids.tolist())
            steps.append(time.perf_counter() - t0)
        return LoopRun([list(s) for s in zip(*out)], steps, time.perf_counter() - started)


def check_agreement() -> None:
    """The loop, eager on the CPU in fp32, against forward_tokens on tiny models of both
    families: the same greedy tokens for every stream, or the run stops."""
    for family in TINY:
        config = parse_config(TINY[family])
        model = Model(config, random_weights(config, seed=1))
        batch, new = prompts(3, 8), 6
        got = TorchLoop(model, len(batch), 8, new, graphs=False).run(batch).tokens
        want = [reference_tokens(model, p, new) for p in batch]
        same = sum(agreement(g, w) for g, w in zip(got, want))
        print(
            f"agreement check ({family}, CPU eager fp32): {same}/{len(batch) * new} tokens "
            "equal forward_tokens'",
            flush=True,
        )
        if got != want:
            raise SystemExit(f"torch loop disagrees with forward_tokens: {got} != {want}")


# ---- rows -------------------------------------------------------------------------------------


def row(
    way: str,
    r: int,
    new: int,
    wall: float,
    gaps: list[float],
    first: float,
    tokens0: list[int],
    reference: list[int],
) -> dict:
    return {
        "way": way,
        "streams": r,
        "tokens": r * new,
        "wall_s": wall,
        "tokens_per_s": r * new / wall,
        "step_ms": 1e3 * statistics.median(gaps),
        "step_p99_ms": 1e3 * p99(gaps),
        "first_token_ms": 1e3 * first,
        "agree": agreement(tokens0, reference),
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time (with an odd count, the middle one)."""
    return sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]


def loop_rows(
    rows: list[dict],
    model: Model,
    streams: list[int],
    prompt: int,
    new: int,
    reference: list[int],
    reps: int,
) -> None:
    """Append the torch loop's row of each R to `rows` (as measured, so a failure keeps them)."""
    graphs = model.weights.embed.is_cuda
    way = "graph loop" if graphs else "torch loop (eager, no graphs)"
    for r in streams:
        loop, batch = TorchLoop(model, r, prompt, new, graphs), prompts(r, prompt)
        loop.run(batch)  # warm-up: prefill's kernels, each step's eager run and its capture
        runs = [loop.run(batch) for _ in range(reps)]
        rows.append(
            median_run(
                [
                    row(
                        way,
                        r,
                        new,
                        x.wall_s,
                        x.steps_s,
                        x.wall_s - sum(x.steps_s),
                        x.tokens[0],
                        reference,
                    )
                    for x in runs
                ]
            )
        )
        rows[-1]["graphs"] = graphs
        del loop  # its graphs' memory, now (TorchLoop._step: no reference cycle)
        print(rows[-1], flush=True)


def hf_rows(
    rows: list[dict],
    path: Path,
    model: Model,
    streams: list[int],
    prompt: int,
    new: int,
    reference: list[int],
) -> None:
    """Append rows of Hugging Face `generate` (greedy, its default cache) on the same saved
    model; none when transformers does not import."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    device = str(model.weights.embed.device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: model.dtype})
    hf = hf.to(device).eval()

    def generate(ids: torch.Tensor, n: int) -> tuple[float, list[int]]:
        started = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        sync(device)
        return time.perf_counter() - started, out[0, ids.shape[1] :].tolist()

    for r in streams:
        ids = torch.tensor(prompts(r, prompt), device=device)
        generate(ids, 2)  # warm-up
        first, _ = generate(ids, 1)
        wall, tokens0 = generate(ids, new)
        rows.append(
            row(
                "hf generate", r, new, wall, [(wall - first) / (new - 1)], first, tokens0, reference
            )
        )
        print(rows[-1], flush=True)


def engine_rows(
    rows: list[dict],
    engine: Engine,
    way: str,
    streams: list[int],
    prompt: int,
    new: int,
    reference: list[int],
    reps: int,
) -> None:
    """Append the engine's row of each R (the median of `reps` runs, after an untimed one)."""
    for r in streams:
        batch = prompts(r, prompt)
        for _ in range(2):  # prefill then two decode steps, twice: each of this R's layouts
            engine_run(engine, way, batch, 3, reference)  # built for both parities (StepChain)
        rows.append(
            median_run([engine_run(engine, way, batch, new, reference) for _ in range(reps)])
        )
        print(rows[-1], flush=True)


def engine_run(
    engine: Engine, way: str, batch: list[list[int]], new: int, reference: list[int]
) -> dict:
    """All prompts submitted at once; wall time to the last token, a decode step's time (each
    stream's mean gap between tokens: steps run several to a program hand their tokens over
    together), the longest gaps, and the step loop's host and wait time a decode step, from the
    last stream's first delta on (the host bounds the steps where the wait is small)."""
    params = SamplingParams(max_tokens=new, temperature=0.0)
    started = time.perf_counter()
    streams = engine.submit_many(batch, params)  # one admission: runs see the same steps
    deltas = iter(streams[-1])
    first_delta = next(deltas)  # its prompt came in the last chunk: decode steps from here
    before = engine.steps, engine.host_s, engine.wait_s
    ends = [list(s)[-1] for s in streams[:-1]] + [[first_delta, *deltas][-1]]
    for last in ends:
        assert last.finish_reason == "length", f"stream ended {last.finish_reason}: {last.error}"
    wall = time.perf_counter() - started
    steps = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) for s in streams]
    gaps = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:])]
    first = statistics.median(s.token_times[0] - started for s in streams)
    out = row(way, len(batch), new, wall, steps, first, streams[0].tokens, reference)
    out["gap_p99_ms"] = 1e3 * p99(gaps)
    ran = max(1, engine.steps - before[0])
    out["host_ms_per_step"] = 1e3 * (engine.host_s - before[1]) / ran
    out["wait_ms_per_step"] = 1e3 * (engine.wait_s - before[2]) / ran
    return out


def new_engine(
    model: Model,
    runtime: Runtime | None,
    streams: list[int],
    prompt: int,
    new: int,
    step_tokens: int,
    decode_steps: int,
) -> Engine:
    tokenizer = ByteTokenizer(eos_id=None) if model.config.vocab_size <= 256 else IdChars()
    config = EngineConfig(
        max_running=max(streams),
        max_len=prompt + new + 1,
        max_step_tokens=step_tokens,
        decode_steps=decode_steps,
        micro_ops="runtime" if runtime is not None else "torch",
    )
    return Engine(model, tokenizer, runtime, config)


# ---- phases -----------------------------------------------------------------------------------


@dataclass
class Bench:
    """One shape's model, its reference tokens and what was measured of it."""

    shape: str
    path: Path
    model: Model
    reference: list[int]  # stream 0's greedy tokens by forward_tokens
    streams: list[int]  # the R values measured (those that fit)
    rows: list[dict]


def fits(model: Model, r: int, prompt: int, new: int) -> bool:
    """Whether the graph loop's graphs and prefill at R streams fit the free device memory (a
    rough upper bound: every captured step keeps its own activations and logits)."""
    if not model.weights.embed.is_cuda:
        return True
    c, size = model.config, model.dtype.itemsize
    per_row = c.vocab_size + 6 * c.intermediate + 12 * c.hidden
    need = 2 * size * r * (new * per_row + prompt * (per_row - c.vocab_size))
    return need < 0.8 * torch.cuda.mem_get_info()[0]


def baselines(bench: Bench, streams: list[int], args: argparse.Namespace, notes: list[str]) -> None:
    """The torch loop, HF generate and the engine with torch micro-ops: no runtime exists yet."""
    ok = bench.streams = [r for r in streams if fits(bench.model, r, args.prompt, args.new)]
    notes += [
        f"{bench.shape} R={r}: skipped, too little device memory" for r in streams if r not in ok
    ]
    run = (bench.model, ok, args.prompt, args.new, bench.reference)
    loop_rows(bench.rows, *run, args.reps)
    if not args.no_hf:
        hf_rows(bench.rows, bench.path, *run)
    if not args.no_torch_ops:
        engine = new_engine(bench.model, None, ok, args.prompt, args.new, args.step_tokens, 1)
        try:
            engine_rows(bench.rows, engine, "engine+torch", *run[1:], 1)
        finally:
            engine.close()
    if bench.model.weights.embed.is_cuda:
        torch.cuda.empty_cache()  # the graphs' pools, before the next shape's


def ours(bench: Bench, rt: Runtime, args: argparse.Namespace) -> None:
    """The engine on the runtime at each of --decode-steps (the first is "ours")."""
    for i, steps in enumerate(args.decode_steps):
        run = (bench.model, rt, bench.streams, args.prompt, args.new, args.step_tokens, steps)
        engine = new_engine(*run)
        try:
            engine_rows(
                bench.rows,
                engine,
                f"{OURS} decode_steps={steps}" if i else OURS,
                bench.streams,
                args.prompt,
                args.new,
                bench.reference,
                args.reps,
            )
        finally:
            engine.close()


def guarded(phase: str, notes: list[str], fn: Callable[[], None]) -> None:
    """Run a phase; an exception becomes a note (the other shapes still run)."""
    try:
        fn()
    except Exception as exc:  # one shape's failure must not lose the others
        notes.append(f"{phase}: {type(exc).__name__}: {exc}")
        print(f"{phase} FAILED: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()


# ---- summary and output -----------------------------------------------------------------------


def shape_summary(rows: list[dict], floor_ms: float | None) -> dict[str, dict]:
    out = {}
    for r in sorted({x["streams"] for x in rows}):
        by = {x["way"].split(" (")[0]: x for x in rows if x["streams"] == r}
        ours, loop = by.get(OURS), by.get("graph loop") or by.get("torch loop")
        s: dict[str, Any] = {"floor_ms": floor_ms}
        if ours:
            s.update(step_ms=ours["step_ms"], tok_s=ours["tokens_per_s"], agree=ours["agree"])
            s.update(host_ms=ours["host_ms_per_step"], wait_ms=ours["wait_ms_per_step"])
            s.update(gap_p99_ms=ours["gap_p99_ms"])
        for way, x in by.items():  # ours at the other --decode-steps
            if way.startswith(f"{OURS} decode_steps="):
                steps = way.rsplit("=", 1)[1]
                s[f"step_ms_decode_steps_{steps}"] = x["step_ms"]
                s[f"host_ms_decode_steps_{steps}"] = x["host_ms_per_step"]
        if loop:
            s.update(
                graph_step_ms=loop["step_ms"],
                graph_tok_s=loop["tokens_per_s"],
                graph_agree=loop["agree"],
            )
        if ours and loop:
            s.update(
                step_over_graph=ours["step_ms"] / loop["step_ms"],
                tok_s_over_graph=ours["tokens_per_s"] / loop["tokens_per_s"],
            )
        for key, way in (("torch_ops_tok_s", "engine+torch"), ("hf_tok_s", "hf generate")):
            if way in by:
                s[key] = by[way]["tokens_per_s"]
        out[f"R{r}"] = s
    return out


def targets(gpt2: dict[str, dict]) -> dict[str, bool]:
    """Issue 13's targets on the gpt2 shape (meaningful on the H200)."""
    steps = [s.get("step_ms", float("inf")) for k, s in gpt2.items() if int(k[1:]) <= 64]
    ratios = [s.get("tok_s_over_graph", 0.0) for k, s in gpt2.items() if k in ("R8", "R32", "R64")]
    return {
        "step_le_0.4ms_every_R_le_64": bool(steps) and max(steps) <= TARGET_STEP_MS,
        "tok_s_ge_1.5x_graph_R8_32_64": bool(ratios) and min(ratios) >= TARGET_OVER_GRAPH,
    }


def show(shape: str, summary: dict[str, dict], graphs: bool) -> str:
    def f(s: dict, key: str, fmt: str) -> str:
        width = int(fmt.rstrip("df").split(".")[0] or 0)
        return format(s[key], fmt) if s.get(key) is not None else "-".rjust(width)

    loop = "torch loop from CUDA graphs" if graphs else "torch loop, eager"
    lines = [
        f"== {shape}: ours = engine+runtime, graph = {loop}; ms per decode step (host, wait:"
        " the engine's step loop a decode step on the host and waiting for the device)",
        "    R | ours ms | host ms | wait ms | graph ms | ms ours/graph | ours tok/s | "
        "graph tok/s | tok/s ours/graph | torch-ops tok/s | hf tok/s | floor ms | agree (graph)",
    ]
    for key, s in summary.items():
        lines.append(
            f"{key[1:]:>5} | {f(s, 'step_ms', '7.3f')} | {f(s, 'host_ms', '7.3f')} | "
            f"{f(s, 'wait_ms', '7.3f')} | {f(s, 'graph_step_ms', '8.3f')} "
            f"| {f(s, 'step_over_graph', '13.2f')} | {f(s, 'tok_s', '10.0f')} | "
            f"{f(s, 'graph_tok_s', '11.0f')} | {f(s, 'tok_s_over_graph', '16.2f')} | "
            f"{f(s, 'torch_ops_tok_s', '15.0f')} | {f(s, 'hf_tok_s', '8.0f')} | "
            f"{f(s, 'floor_ms', '8.3f')} | {f(s, 'agree', '5d')} "
            f"({f(s, 'graph_agree', 'd')})"
        )
    return "\n".join(lines)


def run_info(backend: str) -> dict:
    """Device, driver, torch, commit and date (kernels.py's naming); on the CPU, device 'cpu'."""
    if backend == "cuda":
        return {**describe(), "commit": commit()}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"device": "cpu", "torch": torch.__version__, "commit": head.stdout.strip() or "unknown"}


def write(result: dict, benches: list[Bench], floors: dict[str, float | None], out: Path) -> Path:
    result["rows"] = [{"shape": b.shape, **x} for b in benches for x in b.rows]
    summary = {b.shape: shape_summary(b.rows, floors[b.shape]) for b in benches}
    if "gpt2" in summary:
        summary.update(summary["gpt2"], targets=targets(summary["gpt2"]))
    result["summary"] = summary
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"llm-{slug(result['device'])}-{result['commit']}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--with-256", action="store_true", help="also R=256 where memory allows")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per stream")
    parser.add_argument(
        "--reps",
        type=int,
        default=3,
        help="timed runs of the graph loop and of ours (the median is kept)",
    )
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=EngineConfig.max_step_tokens,
        help="the engine's max_step_tokens (prompts are chunked past it)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        nargs="+",
        default=[EngineConfig.decode_steps],
        help="the engine's decode_steps: the first is ours in the summary, each other one a "
        "row of its own beside it",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    parser.add_argument("--no-torch-ops", action="store_true", help="skip engine+torch")
    blocks_argument(parser)
    args = parser.parse_args()
    args.streams = sorted(set(args.streams) | ({256} if args.with_256 else set()))
    return args


def main() -> None:
    args = parse()
    faulthandler.register(signal.SIGTERM, chain=True)  # an outer timeout shows where it was
    deadline(120)
    check_agreement()
    device = "cuda" if args.backend == "cuda" else "cpu"
    result = {**run_info(args.backend), "prompt": args.prompt, "new": args.new, "notes": []}
    notes: list[str] = result["notes"]
    gbps = copy_bandwidth(5) if device == "cuda" else None  # before the worker exists
    if gbps is not None:
        torch.cuda.empty_cache()  # its 2 GiB
    result["copy_gbps"] = gbps
    if gbps is None:
        notes.append("CPU backend: the torch loop runs eagerly (no CUDA graphs); no floor")
    if not args.no_hf and importlib.util.find_spec("transformers") is None:
        notes.append("transformers does not import: no hf generate rows")
    benches: list[Bench] = []
    floors: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for shape in args.shapes:
            deadline(BASELINE_S)
            where = Path(tmp) / shape
            model = make_model(shape, device, where)
            reference = reference_tokens(model, prompts(1, args.prompt)[0], args.new)
            bench = Bench(shape, where, model, reference, list(args.streams), [])
            benches.append(bench)
            floors[shape] = step_bytes(model) / gbps / 1e6 if gbps else None
            guarded(
                f"{shape} baselines", notes, lambda: baselines(bench, args.streams, args, notes)
            )
            path = write(result, benches, floors, args.out)
        deadline(ENGINE_S)  # the runtime's start (loads or builds its image) included
        cuda = CudaConfig(blocks_per_sm=args.blocks_per_sm)
        with Runtime(config=RuntimeConfig(backend=args.backend, cuda=cuda)) as rt:
            for bench in benches:
                deadline(ENGINE_S)
                guarded(f"{bench.shape} engine+runtime", notes, lambda: ours(bench, rt, args))
                path = write(result, benches, floors, args.out)
    faulthandler.cancel_dump_traceback_later()
    for shape in args.shapes:
        print("\n" + show(shape, result["summary"][shape], gbps is not None))
    print(
        "\n".join(["", *notes, json.dumps(result["summary"].get("targets", {})), f"wrote {path}"])
    )


if __name__ == "__main__":
    main()
