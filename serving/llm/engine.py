"""Continuous-batching decode engine (DESIGN.md, Serving → LLM engine).

One thread runs steps. A step reads as three calls:

    rows = self._schedule()        # admit waiting requests into free KV slots; each running request
                                   # brings its new rows (its prompt on its first step, then 1 token)
    logits = self._forward(rows)   # matmuls on the stacked rows with torch; each stage of a layer's
                                   # ragged micro-ops (norm, rotary, per-request attention, residual,
                                   # activation) is one submission to the runtime
    self._scatter(rows, logits)    # sample (softmax on the runtime), detokenize, stop, stream out

Requests join and leave at step boundaries. Memory is bounded: a fixed pool of KV slots; requests
wait in a bounded queue for a free slot (EngineFullError beyond it). `micro_ops="torch"` runs the same
engine launching each micro-op with torch instead (the benchmark's baseline).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from gpuos_core import OpCall, Runtime
from gpuos_core.catalogue import CATALOGUE, run_reference
from gpuos_core.errors import GpuosError
from serving.llm.model import LayerWeights, Model, Norm, rotary_cos_sin
from serving.llm.sampling import (Detokenizer, SamplingParams, StopMatcher, choose_tokens,
                                  make_generator)
from serving.llm.tokenizer import Tokenizer

log = logging.getLogger("gpuos.llm")
MicroOps = Literal["runtime", "torch"]


class EngineFullError(GpuosError):
    """The engine's waiting queue is full: retry after a moment."""


class PromptTooLongError(GpuosError, ValueError):
    """A prompt (or prompt + max_tokens) does not fit the engine's context."""


