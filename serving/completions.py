"""OpenAI-compatible text completions on the replica's LLM engine: POST /v1/completions (with
Server-Sent Events streaming ending in `data: [DONE]`) and GET /v1/models.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (serving/errors.py),
so the official client raises its usual exceptions (BadRequestError, NotFoundError, ...) with our
message. A request whose logits turned NaN or infinite ends with NonFiniteLogitsError and tells the
swap watch, which rolls back an operator swapped just before.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from gpuos_core import Runtime
from serving.llm import create_tiny_model, load_model, load_tokenizer
from serving.llm.engine import Delta, Engine, EngineConfig, NonFiniteLogitsError
from serving.llm.sampling import SamplingParams

from .config import LlmArgs
from .errors import (EngineFailedError, ModelNotFoundError, UnsupportedParameterError, openai_body,
                     status_of)
from .schemas import error_responses

if TYPE_CHECKING:
    from .app import GpuosIngress

log = logging.getLogger("gpuos.serving")
MAX_PROMPTS = 64  # prompts one request may carry (each becomes a choice)
NONFINITE_PREFIX = f"{NonFiniteLogitsError.__name__}: "  # how the engine's deltas name it


# -- the engine of a replica -----------------------------------------------------------------------
class LlmService:
    """The replica's model, tokenizer and engine, and the id clients name it by."""

    def __init__(self, args: LlmArgs, runtime: Runtime, state_dir: Path) -> None:
        path = Path(args.model).expanduser() if args.model else self._tiny(args, state_dir)
        self.model_id = args.served_name or path.name
        model = load_model(path, dtype=args.dtype, device=str(runtime.device))
        self.tokenizer = load_tokenizer(path)
        self.engine = Engine(model, self.tokenizer, runtime, EngineConfig(
            max_running=args.max_running, max_len=args.max_len, max_waiting=args.max_waiting,
            max_step_tokens=args.max_step_tokens, micro_ops=args.micro_ops))
        self.created = int(time.time())
        log.info("serving model %r from %s (%s)", self.model_id, path, model.config.family)

    @staticmethod
    def _tiny(args: LlmArgs, state_dir: Path) -> Path:
        """The seeded tiny model: created once under the state dir, then loaded like any other.
        Made aside and renamed into place, as replicas starting together may race for it."""
        path = state_dir / "models" / f"tiny-{args.tiny_family}"
        if not (path / "config.json").exists():
            scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            create_tiny_model(scratch, args.tiny_family, seed=0)
            try:
                scratch.rename(path)
            except OSError:  # another replica's copy (the same seeded weights) is already there
                shutil.rmtree(scratch)
        return path

    def close(self) -> None:
        self.engine.close()


# -- request and response bodies -------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with usage (and no choices) before [DONE]


class CompletionRequest(BaseModel):
    """OpenAI's completion parameters; the unsupported ones are accepted only at their defaults.
    Strict, as OpenAI's API is: a boolean is not a number, a number not a string."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    # Ranges are checked once, by SamplingParams (a SamplingError names the parameter).
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int = Field(0, description="extension: keep the k most likely tokens (0: off)")
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Not implemented; refused unless left at OpenAI's default.
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> None:
        """UnsupportedParameterError for the first parameter set to something not implemented."""
        defaults = {"n": 1, "logprobs": None, "echo": False, "best_of": None, "suffix": None,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value not in (default, None) and not (name == "best_of" and value == 1):
                raise UnsupportedParameterError(
                    f"{name}={value!r} is not supported by this server; leave it out", name)

    def sampling(self) -> SamplingParams:
        """The engine's sampling parameters; a null or absent one takes SamplingParams' default
        (OpenAI's clients may send null). SamplingError names a bad one."""
        given = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                 "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop}
        return SamplingParams(**{k: v for k, v in given.items() if v is not None})


def _prompts(prompt: Any, encode: Any) -> list[list[int]]:
    """Token ids of every prompt: a string, strings, a token list, or token lists."""
    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise UnsupportedParameterError(f"send 1 to {MAX_PROMPTS} prompts, got {len(prompts)}",
                                        "prompt")
    return prompts


# -- routes ----------------------------------------------------------------------------------------
def completion_routes(replica: "GpuosIngress", route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["completions"], route_class=route_class)

    @router.get("/models", responses=error_responses(404, openai=True))
    def models() -> dict[str, Any]:
        """The served model (OpenAI's list shape)."""
        llm = _service(replica)
        return {"object": "list", "data": [{"id": llm.model_id, "object": "model",
                                            "created": llm.created, "owned_by": "gpuos-serve"}]}

    @router.post("/completions", response_model=None, responses={
        200: {"description": "the completion, or Server-Sent Events when `stream` is true",
              "content": {"application/json": {}, "text/event-stream": {}}},
        **error_responses(400, 404, 413, 500, 503, openai=True)})
    async def completions(body: CompletionRequest) -> Response:
        """OpenAI-compatible completions; `stream: true` answers with Server-Sent Events."""
        return await _complete(replica, body)

    return router


def _service(replica: "GpuosIngress") -> LlmService:
    if replica.llm is None:
        raise ModelNotFoundError("this deployment serves no model (app arg llm.enabled is false)")
    return replica.llm


async def _complete(replica: "GpuosIngress", body: CompletionRequest) -> Response:
    llm = _service(replica)
    if body.model != llm.model_id:
        raise ModelNotFoundError(f"model {body.model!r} is not served here; GET /v1/models lists "
                                 f"{llm.model_id!r}")
    body.unsupported()
    params, prompts = body.sampling(), _prompts(body.prompt, llm.tokenizer.encode)
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    streams = [llm.engine.submit(p, params, loop) for p in prompts]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": llm.model_id}
    done = _Reporter(replica, llm.model_id, started)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(head, streams, usage, done),
                                 media_type="text/event-stream")
    return JSONResponse(await _whole(head, streams, done))


