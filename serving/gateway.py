"""The completions gateway: where a completion's HTTP connection ends, so that the replica making
it may die without the client noticing.

deployments/llm.yaml routes /v1/completions and /v1/chat/completions to two small applications of
`CompletionsGateway` (no GPU, no model). Each hands the request to a replica of the main app over
a relay channel (serving/channel.py; the replica runs it through its own HTTP routes,
serving/relay.py) and streams the answer back. If that replica dies (a crash, a kill, a device
fault) before the answer ended, the gateway sends the request again, to another replica or to the
one Serve starts in its place, for up to `resume_timeout_s`:
- an answer not yet begun is simply asked again;
- a stream already begun is replayed, and the gateway drops, choice by choice, the events the
  client already has, checking that their text is the same, then forwards the rest; the client sees
  one unbroken stream with one id. A replay reproduces the text because a completion's tokens
  depend only on its prompt, its parameters and its seed, never on its batch; the gateway gives
  every request without a seed one (a sampled request's draws are then repeatable, as if the
  client had sent it). Should a replay differ all the same, the stream ends with an error event.
Completions compute and change nothing, so sending one twice is safe.

The other routes (/v1/ops, /admin, /v1/models, /metrics) reach the replicas directly, as before: a
request in flight on a dying replica is replayed by HAProxy (loadtest/launch.py's retry-on), and
the gateway would only add a hop to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve import Application
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from .channel import Channel, ChannelGone
from .errors import (
    EngineFailedError,
    ReplicaLostError,
    error_response,
    openai_body,
    status_of,
)
from .relay import Headers, RelayHead, RelayRequest, header, no_disconnect
from .routes import BodyLimit

__all__ = ["CompletionsGateway", "GatewayArgs", "Splice", "build_gateway", "with_seed"]
log = logging.getLogger("gpuos.serving")
# The replica went away (its connection ended, its actor died or is unreachable) or none is
# there yet: ask again.
GONE = (ChannelGone, RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
REFRESH_S = 5.0  # how often the gateway asks for the replicas' channels (new ones share load)
ASK_TIMEOUT_S = 10.0  # for the replicas' answers to that
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade"}
HISTORY_BYTES = 1 << 20  # events of an answer kept unread at most (see Splice)
INLINE_BYTES = 65536  # bodies up to this are seeded on the event loop, larger ones in a thread
BACKOFF_S = (0.05, 0.1, 0.25, 0.5, 1.0)  # between attempts; the last one repeats


class GatewayArgs(BaseModel):
    """The `args:` of a gateway application."""

    model_config = ConfigDict(extra="forbid")

    app: str = "gpuos"  # the application whose replicas answer
    deployment: str = "GpuosIngress"  # its deployment that serves the completion routes
    resume_timeout_s: float = Field(120.0, gt=0)  # how long to look for a replica after a failure
    max_body_bytes: int = Field(16 << 20, ge=1)  # larger request bodies get 413


class Diverged(Exception):
    """A replay's text differs from what the client already has: the stream cannot go on."""


class Refused(Exception):
    """No replica took the attempt (the main app is not deployed yet, or a replay was answered
    with an error status): try again."""


