"""Continuous-batching decode engine (docs/DESIGN.md, Serving → LLM engine).

One thread runs steps. A step reads as three calls:

    step = self._schedule()        # admit waiting requests into free KV slots; each running request
                                   # brings a span of new rows (its prompt, in chunks, then 1 token)
    run = self._launch(step)       # the model's forward (forward.py) and sampling over the spans:
                                   # one device program on the runtime (device_step.py), or torch
    self._collect(previous, ...)   # the previous step's tokens (on the runtime, steps chain on the
                                   # device: this step was queued behind that one, and its rows
                                   # take that step's tokens there), or this step's with torch,
                                   # and their text while the device runs (detokenize, stop
                                   # strings, stream out, free finished slots)

So on the runtime the host schedules step k + 1 while step k runs, and a request's next row is
scheduled before its last token is known (vLLM's asynchronous scheduling): a request that eos
or a stop string ends may run a row or two more, whose tokens are dropped; max_tokens and the
context are counted ahead and never overrun. With `decode_steps` above 1, while every running
request only decodes and none waits or arrived since the last step, one program runs that many
steps back to back (vLLM's multi-step; device_step.py), so the host's per-step work is done once
for that many tokens of each request (each request's row runs as many of them as its max_tokens
and context leave); the tokens a request chose past an eos or a stop string in such a step are
dropped too.

Requests join and leave at step boundaries. Memory is bounded: a fixed pool of KV slots; requests
wait in a bounded queue for a free slot (EngineFullError beyond it). `micro_ops="torch"` runs the
same forward eagerly with torch instead (the benchmark's baseline and the reference).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import numpy as np
import torch

from gpuos_core import Runtime
from gpuos_core.errors import GpuosError
from gpuos_core.program import Arena
from gpuos_core.sampler import rng_at, rng_keys, sample_rows
from gpuos_core.threads import daemon
from serving.llm.device_step import (
    Launched,
    Layout,
    StepChain,
    StepProgram,
    StepResult,
    StepWork,
    fed,
    fusable,
)
from serving.llm.forward import Span, TorchOps, forward
from serving.llm.model import KVPool, Model, rotary_tables
from serving.llm.sampling import SamplingParams, StopMatcher
from serving.llm.tokenizer import TextStream, Tokenizer

log = logging.getLogger("gpuos.llm")
STEP_THREAD = "gpuos-llm-engine"  # the thread that runs an engine's steps
MicroOps = Literal["runtime", "torch"]


class EngineFullError(GpuosError):
    """The engine's waiting queue is full: retry after a moment."""


class PromptTooLongError(GpuosError, ValueError):
    """A prompt (or prompt + max_tokens) does not fit the engine's context."""


class KVMemoryError(GpuosError):
    """The KV pool (max_running slots of max_len tokens) does not fit in the device's memory."""


