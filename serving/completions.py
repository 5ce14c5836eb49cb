"""OpenAI-compatible completions on the replica's LLM engine: POST /v1/completions and
POST /v1/chat/completions (each with Server-Sent Events streaming ending in `data: [DONE]`),
GET /v1/models and GET /v1/models/{id}.

Chat messages become a prompt through the model's chat template (serving/llm/chat.py); a model
without one answers 400. `logprobs` on /v1/completions (and `logprobs`/`top_logprobs` on chat) are
the log-softmax of the logits each generated token was chosen from: the engine copies those rows
back to the host for such a request (`keep_logits`), where they are scored. `echo` with `logprobs`
scores the prompt with the torch reference forward (`forward_tokens`) beside the engine, one such
request at a time; with `max_tokens: 0` that is all it does (log-likelihoods, as
lm-evaluation-harness asks for them).

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (serving/errors.py),
so the official client raises its usual exceptions (BadRequestError, NotFoundError, ...) with our
message. A request whose logits turned NaN or infinite ends with NonFiniteLogitsError and tells the
swap watch, which rolls back an operator swapped just before.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from gpuos_core import Runtime
from serving.llm import create_tiny_model, forward_tokens, load_model, load_tokenizer
from serving.llm.chat import ChatTemplateError, load_chat_template, message_text
from serving.llm.engine import Delta, Engine, EngineConfig, NonFiniteLogitsError, PromptTooLongError
from serving.llm.sampling import SamplingParams
from serving.llm.tokenizer import load_generation_config

from .config import LlmArgs
from .errors import (
    EngineFailedError,
    ModelNotFoundError,
    UnsupportedParameterError,
    openai_body,
    status_of,
)
from .hotpaths import HotRoute
from .jsonfast import dumps, json_response
from .metrics import LlmMetrics
from .schemas import error_responses
from .watch import SwapWatch

if TYPE_CHECKING:
    from serving.llm.engine import _Stream

log = logging.getLogger("gpuos.serving")
MAX_PROMPTS = 64  # prompts one request may carry (each becomes a choice)
MAX_LOGPROBS = 20  # most alternatives `logprobs` / `top_logprobs` may ask for (OpenAI's limit)
NONFINITE_PREFIX = f"{NonFiniteLogitsError.__name__}: "  # how the engine's deltas name it
DONE = b"data: [DONE]\n\n"  # the last event of every stream
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")  # what the gateway relays


# -- the engine of a replica -----------------------------------------------------------------------
class LlmService:
    """The replica's model, tokenizer, chat template and engine, and the id clients name it by."""

    def __init__(self, args: LlmArgs, runtime: Runtime, state_dir: Path) -> None:
        path = Path(args.model).expanduser() if args.model else self._tiny(args, state_dir)
        self.model_id = args.served_name or path.name
        self.model = load_model(path, dtype=args.dtype, device=str(runtime.device), progress=True)
        self.tokenizer = load_tokenizer(path)
        self.chat_template = load_chat_template(path)
        self.defaults = load_generation_config(path).defaults()  # sampling defaults of the model
        self.engine = Engine(
            self.model,
            self.tokenizer,
            runtime,
            EngineConfig(
                max_running=args.max_running,
                max_len=args.max_len,
                max_waiting=args.max_waiting,
                max_step_tokens=args.max_step_tokens,
                decode_steps=args.decode_steps,
                micro_ops=args.micro_ops,
            ),
        )
        self.created = int(time.time())
        self._scoring = threading.Lock()  # one prompt-scoring forward at a time (its memory)
        log.info(
            "serving model %r from %s (%s; chat template: %s)",
            self.model_id,
            path,
            self.model.config.model_type or self.model.config.family,
            "yes" if self.chat_template else "no",
        )

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

    def check_prompt(self, prompt: list[int]) -> None:
        """PromptTooLongError unless `prompt` is non-empty, in the vocabulary and within the
        model's positions (what scoring it needs; the engine checks its own context)."""
        vocab, limit = self.model.config.vocab_size, self.model.config.max_positions
        if not prompt:
            raise PromptTooLongError("the prompt is empty: send at least one token")
        if bad := [t for t in prompt if not 0 <= t < vocab]:
            raise PromptTooLongError(
                f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})"
            )
        if len(prompt) > limit:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens; the model has {limit} positions"
            )

    def score_prompt(self, prompt: list[int], top: int) -> list[_Scored]:
        """Log-probabilities of prompt tokens 1.. given the ones before (and the `top` likeliest
        alternatives), from one reference forward over the prompt. Blocking: its logits are
        [len(prompt), vocab] fp32 on the model's device while it runs."""
        with self._scoring, torch.inference_mode():
            ids = torch.tensor(prompt, dtype=torch.long, device=self.model.weights.embed.device)
            logits = forward_tokens(self.model, ids)
            return score(logits[:-1], prompt[1:], top)

    def token_text(self, token: int) -> str:
        """A token as logprobs name it: its text, or where that is not whole characters (part of
        a UTF-8 sequence) or empty (a special token), its vocabulary entry (`bytes:\\xNN` for a
        byte), so that different tokens keep different names."""
        text = self.tokenizer.decode([token])
        if text and "\ufffd" not in text:
            return text
        inner = getattr(self.tokenizer, "inner", None)
        name = inner.id_to_token(token) if inner is not None else None
        return str(name) if name else f"bytes:\\x{token:02x}"

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class _Scored:
    """One token's log-probability and the likeliest alternatives [(id, logprob)]."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def score(logits: torch.Tensor, chosen: Sequence[int], top: int) -> list[_Scored]:
    """Log-softmax of each row of `logits` [T, vocab] at its `chosen` id, with the `top` likeliest
    ids of the row (computed where the logits are, then brought to the host)."""
    if not len(chosen):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(chosen), dtype=torch.long, device=logprobs.device)
    picked = logprobs.gather(1, ids[:, None])[:, 0].cpu().tolist()
    if top:
        values, indices = (t.cpu().tolist() for t in logprobs.topk(top, dim=-1))
    else:
        values, indices = [[]] * len(picked), [[]] * len(picked)
    return [_Scored(t, p, list(zip(i, v))) for t, p, i, v in zip(chosen, picked, indices, values)]


# -- request and response bodies -------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with usage (and no choices) before [DONE]


class _Sampled(BaseModel):
    """Parameters both completion routes share. Strict, as OpenAI's API is: a boolean is not a
    number, a number not a string. Ranges are checked once, by SamplingParams (a SamplingError
    names the parameter); a null or absent sampling knob takes the model's generation_config.json
    default, else SamplingParams' (OpenAI's clients may send null)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="extension: keep the k most likely tokens (0: off)")
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    def refuse(self, defaults: dict[str, Any]) -> None:
        """UnsupportedParameterError for the first parameter set to something not implemented
        (`defaults`: name -> the only value accepted, besides null)."""
        for name, default in {
            "n": 1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logit_bias": None,
            **defaults,
        }.items():
            value = getattr(self, name)
            if value not in (default, None):
                raise UnsupportedParameterError(
                    f"{name}={value!r} is not supported by this server; leave it out", name
                )

    def sampling(self, max_tokens: int | None, defaults: dict[str, Any]) -> SamplingParams:
        given = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
        }
        return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    """OpenAI's completion parameters; the unsupported ones are accepted only at their defaults."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, description="0 with `echo`: score the prompt only")
    logprobs: int | None = Field(
        None,
        description=f"0..{MAX_LOGPROBS}: the chosen tokens' "
        "log-probabilities and this many likeliest alternatives",
    )
    echo: bool | None = False
    # Not implemented; refused unless left at OpenAI's default.
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> None:
        """UnsupportedParameterError for the first parameter set to something not implemented."""
        self.refuse({"best_of": 1, "suffix": None})
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise UnsupportedParameterError(
                f"logprobs must be 0..{MAX_LOGPROBS}, got {self.logprobs}", "logprobs"
            )


# Objects of parameters that are refused unless absent (tools, ...): documented as flat objects,
# so that schema-driven clients and fuzzers do not build arbitrarily deep ones.
Refused = Annotated[
    dict[str, Any],
    WithJsonSchema(
        {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}
    ),
]


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are read (others are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; `name` and `tool_call_id` reach the chat template too."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampled):
    """OpenAI's chat completion parameters; the unsupported ones only at their defaults."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, description="default: up to the context")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, description=f"0..{MAX_LOGPROBS}, with logprobs")
    # Not implemented; refused unless left at OpenAI's default.
    tools: list[Refused] | None = None
    tool_choice: str | Refused | None = None
    response_format: Refused | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> None:
        self.refuse({"tools": None, "tool_choice": "none", "parallel_tool_calls": None})
        if self.response_format not in (None, {"type": "text"}):
            raise UnsupportedParameterError(
                "response_format other than text is not supported", "response_format"
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise UnsupportedParameterError(
                f"top_logprobs must be 0..{MAX_LOGPROBS}, got {self.top_logprobs}", "top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedParameterError("top_logprobs needs logprobs: true", "top_logprobs")


def _prompts(prompt: Any, encode: Callable[[str], list[int]]) -> list[tuple[list[int], str | None]]:
    """Token ids of every prompt (a string, strings, a token list, or token lists), each with its
    text when it was given as text."""
    prompts: list[tuple[list[int], str | None]]
    if isinstance(prompt, str):
        prompts = [(encode(prompt), prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [(list(prompt), None)]
    else:
        prompts = [(encode(p), p) if isinstance(p, str) else (list(p), None) for p in prompt]
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise UnsupportedParameterError(
            f"send 1 to {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt"
        )
    return prompts


# -- routes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompletionServices:
    """What the completion routes use of a replica."""

    llm: LlmService | None  # None: the deployment serves no model
    metrics: LlmMetrics  # vLLM-named metrics of finished requests
    watch: SwapWatch  # told about non-finite logits (a swapped operator may be the cause)


def completion_routes(replica: CompletionServices, route_class: type[APIRoute]) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["completions"], route_class=route_class)

    @router.get("/models", responses=error_responses(404, openai=True))
    def models() -> dict[str, Any]:
        """The served model (OpenAI's list shape)."""
        return {"object": "list", "data": [_model_card(_service(replica))]}

    @router.get("/models/{model_id:path}", responses=error_responses(404, openai=True))
    def model(model_id: str) -> dict[str, Any]:
        """The served model, when `model_id` is its id (else 404)."""
        llm = _service(replica)
        _check_model(llm, model_id)
        return _model_card(llm)

    answers = {
        200: {
            "description": "the completion, or Server-Sent Events when `stream` is true",
            "content": {"application/json": {}, "text/event-stream": {}},
        },
        **error_responses(400, 404, 413, 500, 503, openai=True),
    }

    @router.post("/completions", response_model=None, responses=answers)
    async def completions(body: CompletionRequest) -> Response:
        """OpenAI-compatible completions; `stream: true` answers with Server-Sent Events."""
        return await _complete(replica, body)

    @router.post("/chat/completions", response_model=None, responses=answers)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        """OpenAI-compatible chat completions through the model's chat template; `stream: true`
        answers with Server-Sent Events."""
        return await _chat(replica, body)

    return router


def completion_hot_routes(replica: CompletionServices) -> dict[str, HotRoute]:
    """POST /v1/completions and /v1/chat/completions, for HotPaths: the answers their routes
    give."""
    complete, chat = COMPLETION_PATHS
    return {
        complete: HotRoute(CompletionRequest, lambda body, _: _complete(replica, body)),
        chat: HotRoute(ChatCompletionRequest, lambda body, _: _chat(replica, body)),
    }


def _model_card(llm: LlmService) -> dict[str, Any]:
    return {
        "id": llm.model_id,
        "object": "model",
        "created": llm.created,
        "owned_by": "gpuos-serve",
        "max_model_len": llm.engine.max_len,
    }


def _service(replica: CompletionServices) -> LlmService:
    if replica.llm is None:
        raise ModelNotFoundError("this deployment serves no model (app arg llm.enabled is false)")
    return replica.llm


def _check_model(llm: LlmService, model: str) -> None:
    if model != llm.model_id:
        raise ModelNotFoundError(
            f"model {model!r} is not served here; GET /v1/models lists {llm.model_id!r}"
        )


def _respond(body: _Sampled, chunks: AsyncIterator[bytes], whole: Any) -> Response:
    if body.stream:
        return StreamingResponse(chunks, media_type="text/event-stream")
    return json_response(whole)


# -- /v1/completions -------------------------------------------------------------------------------
class _TextLogprobs:
    """OpenAI's completion `logprobs` of one choice, built as its tokens come."""

    def __init__(self, text: Callable[[int], str]) -> None:
        self.text, self.offset = text, 0
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token: int, scored: _Scored | None) -> dict[str, Any]:
        """Append one token (`scored` None: the prompt's first, which nothing predicts); returns
        the part of the object this token adds."""
        text = self.text(token)
        top = None
        if scored is not None:
            top = {self.text(i): lp for i, lp in scored.top}
            top.setdefault(text, scored.logprob)  # the chosen token is always listed (as vLLM)
        part = {
            "tokens": [text],
            "token_logprobs": [scored.logprob if scored else None],
            "top_logprobs": [top],
            "text_offset": [self.offset],
        }
        for name, values in part.items():
            getattr(self, name).extend(values)
        self.offset += len(text)
        return part

    def extend(self, scored: Iterable[_Scored]) -> dict[str, Any]:
        parts: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for s in scored:
            for name, values in self.add(s.token, s).items():
                parts[name].extend(values)
        return parts

    def whole(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@dataclass
class _Choice:
    """One prompt of a /v1/completions request: what it echoes and scores, and its stream."""

    prompt: list[int]
    echo: str = ""
    echo_logprobs: dict[str, Any] | None = None
    logprobs: _TextLogprobs | None = None
    stream: _Stream | None = None
    sent: int = 0  # generated tokens whose logprobs went out


async def _complete(replica: CompletionServices, body: CompletionRequest) -> Response:
    llm = _service(replica)
    _check_model(llm, body.model)
    body.unsupported()
    prompts = _prompts(body.prompt, llm.tokenizer.encode)
    only_echo = body.max_tokens == 0 and bool(body.echo)
    params = None if only_echo else body.sampling(body.max_tokens, llm.defaults)
    text_of = llm.token_text
    choices = [_Choice(ids) for ids, _ in prompts]
    for choice, (ids, text) in zip(choices, prompts):
        llm.check_prompt(ids)
        if body.logprobs is not None:
            choice.logprobs = _TextLogprobs(text_of)
        if body.echo:
            choice.echo = text if text is not None else llm.tokenizer.decode(ids)
    if body.echo and body.logprobs is not None:
        for choice in choices:
            scored = await asyncio.to_thread(llm.score_prompt, choice.prompt, body.logprobs)
            assert choice.logprobs is not None
            first = choice.logprobs.add(choice.prompt[0], None)
            rest = choice.logprobs.extend(scored)
            choice.echo_logprobs = {k: first[k] + rest[k] for k in first}
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": llm.model_id,
    }
    if params is None:
        return _echo_only(body, head, choices)
    loop, keep = asyncio.get_running_loop(), body.logprobs is not None
    started = time.perf_counter()
    submitted = llm.engine.submit_many(
        [c.prompt for c in choices], params, loop, keep, incremental=bool(body.stream)
    )
    for choice, stream in zip(choices, submitted):
        choice.stream = stream
    streams = [c.stream for c in choices if c.stream is not None]
    done = _Reporter(replica, llm.model_id, started)
    top = body.logprobs or 0

    def chunk(index: int, delta: Delta, first: bool) -> dict[str, Any]:
        c = choices[index]
        text = (c.echo if first else "") + delta.text
        logprobs = None
        if c.logprobs is not None:
            logprobs = _new_logprobs(c, delta, top)
            if first and c.echo_logprobs is not None:
                logprobs = {k: c.echo_logprobs[k] + logprobs[k] for k in logprobs}
        return {
            "text": text,
            "index": index,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }

    if body.stream:
        return _respond(body, _sse(head, streams, body.include_usage, done, chunk), None)
    finals = await _whole(streams, done)
    out = []
    for i, (text, last) in enumerate(finals):
        c = choices[i]
        if c.logprobs is not None:
            _new_logprobs(c, last, top)
        out.append(
            {
                "text": c.echo + text,
                "index": i,
                "logprobs": c.logprobs.whole() if c.logprobs is not None else None,
                "finish_reason": last.finish_reason,
            }
        )
    return json_response({**head, "choices": out, "usage": _usage([last for _, last in finals])})


def _new_logprobs(c: _Choice, delta: Delta, top: int) -> dict[str, Any]:
    """The logprobs of the generated tokens up to `delta`'s that were not sent yet."""
    assert c.stream is not None and c.stream.logits is not None and c.logprobs is not None
    upto = delta.completion_tokens
    rows, ids = c.stream.logits[c.sent : upto], c.stream.tokens[c.sent : upto]
    c.sent = max(c.sent, upto)
    return c.logprobs.extend(score(torch.stack(rows), ids, top) if rows else [])


def _echo_only(body: CompletionRequest, head: dict[str, Any], choices: list[_Choice]) -> Response:
    """max_tokens 0 with echo: the prompts (and their logprobs), nothing generated."""
    out = [
        {"text": c.echo, "index": i, "logprobs": c.echo_logprobs, "finish_reason": "length"}
        for i, c in enumerate(choices)
    ]
    prompt_tokens = sum(len(c.prompt) for c in choices)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}

    async def events() -> AsyncIterator[bytes]:
        for choice in out:
            yield _event({**head, "choices": [choice]})
        if body.include_usage:
            yield _event({**head, "choices": [], "usage": usage})
        yield DONE

    return _respond(body, events(), {**head, "choices": out, "usage": usage})


# -- /v1/chat/completions --------------------------------------------------------------------------
async def _chat(replica: CompletionServices, body: ChatCompletionRequest) -> Response:
    llm = _service(replica)
    _check_model(llm, body.model)
    body.unsupported()
    if llm.chat_template is None:
        raise UnsupportedParameterError(
            f"model {llm.model_id!r} has no chat template (no "
            "chat_template in its tokenizer_config.json, nor a "
            "chat_template.jinja): use /v1/completions",
            "messages",
        )
    messages = [
        {
            **m.model_dump(exclude_none=True),
            "content": message_text(
                [p.model_dump() for p in m.content] if isinstance(m.content, list) else m.content
            ),
        }
        for m in body.messages
    ]
    try:
        text = llm.chat_template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise UnsupportedParameterError(str(exc), "messages") from None
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    llm.check_prompt(prompt)
    limit = body.max_completion_tokens or body.max_tokens
    room = llm.engine.max_len - len(prompt)
    params = body.sampling(limit if limit is not None else max(room, 1), llm.defaults)
    keep = bool(body.logprobs)
    top = body.top_logprobs or 0
    started = time.perf_counter()
    stream = llm.engine.submit(
        prompt, params, asyncio.get_running_loop(), keep, incremental=bool(body.stream)
    )
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": llm.model_id,
    }
    done = _Reporter(replica, llm.model_id, started)
    sent = 0

    def logprobs(upto: int) -> dict[str, Any] | None:
        nonlocal sent
        if not keep or stream.logits is None:
            return None
        rows, ids = stream.logits[sent:upto], stream.tokens[sent:upto]
        sent = max(sent, upto)
        scored = score(torch.stack(rows), ids, top) if rows else []
        return {"content": [_chat_logprob(llm, s) for s in scored]}

    if body.stream:

        def chunk(index: int, delta: Delta, first: bool) -> dict[str, Any]:
            message = (
                {"role": "assistant", "content": delta.text}
                if first
                else ({"content": delta.text} if delta.text or delta.finish_reason is None else {})
            )
            return {
                "index": index,
                "delta": message,
                "logprobs": logprobs(delta.completion_tokens),
                "finish_reason": delta.finish_reason,
            }

        head = {**head, "object": "chat.completion.chunk"}
        return _respond(body, _sse(head, [stream], body.include_usage, done, chunk), None)
    ((answer, last),) = await _whole([stream], done)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": answer},
        "logprobs": logprobs(last.completion_tokens),
        "finish_reason": last.finish_reason,
    }
    return json_response(
        {**head, "object": "chat.completion", "choices": [choice], "usage": _usage([last])}
    )