@dataclass
class Splice:
    """One answer as the client receives it, across the attempts that produce it.

    Feed it each attempt's head and body pieces; it sends the client the head once, then what is
    new: the first attempt's body as it comes, a replay's without the events already sent (and with
    the first attempt's id and created time). `restart` before each replay. The first attempt's
    events are forwarded as they are and only kept: they are read (JSON) when a replay needs to
    know what they held, which keeps the common case to one copy per piece. Past HISTORY_BYTES
    they are read at once and the rest as they come, so that a long answer keeps only its text."""

    send: Send
    head: RelayHead | None = None  # the current attempt's, held until its body begins
    started: bool = False  # the client has the head
    events: bool = False  # the answer is Server-Sent Events (else one JSON piece)
    closed: bool = False  # the client has the end of the answer ([DONE], or the JSON piece)
    done: bool = False  # the response is finished
    ident: tuple[Any, Any] | None = None  # (id, created) of the first event sent
    sent: dict[int, list[str]] = field(default_factory=dict)  # choice -> texts of its events sent
    seen: dict[int, int] = field(default_factory=dict)  # choice -> its events in this attempt
    carry: bytes = b""  # an event not yet complete
    reading: bool = False  # events are read as they come (a replay, or a long first attempt)
    history: list[bytes] = field(default_factory=list)  # events sent and not read yet
    kept: int = 0  # bytes in `history`

    @property
    def resumable(self) -> bool:
        """Whether another attempt can complete the answer: nothing sent yet, or a stream not
        yet at its end (a JSON answer is sent in one piece)."""
        return not self.closed and (not self.started or self.events)

    def restart(self) -> None:
        """Forget the current attempt: the next one starts from its beginning."""
        self._read_history()
        self.head, self.seen, self.carry = None, {}, b""

    async def take(self, item: RelayHead | bytes) -> None:
        """The current attempt's next relayed item: its head (with the body's first piece), or a
        piece of its body."""
        if isinstance(item, RelayHead):
            self.take_head(item)
            item = item.body
        if item:
            await self.take_body(item)

    def take_head(self, head: RelayHead) -> None:
        """The current attempt's head. Refused when a replay (the client has a head already)
        answers anything but 200."""
        if self.started and head.status != 200:
            raise Refused(f"the replay was answered {head.status}")
        self.head = head

    async def take_body(self, piece: bytes) -> None:
        """A piece of the current attempt's body; sends the client what is new in it."""
        await self._start()
        if not self.events:
            await self._body(piece)
            self.closed = True
            return
        if not self.reading:  # forward whole events as they are; keep them for a replay
            events, end, self.carry = (self.carry + piece).rpartition(b"\n\n")
            if end:
                self.history.append(events + end)
                self.kept += len(events) + len(end)
                self.closed = self.closed or events.endswith(b"data: [DONE]")
                await self._body(events + end)
                if self.kept > HISTORY_BYTES:
                    self._read_history()
            return
        *whole, self.carry = (self.carry + piece).split(b"\n\n")
        out = b"".join(self._event(e) for e in whole if e)
        if out:
            await self._body(out)

    async def finish(self) -> None:
        """End the response (after the last attempt, or once the client has it all)."""
        if not self.done:
            await self._start()
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            self.done = True

    async def fail(self, error: Exception) -> None:
        """End the response with `error`: its OpenAI error answer when nothing was sent yet, else
        an error event and the end of the stream."""
        if not self.started:
            await error_response(error, "/v1/completions")(
                {"type": "http"}, no_disconnect, self.send
            )
            self.started = self.closed = self.done = True
            return
        if self.events and not self.closed:
            event = json.dumps(openai_body(error, status_of(error))).encode()
            await self._body(b"data: " + event + b"\n\ndata: [DONE]\n\n")
            self.closed = True
        await self.finish()

    def _read_history(self) -> None:
        """Learn what the events sent so far held (texts by choice, the first id); read every
        later event as it comes."""
        for event in b"".join(self.history).split(b"\n\n"):
            if event:
                self._event(event)  # each one new: counted as seen and as sent
        self.history, self.kept, self.reading = [], 0, True

    async def _start(self) -> None:
        if self.started:
            return
        if self.head is None:
            raise Refused("the replica ended the answer before its head")
        await self.send(
            {
                "type": "http.response.start",
                "status": self.head.status,
                "headers": self.head.headers,
            }
        )
        self.started = True
        kind = header(self.head.headers, b"content-type") or b""
        self.events = kind.startswith(b"text/event-stream")

    def _event(self, event: bytes) -> bytes:
        """What of one event the client gets: all of it, the choices it does not have yet, or
        nothing."""
        data = event.removeprefix(b"data: ")
        if data == b"[DONE]":
            if self.closed:
                return b""
            self.closed = True
            return event + b"\n\n"
        if data == event:  # not data: a comment
            return event + b"\n\n"
        payload = json.loads(data)
        if "error" in payload:
            return event + b"\n\n"
        choices = payload.get("choices") or [None]  # None: the usage event, once per answer
        fresh = [c for c in choices if self._fresh(c)]
        if not fresh:
            return b""
        ident = (payload.get("id"), payload.get("created"))
        self.ident = self.ident or ident
        if ident == self.ident and len(fresh) == len(choices):
            return event + b"\n\n"
        if payload.get("choices"):
            payload["choices"] = fresh
        payload["id"], payload["created"] = self.ident
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def _fresh(self, choice: dict[str, Any] | None) -> bool:
        """Whether the client lacks this event of `choice` (its events are counted per attempt);
        Diverged if a replayed one's text differs from the one sent."""
        index = -1 if choice is None else int(choice.get("index", 0))
        text = "" if choice is None else _text(choice)
        n = self.seen.get(index, 0)
        self.seen[index] = n + 1
        sent = self.sent.setdefault(index, [])
        if n < len(sent):
            if sent[n] != text:
                raise Diverged(f"choice {index}: sent {sent[n]!r}, replayed {text!r}")
            return False
        sent.append(text)
        return True

    async def _body(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})