class EngineClosedError(GpuosError):
    """The engine was closed: no new requests, unfinished ones are failed."""


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine (the `llm:` block of the app's args)."""

    max_running: int = 64  # KV slots: requests decoded together
    max_len: int | None = None  # tokens one slot holds (prompt + completion); None: model's limit
    max_waiting: int = 256  # requests queued for a slot beyond this are refused
    # New rows one step may take: bounds a step behind a long prompt. 2,048 as vLLM's scheduler
    # default (its API server takes 8,192 on an H100 or H200): on the H200 one GPT-2 step of 64
    # prompts of 32 took 3.6 ms of device time where four of 16 took 7.1 (bench/NOTES.md, s310).
    max_step_tokens: int = 2048
    # Decode steps one program runs back to back while every running request only decodes (and
    # one of them has that many tokens left) and no request waits or arrived since the last
    # step: the host's work a step (~5 µs a request) once for that many tokens. A request that
    # arrives meanwhile starts after the program, and the tokens of a stream arrive that many
    # at a time (its last ones up to that many steps late). Runtime micro-ops only. Off by
    # default: on the H200, 4 cut a 64-stream GPT-2 step 45% where the host's CPU was slow and
    # changed nothing where it kept up; the completions load test gained 11% tokens/s at
    # 64-token completions (TTFT p50 +11 ms) and lost 4% at 16 (bench/NOTES.md, s210).
    decode_steps: int = 1
    micro_ops: MicroOps = "runtime"  # "torch": launch each micro-op with torch (the baseline)


class Delta(NamedTuple):
    """A piece of one request's output, as streamed. A tuple: the engine makes one a token of
    every stream, and a frozen dataclass takes twice as long to make (bench/NOTES.md, the step
    loop's host time)."""

    text: str  # new text (may be empty on the final delta)
    finish_reason: str | None  # None while generating; "stop" or "length" on the last delta
    prompt_tokens: int
    completion_tokens: int  # generated so far
    error: str | None = None  # set (with finish_reason "error") when the engine failed


class _Outbox:
    """Deltas on their way from the engine thread to consumers on event loops, handed over once a
    step per loop. Each handover (`call_soon_threadsafe`) writes to the loop's self-pipe, a
    system call that lets the GIL go; the engine thread then waits for the GIL until the loop's
    thread next lets go of it, up to the interpreter's switch interval (5 ms by default, 1 ms in a
    replica: AppArgs.switch_interval_ms) when that thread is busy serving other requests. A
    handover per delta cost the step that wait once per streaming request. Used by the engine
    thread only."""

    def __init__(self) -> None:
        self._held: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delta], Delta]]] = {}

    def add(
        self, loop: asyncio.AbstractEventLoop, deltas: asyncio.Queue[Delta], delta: Delta
    ) -> None:
        self._held.setdefault(loop, []).append((deltas, delta))

    def flush(self) -> None:
        """Hand every held delta to its loop, in the order they were added."""
        held, self._held = self._held, {}
        for loop, items in held.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: its consumers are gone
                log.debug("dropped %d deltas for a closed event loop", len(items))


def _deliver(items: list[tuple[asyncio.Queue[Delta], Delta]]) -> None:
    for deltas, delta in items:
        deltas.put_nowait(delta)