class _Reporter:
    """What a request's finished choices tell the replica: metrics, and the swap watch about
    non-finite logits."""

    def __init__(self, replica: "GpuosIngress", model: str, started: float) -> None:
        self.replica, self.model, self.started = replica, model, started

    def finished(self, stream: Any, last: Delta) -> None:
        """Record one finished choice: its latencies and tokens, or its error."""
        if last.error is None:
            self.replica.metrics.llm.finished(self.model, self.started, stream.token_times,
                                              time.perf_counter(), last.prompt_tokens,
                                              last.finish_reason or "stop")

    def failure(self, last: Delta) -> Exception:
        """The exception a choice's error delta stands for (the engine's text stays in the log:
        its messages may quote torch)."""
        assert last.error is not None
        if last.error.startswith(NONFINITE_PREFIX):
            reason = last.error.removeprefix(NONFINITE_PREFIX)
            suspects = self.replica.watch.nonfinite_logits(f"completion logits: {reason}")
            then = (f"; rolling back {', '.join(suspects)} (swapped just before): retry"
                    if suspects else "")
            return NonFiniteLogitsError(f"the model produced NaN or infinite logits "
                                        f"({reason}){then}")
        log.error("completion failed in the engine: %s", last.error)
        kind = last.error.partition(":")[0] if ":" in last.error else "error"
        return EngineFailedError(f"the engine failed while generating ({kind}); the replica's "
                                 "log has the details")


async def _whole(head: dict[str, Any], streams: list, done: _Reporter) -> dict[str, Any]:
    """The non-streaming answer: every choice's text once all finished."""
    try:
        finals = await asyncio.gather(*(_collect(s) for s in streams))
    finally:
        for s in streams:
            s.cancel()  # no-op when finished; frees the slot when the client went away
    for stream, (_, last) in zip(streams, finals):
        done.finished(stream, last)
    for _, last in finals:
        if last.error:
            raise done.failure(last)
    choices = [_choice(i, text, last.finish_reason) for i, (text, last) in enumerate(finals)]
    return {**head, "choices": choices, "usage": _usage([last for _, last in finals])}


async def _collect(stream: Any) -> tuple[str, Delta]:
    parts = [d async for d in stream]
    return "".join(d.text for d in parts), parts[-1]


async def _sse(head: dict[str, Any], streams: list, include_usage: bool, done: _Reporter
               ) -> AsyncIterator[str]:
    """Chunks of every choice as they come, then usage (if asked), then [DONE]."""
    finals: list[Delta] = []
    try:
        async for index, delta in _merged(streams):
            if delta.finish_reason is not None:
                done.finished(streams[index], delta)
            if delta.error:
                failure = done.failure(delta)
                yield _event(openai_body(failure, status_of(failure)))
                break
            if delta.finish_reason is not None:
                finals.append(delta)
            yield _event({**head, "choices": [_choice(index, delta.text, delta.finish_reason)]})
        if include_usage and len(finals) == len(streams):
            yield _event({**head, "choices": [], "usage": _usage(finals)})
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.cancel()


async def _merged(streams: list) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream, in arrival order."""
    queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(index: int, stream: Any) -> None:
        async for delta in stream:
            await queue.put((index, delta))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    unfinished = len(streams)
    try:
        while unfinished:
            item = await queue.get()
            unfinished -= item[1].finish_reason is not None
            yield item
    finally:
        for task in tasks:
            task.cancel()


def _choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}


def _usage(finals: Iterable[Delta]) -> dict[str, int]:
    finals = list(finals)
    prompt = sum(d.prompt_tokens for d in finals)
    completion = sum(d.completion_tokens for d in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
