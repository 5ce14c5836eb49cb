"""OpenAI-compatible text completions on the replica's LLM engine: POST /v1/completions (with
Server-Sent Events streaming ending in `data: [DONE]`) and GET /v1/models.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the official client
raises its usual exceptions (BadRequestError, NotFoundError, ...) with our message.
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

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gpuos_core import Runtime
from serving.llm import create_tiny_model, load_model, load_tokenizer
from serving.llm.engine import Delta, Engine, EngineConfig
from serving.llm.sampling import SamplingParams

from .config import LlmArgs
from .errors import EXPECTED, RETRY_AFTER_S, ServingError, status_of

if TYPE_CHECKING:
    from .app import GpuosIngress

log = logging.getLogger("gpuos.serving")
MAX_PROMPTS = 64  # prompts one request may carry (each becomes a choice)


class ModelNotFoundError(ServingError):
    """The request names a model this deployment does not serve (HTTP 404)."""


class EngineFailedError(ServingError):
    """The engine failed while generating (HTTP 500; the replica keeps serving)."""


class UnsupportedParameterError(ServingError, ValueError):
    """An OpenAI parameter this server does not implement, set to a non-default value (400)."""

    def __init__(self, message: str, param: str) -> None:
        self.param = param
        super().__init__(message)


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
    include_usage: bool = False  # a last chunk with usage (and no choices) before [DONE]


class CompletionRequest(BaseModel):
    """OpenAI's completion parameters; the unsupported ones are accepted only at their defaults."""

    model_config = ConfigDict(extra="forbid")

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
def completion_routes(replica: "GpuosIngress") -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["completions"])

    @router.get("/models")
    def models() -> dict[str, Any]:
        """The served model (OpenAI's list shape)."""
        llm = _service(replica)
        return {"object": "list", "data": [{"id": llm.model_id, "object": "model",
                                            "created": llm.created, "owned_by": "gpuos-serve"}]}

    @router.post("/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """OpenAI-compatible completions; `stream: true` answers with Server-Sent Events."""
        try:
            return await _complete(replica, request)
        except (*EXPECTED, json.JSONDecodeError) as exc:
            return openai_error(exc, replica)

    return router


def _service(replica: "GpuosIngress") -> LlmService:
    if replica.llm is None:
        raise ModelNotFoundError("this deployment serves no model (app arg llm.enabled is false)")
    return replica.llm


async def _complete(replica: "GpuosIngress", request: Request) -> Response:
    llm = _service(replica)
    body = CompletionRequest.model_validate(json.loads(await request.body() or b"null"))
    if body.model != llm.model_id:
        raise ModelNotFoundError(f"model {body.model!r} is not served here; GET /v1/models lists "
                                 f"{llm.model_id!r}")
    body.unsupported()
    params, prompts = body.sampling(), _prompts(body.prompt, llm.tokenizer.encode)
    loop = asyncio.get_running_loop()
    streams = [llm.engine.submit(p, params, loop) for p in prompts]
    replica.metrics.completion(len(prompts), body.stream)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": llm.model_id}
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(replica, head, streams, usage),
                                 media_type="text/event-stream")
    return JSONResponse(await _whole(replica, head, streams))


async def _whole(replica: "GpuosIngress", head: dict[str, Any], streams: list) -> dict[str, Any]:
    """The non-streaming answer: every choice's text once all finished."""
    try:
        finals = await asyncio.gather(*(_collect(s) for s in streams))
    finally:
        for s in streams:
            s.cancel()  # no-op when finished; frees the slot when the client went away
    for _, last in finals:
        if last.error:
            raise EngineFailedError(last.error)
    choices = [_choice(i, text, last.finish_reason) for i, (text, last) in enumerate(finals)]
    replica.metrics.generated(sum(last.completion_tokens for _, last in finals))
    return {**head, "choices": choices, "usage": _usage([last for _, last in finals])}


async def _collect(stream: Any) -> tuple[str, Delta]:
    parts = [d async for d in stream]
    return "".join(d.text for d in parts), parts[-1]


async def _sse(replica: "GpuosIngress", head: dict[str, Any], streams: list,
               include_usage: bool) -> AsyncIterator[str]:
    """Chunks of every choice as they come, then usage (if asked), then [DONE]."""
    finals: list[Delta] = []
    started, first = time.perf_counter(), True
    try:
        async for index, delta in _merged(streams):
            if first:
                replica.metrics.first_token(time.perf_counter() - started)
                first = False
            if delta.error:
                yield _event({"error": _error_fields(EngineFailedError(delta.error), 500)})
                break
            if delta.finish_reason is not None:
                finals.append(delta)
            yield _event({**head, "choices": [_choice(index, delta.text, delta.finish_reason)]})
        if include_usage and len(finals) == len(streams):
            yield _event({**head, "choices": [], "usage": _usage(finals)})
        replica.metrics.generated(sum(d.completion_tokens for d in finals))
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


# -- OpenAI error shape ----------------------------------------------------------------------------
def openai_error(exc: BaseException, replica: "GpuosIngress") -> JSONResponse:
    """`exc` as OpenAI's error body: 400 for bad JSON or parameters, 404 unknown model, 503 busy."""
    status = 400 if isinstance(exc, (json.JSONDecodeError, pydantic.ValidationError)) else (
        status_of(exc) or 500)
    replica.metrics.error(type(exc).__name__, status)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}
    return JSONResponse({"error": _error_fields(exc, status)}, status_code=status, headers=headers)


def _error_fields(exc: BaseException, status: int) -> dict[str, Any]:
    message, param = str(exc), getattr(exc, "param", None)
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
    kind = ("invalid_request_error" if status < 500 else
            "server_busy" if status == 503 else "server_error")
    return {"message": message, "type": kind, "param": param,
            "code": "model_not_found" if isinstance(exc, ModelNotFoundError) else None}