class EngineClosedError(GpuosError):
    """The engine was closed: no new requests, unfinished ones are failed."""


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (the `llm:` block of the app's args)."""

    max_running: int = 16         # KV slots: requests decoded together
    max_len: int | None = None    # tokens one slot holds (prompt + completion); None: model's limit
    max_waiting: int = 256        # requests queued for a slot beyond this are refused
    max_step_tokens: int = 512    # new rows one step may take (bounds a step behind a long prompt)
    micro_ops: MicroOps = "runtime"  # "torch": launch each micro-op with torch (the baseline)


@dataclass(frozen=True)
class Delta:
    """A piece of one request's output, as streamed."""

    text: str                     # new text (may be empty on the final delta)
    finish_reason: str | None     # None while generating; "stop" or "length" on the last delta
    prompt_tokens: int
    completion_tokens: int        # generated so far
    error: str | None = None      # set (with finish_reason "error") when the engine failed


class _Stream:
    """Deltas of one request, handed from the engine thread to a thread or an event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, keep_logits: bool = False) -> None:
        self.cancelled = False  # set by the consumer (client gone): the engine drops the request
        # The logits [vocab] (fp32, CPU) each token was chosen from, when asked for (checks).
        self.logits: list[torch.Tensor] | None = [] if keep_logits else None
        self.tokens: list[int] = []  # ids generated so far (the engine thread appends)
        self.token_times: list[float] = []  # time.perf_counter() when each was chosen
        self._loop = loop
        self._async: asyncio.Queue[Delta] | None = asyncio.Queue() if loop else None
        self._sync: queue.SimpleQueue[Delta] = queue.SimpleQueue()

    def put(self, delta: Delta) -> None:
        if self._async is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, delta)
        else:
            self._sync.put(delta)

    def __iter__(self) -> Iterator[Delta]:
        while (delta := self._sync.get()).finish_reason is None:
            yield delta
        yield delta

    def cancel(self) -> None:
        """Stop generating (the consumer went away); the engine frees the slot next step."""
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[Delta]:
        assert self._async is not None
        while (delta := await self._async.get()).finish_reason is None:
            yield delta
        yield delta


@dataclass(eq=False)
class _Request:
    """A request the engine holds: waiting for a slot, then running."""

    prompt: list[int]
    params: SamplingParams
    stream: _Stream
    detok: Detokenizer
    stops: StopMatcher
    generator: torch.Generator
    generated: list[int] = field(default_factory=list)
    slot: int = -1                # KV slot while running
    cached: int = 0               # tokens whose keys/values are in the slot

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    @property
    def length(self) -> int:
        """Tokens of the sequence so far: prompt and generated."""
        return len(self.prompt) + len(self.generated)

    def pending_tokens(self) -> list[int]:
        """Tokens to feed next: the prompt (rest) first, then the last generated token."""
        return (self.prompt + self.generated)[self.cached:]


@dataclass(frozen=True)
class _Rows:
    """The stacked rows of one step."""

    requests: tuple[_Request, ...]
    tokens: torch.Tensor          # [N] token of each row
    positions: torch.Tensor       # [N] its position in its request
    slots: torch.Tensor           # [N] its request's KV slot
    spans: tuple[tuple[int, int], ...]  # per request: first row, number of rows
    last: torch.Tensor            # [R] row index of each request's last row (its logits)


class KVPool:
    """Keys and values of every slot: [layers, slots, kv_heads, max_len, head_dim] each."""

    def __init__(self, model: Model, slots: int, max_len: int) -> None:
        c, w = model.config, model.weights.embed
        shape = (c.layers, slots, c.kv_heads, max_len, c.head_dim)
        self.keys = torch.empty(shape, dtype=w.dtype, device=w.device)
        self.values = torch.empty(shape, dtype=w.dtype, device=w.device)
        self._free = list(range(slots))[::-1]

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, layer: int, rows: _Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each row's k, v [N, kv_heads, head_dim] at its slot and position."""
        self.keys[layer, rows.slots, :, rows.positions] = k
        self.values[layer, rows.slots, :, rows.positions] = v


class Engine:
    """Continuous-batching generation over one model, its micro-ops on a runtime (or torch)."""

    def __init__(self, model: Model, tokenizer: Tokenizer, runtime: Runtime | None,
                 config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config or EngineConfig()
        if self.config.micro_ops == "runtime" and runtime is None:
            raise ValueError("micro_ops='runtime' needs a runtime")
        self.runtime = runtime
        self.max_len = min(self.config.max_len or model.config.max_positions,
                           model.config.max_positions)
        self.kv = KVPool(model, self.config.max_running, self.max_len)
        self._cos, self._sin = self._rotary_tables()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._lock = threading.Condition()
        self._closed = False
        self.steps = self.tokens = 0    # steps run, tokens generated (for /v1/stats)
        self._thread = threading.Thread(target=self._loop, name="gpuos-llm-engine", daemon=True)
        self._thread.start()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None, keep_logits: bool = False) -> _Stream:
        """Queue a request; its deltas arrive on the returned stream (iterate it, or `async for`
        when `loop` is the caller's event loop). Raises PromptTooLongError, EngineFullError."""
        self._check_fits(prompt)
        stream = _Stream(loop, keep_logits)
        request = _Request(list(prompt), params, stream, Detokenizer(self.tokenizer),
                           StopMatcher(params.stop), make_generator(params.seed))
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if len(self._waiting) >= self.config.max_waiting:
                raise EngineFullError(f"{len(self._waiting)} requests already wait for the engine; "
                                      "retry later")
            self._waiting.append(request)
            self._lock.notify()
        return stream

    def generate(self, prompt: list[int], params: SamplingParams) -> tuple[str, Delta]:
        """Blocking convenience: the whole completion text and its last delta."""
        deltas = list(self.submit(prompt, params))
        return "".join(d.text for d in deltas), deltas[-1]

    def _check_fits(self, prompt: list[int]) -> None:
        """PromptTooLongError unless the prompt is non-empty, in the vocabulary and leaves room."""
        if not prompt:
            raise PromptTooLongError("the prompt is empty: send at least one token")
        if bad := [t for t in prompt if not 0 <= t < self.model.config.vocab_size]:
            raise PromptTooLongError(f"token ids {bad[:5]} are outside the vocabulary "
                                     f"(0..{self.model.config.vocab_size - 1})")
        if len(prompt) + 1 > self.max_len:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; this engine's context "
                                     f"holds {self.max_len} (prompt + completion)")

    def stats(self) -> dict[str, int]:
        """Requests running and waiting now; steps and tokens so far."""
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "steps": self.steps, "tokens": self.tokens}

    def close(self) -> None:
        """Stop the step thread; requests not finished get an error delta."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # -- the step loop -------------------------------------------------------------------------
    @torch.inference_mode()  # no autograd bookkeeping for the engine's tensors
    def _loop(self) -> None:
        while self._wait_for_work():
            try:
                self.step()
            except Exception as exc:  # fail what ran in this step; the engine keeps serving
                log.exception("LLM step failed")
                self._fail(self._running, f"{type(exc).__name__}: {exc}")
        self._fail(self._running + list(self._waiting), "the engine was closed")

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._closed and not self._running and not self._waiting:
                self._lock.wait()
            return not self._closed

    def step(self) -> None:
        """One step: admit, forward the new rows, sample and stream."""
        rows = self._schedule()
        if rows is None:
            return
        logits = self._forward(rows)
        self._scatter(rows, logits)
        self.steps += 1

    def _schedule(self) -> _Rows | None:
        """Admit waiting requests into free slots, drop cancelled ones, stack every running
        request's pending rows (at most max_step_tokens, prompts chunked)."""
        with self._lock:  # submit appends to _waiting from other threads
            gone = [r for r in self._running + list(self._waiting) if r.cancelled]
        for r in gone:
            self._finish(r, "", "cancelled")
        with self._lock:
            while self._waiting and (slot := self.kv.acquire()) is not None:
                request = self._waiting.popleft()
                request.slot = slot
                self._running.append(request)
        budget, picked, tokens, spans = self.config.max_step_tokens, [], [], []
        for r in self._running:
            if budget <= 0:
                break
            take = r.pending_tokens()[:budget]
            spans.append((len(tokens), len(take)))
            picked.append(r)
            tokens += take
            budget -= len(take)
        if not picked:
            return None
        return self._rows(picked, tokens, spans)

    def _rows(self, picked: list[_Request], tokens: list[int],
              spans: list[tuple[int, int]]) -> _Rows:
        device = self.kv.keys.device
        positions = [r.cached + t for r, (_, n) in zip(picked, spans) for t in range(n)]
        slots = [r.slot for r, (_, n) in zip(picked, spans) for _ in range(n)]
        last = [first + n - 1 for first, n in spans]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return _Rows(tuple(picked), as_tensor(tokens), as_tensor(positions), as_tensor(slots),
                     tuple(spans), as_tensor(last))

    # -- forward -------------------------------------------------------------------------------
    def _forward(self, rows: _Rows) -> torch.Tensor:
        """Logits [R, vocab] (fp32) at each request's last row; keys/values stored in the pool."""
        x = self.model.embed(rows.tokens, rows.positions)
        for i, layer in enumerate(self.model.weights.layers):
            x = self._block(i, layer, x, rows)
        h = self._norm(x[rows.last], self.model.weights.final_norm)
        return F.linear(h, self.model.weights.lm_head).float()

    def _block(self, i: int, layer: LayerWeights, x: torch.Tensor, rows: _Rows) -> torch.Tensor:
        c = self.model.config
        q, k, v = self._qkv(layer, self._norm(x, layer.attn_norm), rows)
        self.kv.write(i, rows, k, v)
        attn = self._attend(i, q, rows)
        x = self._run([OpCall("add", (x, layer.o(attn.view(x.shape[0], -1))))])[0]
        h = layer.up(self._norm(x, layer.mlp_norm))
        if c.activation == "silu_glu":
            act = OpCall("swiglu", tuple(h.chunk(2, dim=-1)))
        else:
            act = OpCall("gelu_tanh" if c.activation == "gelu_tanh" else "gelu", (h,))
        a = self._run([act])[0]
        return self._run([OpCall("add", (x, layer.down(a)))])[0]

    def _qkv(self, layer: LayerWeights, h: torch.Tensor,
             rows: _Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, heads, d], k, v [N, kv_heads, d]; rotary (one submission for q and k)."""
        c = self.model.config
        sizes = [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim]
        q, k, v = (t.view(h.shape[0], -1, c.head_dim) for t in layer.qkv(h).split(sizes, -1))
        if self._cos is None:
            return q, k, v
        cos, sin = self._cos[rows.positions][:, None], self._sin[rows.positions][:, None]
        q, k = self._run([OpCall("rotary", (q, cos, sin)), OpCall("rotary", (k, cos, sin))])
        return q, k, v

    def _attend(self, layer: int, q: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """Causal attention of every row over its own request's cached keys: one attention-decode
        task per row (its query heads grouped by kv head), all rows in one submission."""
        c = self.model.config
        group = c.heads // c.kv_heads
        out = torch.empty_like(q)
        keys, values = self.kv.keys[layer], self.kv.values[layer]
        calls = []
        for r, (first, n) in zip(rows.requests, rows.spans):
            for t in range(n):
                length = r.cached + t + 1
                kv = (keys[r.slot, :, :length, None].transpose(1, 2),
                      values[r.slot, :, :length, None].transpose(1, 2))
                calls.append(OpCall("attention_decode",
                                    (q[first + t].view(c.kv_heads, group, c.head_dim), *kv),
                                    out=out[first + t].view(c.kv_heads, group, c.head_dim)))
        self._run(calls)
        return out

    def _norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        eps = {"eps": self.model.config.norm_eps}
        if norm.bias is not None:
            return self._run([OpCall("layernorm", (x, norm.weight, norm.bias), scalars=eps)])[0]
        return self._run([OpCall("rmsnorm", (x, norm.weight), scalars=eps)])[0]

    def _run(self, calls: Sequence[OpCall]) -> list[torch.Tensor]:
        """One stage: independent micro-ops, as one runtime submission (or torch launches)."""
        if self.config.micro_ops == "torch":
            return [_into(call, run_reference(CATALOGUE[call.op], call)) for call in calls]
        batch = self.runtime.submit([self.runtime.prepare(call) for call in calls])
        return batch.wait(60).results()

    def _rotary_tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos and sin [max_len, head_dim / 2] in the model's dtype (None without rotary)."""
        c, w = self.model.config, self.model.weights.embed
        if c.rope_theta is None:
            return None, None
        cos, sin = rotary_cos_sin(torch.arange(self.max_len, device=w.device), c.head_dim,
                                  c.rope_theta)
        half = c.head_dim // 2
        return cos[:, :half].to(w.dtype).contiguous(), sin[:, :half].to(w.dtype).contiguous()

    # -- sampling and output -------------------------------------------------------------------
    def _scatter(self, rows: _Rows, logits: torch.Tensor) -> None:
        """Advance every request of the step: those that fed their last pending row get a token."""
        ready = [i for i, (r, (_, n)) in enumerate(zip(rows.requests, rows.spans))
                 if r.cached + n == r.length]
        for r, (_, n) in zip(rows.requests, rows.spans):
            r.cached += n
        if not ready:
            return
        requests = [rows.requests[i] for i in ready]
        chosen = self._sample(logits[ready], requests)
        for i, (r, token) in enumerate(zip(requests, chosen)):
            if r.stream.logits is not None:
                r.stream.logits.append(logits[ready[i]].cpu())
            self._advance(r, token)

    def _sample(self, logits: torch.Tensor, requests: list[_Request]) -> list[int]:
        """Next token of each request; the sampling softmax runs as micro-ops."""
        params = [r.params for r in requests]
        probs = None
        if any(p.temperature > 0 for p in params):
            inv = torch.tensor([1 / p.temperature if p.temperature > 0 else 1.0 for p in params],
                               device=logits.device)
            scaled = self._run([OpCall("mul", (logits, inv[:, None]))])[0]
            probs = self._run([OpCall("softmax", (scaled,))])[0]
        return choose_tokens(logits, probs, params, [r.generator for r in requests])

    def _advance(self, r: _Request, token: int) -> None:
        r.generated.append(token)
        r.stream.tokens.append(token)
        r.stream.token_times.append(time.perf_counter())
        self.tokens += 1
        if token == self.tokenizer.eos_id:
            self._finish(r, r.stops.flush(), "stop")
            return
        text, stopped = r.stops.feed(r.detok.push(token))
        if stopped:
            self._finish(r, text, "stop")
        elif len(r.generated) >= r.params.max_tokens or r.length >= self.max_len:
            self._finish(r, text + r.stops.flush(), "length")
        elif text:
            r.stream.put(Delta(text, None, len(r.prompt), len(r.generated)))

    def _finish(self, r: _Request, text: str, reason: str, error: str | None = None) -> None:
        """Send the last delta and give the request's slot back (or take it off the queue)."""
        r.stream.put(Delta(text, reason, len(r.prompt), len(r.generated), error))
        with self._lock:
            if r in self._running:
                self._running.remove(r)
                self.kv.release(r.slot)
            elif r in self._waiting:
                self._waiting.remove(r)

    def _fail(self, requests: Sequence[_Request], message: str) -> None:
        for r in list(requests):
            self._finish(r, "", "error", message)


def _into(call: OpCall, value: torch.Tensor) -> torch.Tensor:
    """A torch-computed micro-op's result, written to the call's `out` when it names one."""
    if call.out is None:
        return value
    return call.out.copy_(value)