def _text(choice: dict[str, Any]) -> str:
    """A completion choice's text, or a chat chunk's content (with its role, on the first)."""
    if "delta" in choice:
        delta = choice["delta"] or {}
        return f"{delta.get('role') or ''}:{delta.get('content') or ''}"
    return str(choice.get("text") or "")


def with_seed(body: bytes) -> bytes:
    """`body` with a random `seed` when it is a JSON object without one, so that a replay draws
    the same tokens; anything else unchanged (the replica answers what is wrong with it)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep for Python's parser
        return body
    if not isinstance(request, dict) or request.get("seed") is not None:
        return body
    return json.dumps({**request, "seed": secrets.randbits(63)}).encode()


class Channels:
    """The gateway's relay channels, one to each replica of the target deployment (their
    addresses from a broadcast, asked again every REFRESH_S and whenever none is open)."""

    def __init__(self, target: Callable[[], DeploymentHandle]) -> None:
        self.target = target
        self.open: dict[tuple[str, int], Channel] = {}
        self._asked_at = -REFRESH_S
        self._asking: asyncio.Future[None] | None = None

    async def pick(self) -> Channel:
        """The open channel with the fewest answers in flight; Refused when none can be opened.
        With none open it waits for the replicas' addresses; else it asks again in the
        background every REFRESH_S (replicas that joined share the next picks)."""
        if not self._live():
            await asyncio.shield(self._asked())
        elif time.monotonic() - self._asked_at > REFRESH_S:
            self._asked()
        live = self._live()
        if not live:
            raise Refused("no replica of the main app answers yet")
        return min(live, key=lambda c: len(c.streams))

    def _live(self) -> list[Channel]:
        return [c for c in self.open.values() if c.closed is None]

    def _asked(self) -> asyncio.Future[None]:
        """The ask for the replicas' addresses under way, or a new one (one at a time, however
        many callers wait for it)."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask())
            self._asking.add_done_callback(_seen)
        return self._asking

    async def _ask(self) -> None:
        self._asked_at = time.monotonic()
        try:
            answers = await (
                self.target()
                .broadcast("relay_address")
                .results_async(timeout_s=ASK_TIMEOUT_S, return_exceptions=True)
            )
        except (RayError, TimeoutError) as exc:  # the channels open stay in use
            log.warning("asking the replicas for their relay channels: %s", exc)
            return
        addresses = {(str(a[0]), int(a[1])) for a in answers if not isinstance(a, BaseException)}
        for address in list(self.open):
            if address not in addresses or self.open[address].closed is not None:
                self.open.pop(address).close()
        for address in addresses - self.open.keys():
            try:
                self.open[address] = await Channel.open(*address)
            except OSError as exc:
                log.warning("relay channel to %s:%d: %s", *address, exc)


def _seen(asked: asyncio.Future[None]) -> None:
    """Mark a background ask's failure seen: the next pick that needs a replica asks again and
    meets it (Refused: the main app is not deployed yet)."""
    if not asked.cancelled():
        asked.exception()