def _chat_logprob(llm: LlmService, scored: _Scored) -> dict[str, Any]:
    """One token of chat's `logprobs.content`."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = llm.tokenizer.decode([token])
        return {
            "token": llm.token_text(token),
            "logprob": logprob,
            "bytes": list(text.encode("utf-8")),
        }

    return {
        **entry(scored.token, scored.logprob),
        "top_logprobs": [entry(i, lp) for i, lp in scored.top],
    }


# -- shared by both routes -------------------------------------------------------------------------
class _Reporter:
    """What a request's finished choices tell the replica: metrics, and the swap watch about
    non-finite logits."""

    def __init__(self, replica: CompletionServices, model: str, started: float) -> None:
        self.replica, self.model, self.started = replica, model, started

    def finished(self, stream: Any, last: Delta) -> None:
        """Record one finished choice: its latencies and tokens, or its error."""
        if last.error is None:
            self.replica.metrics.finished(
                self.model,
                self.started,
                stream.token_times,
                time.perf_counter(),
                last.prompt_tokens,
                last.finish_reason or "stop",
            )

    def failure(self, last: Delta) -> Exception:
        """The exception a choice's error delta stands for (the engine's text stays in the log:
        its messages may quote torch)."""
        assert last.error is not None
        if last.error.startswith(NONFINITE_PREFIX):
            reason = last.error.removeprefix(NONFINITE_PREFIX)
            suspects = self.replica.watch.nonfinite_logits(f"completion logits: {reason}")
            then = (
                f"; rolling back {', '.join(suspects)} (swapped just before): retry"
                if suspects
                else ""
            )
            return NonFiniteLogitsError(
                f"the model produced NaN or infinite logits ({reason}){then}"
            )
        log.error("completion failed in the engine: %s", last.error)
        kind = last.error.partition(":")[0] if ":" in last.error else "error"
        return EngineFailedError(
            f"the engine failed while generating ({kind}); the replica's log has the details"
        )


async def _whole(streams: Sequence[_Stream], done: _Reporter) -> list[tuple[str, Delta]]:
    """Every choice's text and last delta once all finished (raises the first one's error)."""
    try:
        if len(streams) == 1:  # most requests: no task for the gather
            finals = [await _collect(streams[0])]
        else:
            finals = list(await asyncio.gather(*(_collect(s) for s in streams)))
    finally:
        for s in streams:
            s.cancel()  # no-op when finished; frees the slot when the client went away
    for stream, (_, last) in zip(streams, finals):
        done.finished(stream, last)
    for _, last in finals:
        if last.error:
            raise done.failure(last)
    return list(finals)


async def _collect(stream: _Stream) -> tuple[str, Delta]:
    parts = [d async for d in stream]
    return "".join(d.text for d in parts), parts[-1]


Chunk = Callable[[int, Delta, bool], dict[str, Any]]  # (choice index, delta, first) -> choice


async def _sse(
    head: dict[str, Any],
    streams: Sequence[_Stream],
    include_usage: bool,
    done: _Reporter,
    chunk: Chunk,
) -> AsyncIterator[bytes]:
    """Chunks of every choice as they come (each choice as `chunk` renders it), then usage (if
    asked), then [DONE]."""
    finals: list[Delta] = []
    seen: set[int] = set()
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
            yield _event({**head, "choices": [chunk(index, delta, index not in seen)]})
            seen.add(index)
        if include_usage and len(finals) == len(streams):
            yield _event({**head, "choices": [], "usage": _usage(finals)})
        yield DONE
    finally:
        for s in streams:
            s.cancel()


async def _merged(streams: Sequence[_Stream]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream, in arrival order."""
    if len(streams) == 1:  # most requests: no pump task and no queue hop per delta
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def pump(index: int, stream: _Stream) -> None:
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


def _usage(finals: Iterable[Delta]) -> dict[str, int]:
    finals = list(finals)
    prompt = sum(d.prompt_tokens for d in finals)
    completion = sum(d.completion_tokens for d in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"