class _Stream:
    """Deltas of one request, handed from the engine thread to a thread, or to an event loop
    through the engine's outbox."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        outbox: _Outbox,
        on_cancel: Callable[[], None],
        keep_logits: bool = False,
        incremental: bool = True,
    ) -> None:
        """`on_cancel` runs on the consumer's thread when it cancels (tells the engine to look).
        `incremental` False: the text is held and handed over whole with the last delta (a
        consumer that only joins the pieces then wakes once, not once a token)."""
        self.cancelled = False  # set by the consumer (client gone): the engine drops the request
        self._on_cancel = on_cancel
        self._held: list[str] | None = None if incremental else []
        # The logits [vocab] (fp32, CPU) each token was chosen from, when asked for (checks).
        self.logits: list[torch.Tensor] | None = [] if keep_logits else None
        self.tokens: list[int] = []  # ids generated so far (the engine thread appends)
        self.token_times: list[float] = []  # time.perf_counter() when each was chosen
        # The consumer's event loop and the queue it reads (async), or None: a thread reads _sync.
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Delta]] | None = (
            (loop, asyncio.Queue()) if loop else None
        )
        self._sync: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._outbox = outbox

    def put(self, delta: Delta) -> None:
        if self._held is not None:
            if delta.finish_reason is None:
                self._held.append(delta.text)
                return
            delta = delta._replace(text="".join(self._held) + delta.text)
        if self._async is not None:
            self._outbox.add(*self._async, delta)
        else:
            self._sync.put(delta)

    def __iter__(self) -> Iterator[Delta]:
        while (delta := self._sync.get()).finish_reason is None:
            yield delta
        yield delta

    def cancel(self) -> None:
        """Stop generating (the consumer went away); the engine frees the slot next step."""
        self.cancelled = True
        self._on_cancel()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        assert self._async is not None, "submitted without a loop: iterate it in a thread"
        _, deltas = self._async
        while (delta := await deltas.get()).finish_reason is None:
            yield delta
        yield delta


@dataclass(eq=False)
class _Request:
    """A request the engine holds: waiting for a slot, then running."""

    prompt: list[int]
    params: SamplingParams
    stream: _Stream
    detok: TextStream
    stops: StopMatcher
    seed: int  # Philox key of its draws (with the token's index as counter)
    limit: int  # tokens it may generate: max_tokens, or fewer where the context ends first
    sampling: tuple[float, float, float]  # (temperature, top_p, top_k): sample_tokens' row
    slot: int = -1  # KV slot while running
    queued: int = 0  # tokens whose keys/values the steps launched so far store in the slot
    inflight: int = 0  # tokens launched steps choose for it that were not collected yet
    feed: int = -1  # while inflight: the logits row of its next token in the latest step
    finished: bool = False  # its last delta was sent: later tokens are dropped

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    @property
    def generated(self) -> list[int]:
        """Its tokens collected so far (its stream's)."""
        return self.stream.tokens

    def room(self) -> int:
        """Tokens it may still choose, those in flight counted: what its limit leaves. (An eos
        needs no look here: `_collect` ends its request as it takes it.)"""
        return self.limit - len(self.stream.tokens) - self.inflight

    def pending_tokens(self) -> list[int]:
        """Tokens to feed next: the prompt (rest) first, then the last generated token, or the
        one the latest step is choosing (`fed`: taken on the device). No copy of the whole
        sequence: this runs for every request every step."""
        if self.inflight:  # that step fed every token before it
            return [fed(self.feed)]
        if self.queued < len(self.prompt):
            return self.prompt[self.queued :] + self.generated
        return self.generated[self.queued - len(self.prompt) :]


@dataclass(frozen=True)
class _Step:
    """The step boundary: which requests run and the span of rows each brings."""

    requests: tuple[_Request, ...]
    spans: tuple[Span, ...]  # per request, in order
    chooses: tuple[bool, ...]  # per request: its span ends with its last pending row (the step
    # chooses its next token; a prompt chunk before the last does not)
    takes: tuple[int, ...]  # per request: the decode steps its row runs back to back (one
    # unless every span is one decode row; then as many of the step's as its room allows)

    def work(self, sampling: _SamplingRows) -> StepWork:
        """What the forward runs: the spans and their runs; sample_tokens' params (float32) and
        rng (int32) rows, [requests, 3] each, a request's draw depending on its seed and its
        token's index only, never on its batch; and the logits when a stream keeps them.
        Called before the step is launched, while `inflight` counts the tokens chosen before
        this one; `sampling` keeps the rows that do not change from step to step."""
        requests = self.requests
        rows = sampling.of(requests)
        draws = [len(r.stream.tokens) + r.inflight for r in requests]
        rng = rng_at(rows.keys, draws)
        return StepWork(self.spans, self.takes, rows.params, rng, rows.keep)


class _SamplingRows:
    """sample_tokens' params, the rng rows' keys, and whether a stream keeps its logits, of the
    requests last asked for: fixed when each is submitted, so kept while the same requests run
    in the same order (every decode step of a steady batch), where a step then makes only its
    draws' counters (made anew, they took ~50 µs of a slow host's 64-request step). Used by the
    engine thread only."""

    def __init__(self) -> None:
        self.requests: tuple[_Request, ...] = ()
        self.params = np.zeros((0, 3), dtype=np.float32)
        self.keys = rng_keys([])
        self.keep = False

    def of(self, requests: tuple[_Request, ...]) -> _SamplingRows:
        """These rows for `requests` (made when they are not the last ones asked for)."""
        if requests != self.requests:  # each compared by identity (eq=False): 64 take ~2 µs
            rows = itertools.chain.from_iterable(r.sampling for r in requests)
            self.params = np.fromiter(rows, np.float32, 3 * len(requests)).reshape(-1, 3)
            self.keys = rng_keys([r.seed for r in requests])
            self.keep = any(r.stream.logits is not None for r in requests)
            self.requests = requests
        return self


class NonFiniteLogitsError(GpuosError):
    """A step's logits for this request held NaN or infinity (an operator produced them): the
    request ends with this error rather than a meaningless token."""


class _Forward(Protocol):
    """How an engine runs a step's forward and sampling."""

    chains: bool  # steps chain on the device: spans may hold `fed` tokens of the latest step
    steps: int  # decode steps a step of decode rows only may run back to back
    built: int  # step programs built so far ...
    build_s: float  # ... and the seconds they took (the steps they were built for waited)

    def start(self, work: StepWork) -> Launched:
        """Start the step (its runs at most `self.steps`); its result waits for the tokens (and,
        when asked, logits) of each span's last row, a run each."""
        ...

    def resync(self) -> None:
        """After a failed step: wait for the steps launched, and chain the next from there."""
        ...


class _TorchForward:
    """The forward in torch, one launch per micro-op (micro_ops="torch": the baseline); a step
    is done when `start` returns."""

    chains, steps, built, build_s = False, 1, 0, 0.0  # a step at a time; nothing to build

    def __init__(self, model: Model, kv: KVPool) -> None:
        self.model, self.kv = model, kv

    def start(self, work: StepWork) -> Launched:
        assert work.steps == 1, "the torch forward runs a step at a time"
        logits = forward(self.model, TorchOps(self.model.config, self.kv, work.spans))
        params, rng = (torch.from_numpy(a).to(logits.device) for a in (work.params, work.rng))
        done = StepResult(
            sample_rows(logits, params, rng)[:, None].tolist(),
            logits.isfinite().all(-1, keepdim=True).tolist(),
            logits[:, None].cpu() if work.keep_logits else None,
        )
        return Launched(list(range(len(work.spans))), lambda: done)

    def resync(self) -> None:
        pass  # nothing runs after start returns


class _ProgramForward:
    """The forward as one device program on the runtime per layout of spans, parity and set of
    activations fused into their up projections (device_step.fusable: it changes when the GELU
    operator is swapped or rolled back): decode layouts built at start and kept, others on first
    use (the last PROGRAMS kept); steps chain on the device (device_step.StepChain). The
    programs of a parity share their activations' memory (an Arena), so a program kept costs
    its records and its linears' split-K workspaces."""

    # Step programs of layouts with prefill rows kept (by layout and parity; the least recently
    # used is dropped; decode-only ones are all kept, a few per fused set): 64 slots under the
    # H200 completions load test met 41 with 128 kept, but rebuilt 98-144 times in 30 s with 64
    # kept, and a build holds every stream (~0.1 s for GPT-2 small there); when the decode
    # programs of several steps counted among the 128, 159-167 builds in 25 s against 74-87
    # (s173). Each costs its records and its linears' and attention's split-K workspaces: for
    # GPT-2 small at most the ~57 MB measured when its K = 768 linears were split (2.3 GB for
    # the 41, ~7 GB for 128); unsplit, its linears' share at 64 rows is ~14 MB.
    PROGRAMS = 128
    chains = True

    def __init__(
        self,
        runtime: Runtime,
        model: Model,
        kv: KVPool,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        step_tokens: int,
        steps: int,
    ) -> None:
        """`step_tokens`: the most tokens a step takes (EngineConfig.max_step_tokens); `steps`:
        the decode steps a program may run back to back (EngineConfig.decode_steps)."""
        self.runtime, self.model, self.kv, self.rotary = runtime, model, kv, rotary
        self.steps = steps
        picks = Layout.most_picks(kv.slots, step_tokens)
        self.chain = StepChain(picks, steps, runtime.device)
        self._programs: OrderedDict[tuple[Layout, int, frozenset[str]], StepProgram] = OrderedDict()
        self._arenas = (Arena(runtime.device), Arena(runtime.device))  # per parity
        self._last: Launched | None = None
        self.built, self.build_s = 0, 0.0
        # device_step.fusable of the operator table last seen: a table is immutable, and a swap
        # or rollback publishes a new one, so a step only compares identities
        self._fused = (runtime.table, fusable(runtime.table))
        # Decode-only steps' programs, built now: a request joining would otherwise hold every
        # stream for two whole-program builds (a parity each), as vLLM captures its CUDA graphs
        # per batch size at start.
        for layout in Layout.decoding(kv.slots, steps):
            for parity in (0, 1):
                self._program(layout, parity)

    def start(self, work: StepWork) -> Launched:
        layout = Layout.of(work.spans, self.kv.slots, work.steps)
        program = self._program(layout, self.chain.parity)
        self._last = program.start(self.runtime, work, 60, self.chain.next())
        return self._last

    def resync(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            try:
                last.result()
            except Exception:  # noqa: BLE001 - it failed already; only its end matters here
                log.warning("the step before a resync failed too", exc_info=True)
        self.chain.resync()

    def _program(self, layout: Layout, parity: int) -> StepProgram:
        table = self.runtime.table
        if table is not self._fused[0]:
            self._fused = (table, fusable(table))
        fused = self._fused[1]
        key = (layout, parity, fused)
        if key in self._programs:
            self._programs.move_to_end(key)
            return self._programs[key]
        began = time.perf_counter()
        program = StepProgram(
            self.runtime,
            self.model,
            self.kv,
            layout,
            self.rotary,
            self.chain,
            parity,
            self._arenas[parity],
            fused,
        )
        self.built, self.build_s = self.built + 1, self.build_s + time.perf_counter() - began
        self._programs[key] = program
        prefill = [k for k in self._programs if k[0].groups]  # least recently used first
        if len(prefill) > self.PROGRAMS:
            del self._programs[prefill[0]]
        return program


class Engine:
    """Continuous-batching generation over one model: each step one device program on a runtime
    (or the same forward in torch)."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        runtime: Runtime | None,
        config: EngineConfig | None = None,
    ) -> None:
        """`runtime` may be None only with micro_ops="torch" (ValueError otherwise)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config or EngineConfig()
        if self.config.micro_ops == "runtime" and runtime is None:
            raise ValueError("micro_ops='runtime' needs a runtime")
        self.max_len = min(
            self.config.max_len or model.config.max_positions, model.config.max_positions
        )
        self.kv = self._allocate_kv()
        self._free = list(range(self.config.max_running))  # a heap: the lowest slot goes first,
        # which keeps decode rows (one per slot up to the highest in use) few
        self._forward: _Forward = (
            _TorchForward(model, self.kv)
            if runtime is None or self.config.micro_ops == "torch"
            else _ProgramForward(
                runtime,
                model,
                self.kv,
                rotary_tables(model, self.max_len),
                self.config.max_step_tokens,
                self.config.decode_steps,
            )
        )
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._outbox = _Outbox()  # deltas for event loops, handed over after each step
        self._sampling = _SamplingRows()  # the sampling rows of the last step's requests
        self._inflight: tuple[_Step, Launched] | None = None  # launched, not collected (chained)
        self._lock = threading.Condition()
        self._closed = False
        self._cancels = False  # a stream was cancelled since the last look: _schedule looks
        self._arrived = False  # a request was queued since the last look: one step at a time
        # steps run (a program of several counts each), programs launched, tokens generated
        self.steps = self.launches = self.tokens = 0
        # Seconds of the step loop on the host and blocked on a launched step's tokens: a
        # replica whose waits shrink towards nothing is bound by its host, not its device.
        self.host_s = self.wait_s = 0.0
        self._thread = daemon(self._loop, STEP_THREAD)

    def _allocate_kv(self) -> KVPool:
        """KVMemoryError, saying which settings to lower, when the pool does not fit."""
        c, w, slots = self.model.config, self.model.weights.embed, self.config.max_running
        try:
            return KVPool.allocate(c, slots, self.max_len, w.dtype, w.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError, or the CPU allocator's refusal
            need = 2 * math.prod(KVPool.shape(c, slots, self.max_len)) * w.element_size()
            raise KVMemoryError(
                f"the KV pool of {slots} slots of {self.max_len} tokens needs "
                f"{need / 2**30:.2f} GiB on {w.device}, which could not be allocated: lower "
                f"llm.max_running or llm.max_len ({str(exc).splitlines()[0]})"
            ) from exc

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
        keep_logits: bool = False,
        incremental: bool = True,
    ) -> _Stream:
        """Queue a request; its deltas arrive on the returned stream (iterate it, or `async for`
        when `loop` is the caller's event loop); with `incremental` False, one delta at the end
        holds the whole text. Raises PromptTooLongError, EngineFullError."""
        return self.submit_many([prompt], params, loop, keep_logits, incremental)[0]

    def submit_many(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
        keep_logits: bool = False,
        incremental: bool = True,
    ) -> list[_Stream]:
        """Queue requests together, all or none (the choices of one API request, a benchmark's
        batch): the next step admits them at once, as far as slots allow, rather than as they
        trickle in. Raises as `submit` does, before queueing any."""
        for prompt in prompts:
            self._check_fits(prompt)
        sampling = params.temperature, params.top_p, float(params.top_k)
        requests = [
            _Request(
                list(prompt),
                params,
                _Stream(loop, self._outbox, self._cancelled, keep_logits, incremental),
                self.tokenizer.detokenizer(),
                StopMatcher(params.stop),
                secrets.randbits(64) if params.seed is None else params.seed,
                min(params.max_tokens, self.max_len - len(prompt)),
                sampling,
            )
            for prompt in prompts
        ]
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if len(self._waiting) + len(requests) > self.config.max_waiting:
                raise EngineFullError(
                    f"{len(self._waiting)} requests already wait for the engine (at most "
                    f"{self.config.max_waiting}); {len(requests)} more do not fit: retry later"
                )
            self._waiting.extend(requests)
            self._arrived = True
            self._lock.notify()
        return [r.stream for r in requests]

    def generate(self, prompt: list[int], params: SamplingParams) -> tuple[str, Delta]:
        """Blocking convenience: the whole completion text and its last delta."""
        (last,) = self.submit(prompt, params, incremental=False)
        return last.text, last

    def _cancelled(self) -> None:
        # A plain store, safe from any thread: the engine looks at every request once it is set
        # instead of asking each of them every step.
        self._cancels = True

    def _check_fits(self, prompt: list[int]) -> None:
        """PromptTooLongError unless the prompt is non-empty, in the vocabulary and leaves room."""
        if not prompt:
            raise PromptTooLongError("the prompt is empty: send at least one token")
        if bad := [t for t in prompt if not 0 <= t < self.model.config.vocab_size]:
            raise PromptTooLongError(
                f"token ids {bad[:5]} are outside the vocabulary "
                f"(0..{self.model.config.vocab_size - 1})"
            )
        if len(prompt) + 1 > self.max_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens; this engine's context "
                f"holds {self.max_len} (prompt + completion)"
            )

    def stats(self) -> dict[str, int]:
        """Requests running and waiting now; steps, step programs launched (one may run several
        steps), tokens, step programs built and the milliseconds building them took, and the
        step loop's milliseconds on the host and waiting for the device, so far."""
        with self._lock:
            return {
                "running": len(self._running),
                "waiting": len(self._waiting),
                "steps": self.steps,
                "launches": self.launches,
                "tokens": self.tokens,
                "programs": self._forward.built,
                "program_build_ms": round(1000 * self._forward.build_s),
                "step_host_ms": round(1000 * self.host_s),
                "step_wait_ms": round(1000 * self.wait_s),
            }

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
                self._inflight = None
                self._fail(self._running, f"{type(exc).__name__}: {exc}")
                self._forward.resync()
            self._outbox.flush()
        self._fail(self._running + list(self._waiting), "the engine was closed")
        self._outbox.flush()

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not (self._closed or self._running or self._waiting or self._inflight):
                self._lock.wait()
            return not self._closed

    def step(self) -> None:
        """One step: admit, start the spans' rows on the device, take the tokens of the
        previous step (chained on the device) or of this one (torch), stream their text."""
        began, waited = time.perf_counter(), 0.0
        step = self._schedule()
        launched = (step, self._launch(step)) if step is not None else None
        done = launched
        if self._forward.chains:
            done, self._inflight = self._inflight, launched
        if done is not None:
            waiting = time.perf_counter()
            out = done[1].result()
            waited = time.perf_counter() - waiting
            self._collect(done[0], out)
            self.steps += max(done[0].takes)
        self.wait_s += waited
        self.host_s += time.perf_counter() - began - waited

    def _schedule(self) -> _Step | None:
        """Admit waiting requests into free slots, drop cancelled ones, take every running
        request's pending rows (at most max_step_tokens in all, prompts chunked); run the step
        `_forward.steps` times where each request brings one decode row and one has that many
        tokens left, each request's row as many times as its room allows, while no request
        waits or arrived since the last step (arrivals would wait behind the steps, and each
        new prefill layout costs a program build)."""
        if self._cancels:
            self._cancels = False  # before looking: a cancel from now on is seen next step
            with self._lock:  # submit appends to _waiting from other threads
                gone = [r for r in self._running + list(self._waiting) if r.cancelled]
            for r in gone:
                self._finish(r, "", "cancelled")
        with self._lock:
            while self._waiting and self._free:
                request = self._waiting.popleft()
                request.slot = heapq.heappop(self._free)
                self._running.append(request)
            quiet = not (self._waiting or self._arrived)
            self._arrived = False
        budget, requests, spans, chooses = self.config.max_step_tokens, [], [], []
        decoding = True
        for r in self._running:
            if budget <= 0:
                break
            if r.room() <= 0:
                continue  # ends at a _collect to come
            pending = r.pending_tokens()
            take = pending[:budget]
            requests.append(r)
            spans.append(Span(r.slot, r.queued, tuple(take)))
            chooses.append(len(take) == len(pending))
            budget -= len(take)
            decoding = decoding and len(pending) == 1
        if not requests:
            self._sampling = _SamplingRows()  # holds no ended request while nothing runs
            return None
        takes = self._takes(requests, decoding and quiet)
        return _Step(tuple(requests), tuple(spans), tuple(chooses), takes)

    def _takes(self, requests: list[_Request], several: bool) -> tuple[int, ...]:
        """The decode steps each request's row runs: one each (a scheduled request has room
        for one), unless the forward runs several, the step may (`several`: every request
        brings one decode row, none waits or arrived) and one has room for all of them; then as
        many as each one's room allows."""
        steps = self._forward.steps
        if steps > 1 and several:
            rooms = [r.room() for r in requests]
            if max(rooms) >= steps:
                return tuple(min(steps, room) for room in rooms)
        return (1,) * len(requests)

    # -- the forward ---------------------------------------------------------------------------
    def _launch(self, step: _Step) -> Launched:
        """Start the step; its result waits for the tokens (and, when a stream keeps them,
        logits) of each span's last row, a sub-step each. The requests count its rows as queued
        and the tokens it chooses as in flight."""
        launched = self._forward.start(step.work(self._sampling))
        self.launches += 1
        each = zip(step.requests, step.spans, step.chooses, step.takes, launched.picks)
        for r, span, chooses, take, pick in each:
            r.queued += len(span.tokens) + take - 1  # a decode row's later runs: one row each
            if chooses:
                r.inflight, r.feed = r.inflight + take, pick
        return launched

    # -- sampling and output -------------------------------------------------------------------
    def _collect(self, step: _Step, out: StepResult) -> None:
        """Take the step's tokens and stream their text: requests that fed their last pending
        row get one a sub-step, each streamed as it is taken, up to one that ends the request
        (those after it ran for nothing); non-finite logits end their request there, after the
        text of the tokens before them."""
        now, eos = time.perf_counter(), self.tokenizer.eos_ids
        each = zip(step.requests, step.chooses, step.takes, out.tokens, out.finite)
        for i, (r, chooses, take, tokens, finite) in enumerate(each):
            if not chooses:
                continue  # a prompt chunk
            r.inflight -= take
            stream = r.stream
            for j, token in enumerate(tokens):
                if r.finished:  # ended meanwhile, or by the token before this one
                    break
                if not finite[j]:
                    self._finish(
                        r,
                        "",
                        "error",
                        f"{NonFiniteLogitsError.__name__}: the logits of "
                        f"token {len(r.generated)} hold NaN or infinity (an operator the "
                        "model uses produced them)",
                    )
                    break
                if out.logits is not None and stream.logits is not None:
                    stream.logits.append(out.logits[i, j])
                stream.tokens.append(token)
                stream.token_times.append(now)
                self._advance(r, token, eos)

    def _advance(self, r: _Request, token: int, eos: frozenset[int]) -> None:
        """Stream the text of `token`, its last token collected; end it where that token does
        (`eos`: the tokenizer's; a stop string; its limit)."""
        self.tokens += 1
        if token in eos:
            self._finish(r, r.stops.flush(), "stop")
            return
        text, stopped = r.stops.feed(r.detok.push(token))
        count = len(r.stream.tokens)
        if stopped:
            self._finish(r, text, "stop")
        elif count >= r.limit:
            self._finish(r, text + r.stops.flush(), "length")
        elif text:
            r.stream.put(Delta(text, None, len(r.prompt), count))

    def _finish(self, r: _Request, text: str, reason: str, error: str | None = None) -> None:
        """Send the last delta and give the request's slot back (or take it off the queue)."""
        r.finished = True
        r.stream.put(Delta(text, reason, len(r.prompt), len(r.generated), error))
        with self._lock:
            if r in self._running:
                self._running.remove(r)
                heapq.heappush(self._free, r.slot)
            elif r in self._waiting:
                self._waiting.remove(r)

    def _fail(self, requests: Sequence[_Request], message: str) -> None:
        for r in list(requests):
            self._finish(r, "", "error", message)