class Gateway:
    """The gateway's ASGI app (inside BodyLimit, which hands it the whole body)."""

    def __init__(self, args: GatewayArgs, target: Callable[[], DeploymentHandle]) -> None:
        self.args, self.channels = args, Channels(target)
        self.resumed = Counter(  # Serve adds the application: completions or chat
            "gpuos_gateway_resumed", "answers whose replica failed, sent again to another"
        )
        self.lost = Counter(
            "gpuos_gateway_lost",
            "answers the gateway could not finish after a replica failed (by reason)",
            tag_keys=("reason",),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        body = (await receive()).get("body", b"")
        # Parsing a large body would hold the event loop every other stream needs.
        body = (
            with_seed(body)
            if len(body) <= INLINE_BYTES
            else await asyncio.to_thread(with_seed, body)
        )
        request = RelayRequest(
            method=scope["method"],
            path=scope["path"],
            query=scope.get("query_string", b""),
            headers=_forwarded(scope["headers"], len(body)),
            body=body,
        )
        answer = asyncio.create_task(self.answer(request, Splice(send)))
        gone = asyncio.ensure_future(receive())  # BodyLimit's receive now reports a disconnect
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when Serve cancels this call (its caller went away): the answer stops
            for task in (answer, gone):
                task.cancel()
        if answer.done() and not answer.cancelled():
            answer.result()

    async def answer(self, request: RelayRequest, splice: Splice) -> None:
        """Relay `request` until `splice` has the whole answer, sending it again while replicas
        fail, for up to resume_timeout_s after the first failure."""
        deadline, attempt = None, 0
        while True:
            try:
                await self.attempt(request, splice)
                return
            except Diverged as exc:
                log.error("%s %s: replay diverged: %s", request.method, request.path, exc)
                self.lost.inc(tags={"reason": "diverged"})
                await splice.fail(
                    EngineFailedError(
                        "the replica making this completion failed, and its replay on another "
                        "replica did not reproduce the text already sent; send the request again"
                    )
                )
                return
            except (*GONE, Refused) as exc:
                failure: Exception = exc
            if not splice.resumable:  # the client has it all but the end of the response
                await splice.finish()
                return
            now = time.monotonic()
            deadline = deadline or now + self.args.resume_timeout_s
            if now > deadline:
                log.error(
                    "%s %s: no replica finished it: %s", request.method, request.path, failure
                )
                self.lost.inc(tags={"reason": "timeout"})
                await splice.fail(
                    ReplicaLostError(
                        "the replica making this completion failed and no other finished it "
                        f"within {self.args.resume_timeout_s:.0f} s ({type(failure).__name__}); "
                        "send the request again"
                    )
                )
                return
            if attempt == 0:
                log.warning(
                    "%s %s: its replica failed (%s: %s); sending it again",
                    request.method,
                    request.path,
                    type(failure).__name__,
                    failure,
                )
                self.resumed.inc()
            await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
            attempt += 1
            splice.restart()

    async def attempt(self, request: RelayRequest, splice: Splice) -> None:
        """One attempt: the replica's answer into `splice`, until it ends or fails."""
        channel = await self.channels.pick()
        async with contextlib.aclosing(channel.relay(request)) as items:  # closing cancels it
            async for item in items:
                await splice.take(item)
        await splice.finish()


def _forwarded(headers: Headers, length: int) -> Headers:
    """The client's headers a replica should see, with the (possibly seeded) body's length."""
    kept = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
    return [*kept, (b"content-length", str(length).encode())]


async def _lifespan(receive: Receive, send: Send) -> None:
    """Serve runs the ASGI lifespan protocol on an ingress: nothing to set up or tear down."""
    while True:
        message = await receive()
        kind = message["type"].removeprefix("lifespan.")
        await send({"type": f"lifespan.{kind}.complete"})
        if kind == "shutdown":
            return


@serve.ingress()
class GatewayReplica:
    """One replica of a gateway application. Deployed as `CompletionsGateway`."""

    def __init__(self, args: GatewayArgs) -> None:
        self.args = args
        self._target: DeploymentHandle | None = None  # made on first use: the app may start later

    def target(self) -> DeploymentHandle:
        """A handle to the replicas that answer."""
        if self._target is None:
            try:
                handle = serve.get_deployment_handle(self.args.deployment, self.args.app)
            except KeyError as exc:  # Serve's answer while the main app is not deployed
                raise Refused(str(exc)) from None
            self._target = handle
        return self._target

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return BodyLimit(Gateway(self.args, self.target), self.args.max_body_bytes, lambda: None)


CompletionsGateway = serve.deployment(name="CompletionsGateway")(GatewayReplica)


def build_gateway(args: dict[str, object]) -> Application:
    """Serve app builder of a gateway application (deployments/llm.yaml); pydantic.ValidationError
    names a bad key or value."""
    return CompletionsGateway.bind(GatewayArgs.model_validate(args))
