"""An HTTP request carried to a replica by the completions gateway (serving/gateway.py) over its
relay channel (serving/channel.py) instead of HTTP: the replica runs each `RelayRequest` through
its own ASGI app (`relayed`) and streams back a `RelayHead` and then the body's bytes. So a
relayed request meets the same routes, validation, limits and error answers as one sent to the
replica over HTTP, and nothing about completions is written twice.

Imports no torch and no Ray: the gateway process stays small.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive

Headers = list[tuple[bytes, bytes]]
log = logging.getLogger("gpuos.serving")


@dataclass(frozen=True)
class RelayRequest:
    """What a client sent: method, path (the full path, query apart), headers and whole body."""

    method: str
    path: str
    query: bytes
    headers: Headers
    body: bytes


@dataclass(frozen=True)
class RelayHead:
    """The response's status line and headers, and its body's first piece (what the app sent with
    or right after its head): the first item a relay yields. Joined: each item is a frame the
    replica's event loop writes to the gateway (serving/channel.py)."""

    status: int
    headers: Headers
    body: bytes = b""


async def relayed(app: ASGIApp, request: RelayRequest) -> AsyncGenerator[RelayHead | bytes, None]:
    """Run `request` through `app`: its head with the body's first piece, then the rest in pieces
    (what the app sent since the last piece, joined, so a busy replica yields fewer, larger
    pieces). Closing the iterator (the caller went away) cancels the app as a client disconnect
    would: a completion in flight frees its engine slot. The scope says ASGI spec 2.4, where a
    disconnect is signalled to `send` rather than through `receive`: here by that cancellation,
    so a streaming response need not run a task that listens to `receive`."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query,
        "headers": request.headers,
        "client": None,
        "server": None,
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue()

    def ended(task: asyncio.Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Starlette answered 500 and re-raised for the server to log, as uvicorn would.
            log.error(
                "relayed %s %s failed", request.method, request.path, exc_info=task.exception()
            )
        sent.put_nowait(None)

    task = asyncio.ensure_future(app(scope, body_then(request.body, no_disconnect), sent.put))
    task.add_done_callback(ended)
    try:
        async for item in _items(sent):
            yield item
    finally:
        task.cancel()


def body_then(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out `body` whole, once, then waits on `receive` (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def header(headers: Headers, name: bytes) -> bytes | None:
    """The value of header `name` (lower case, as ASGI gives names), None when absent."""
    return next((value for key, value in headers if key == name), None)


async def no_disconnect() -> Message:
    """A `receive` with nothing more to report: it waits until cancelled (the response ended)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _items(sent: asyncio.Queue[Message | None]) -> AsyncIterator[RelayHead | bytes]:
    """The app's messages as a head (with the first body piece) and body pieces, until its last
    body message (or its end)."""
    start: Message | None = None  # the head, held until the body's first piece
    while (message := await sent.get()) is not None:
        if message["type"] == "http.response.start":
            start = message
            continue
        pieces, more = [message.get("body", b"")], message.get("more_body", False)
        while more and not sent.empty():  # join what else is already waiting
            following = sent.get_nowait()
            if following is None:
                more = False
                break
            pieces.append(following.get("body", b""))
            more = following.get("more_body", False)
        if start is not None:
            yield _head(start, b"".join(pieces))
            start = None
        elif any(pieces):
            yield b"".join(pieces)
        if not more:
            return
    if start is not None:  # the app ended after its head without a body message
        yield _head(start, b"")


def _head(start: Message, body: bytes) -> RelayHead:
    return RelayHead(start["status"], list(start.get("headers", [])), body)
