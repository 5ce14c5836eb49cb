"""The relay channel: how the completions gateway (serving/gateway.py) reaches a replica without a
Ray call per request. A Ray call and its streamed items were most of what a relayed completion cost
the replica's event loop (bench/NOTES.md), the loop whose GIL the engine's steps need.

Each replica listens on a port of its own (`ChannelServer`, on its event loop); a gateway keeps
one connection to each replica (`Channel`) and carries many requests over it at once, in frames:

    frame   = length (u32, of what follows the header) | stream (u32) | kind (u8) | payload
    REQUEST   payload: u32 n | n bytes of JSON {method, path, query, headers} | the body
    HEAD      payload: u32 n | n bytes of JSON {status, headers} | the body's first piece
    BODY      payload: a piece of the body
    END       the answer is complete (no payload)
    CANCEL    from the gateway: stop the stream (its client went away)

Heads are JSON (header bytes as latin-1) and bodies raw: nothing from the network is unpickled.
Only the completion routes are carried. A replica that dies closes its connections, which the
gateway answers by sending its requests again (serving/gateway.py).

Imports no torch and no Ray: the gateway process stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import AsyncGenerator, Collection
from typing import Any

from starlette.types import ASGIApp

from .relay import RelayHead, RelayRequest, relayed

log = logging.getLogger("gpuos.serving")
FRAME = struct.Struct("<IIB")  # payload length, stream id, kind
LENGTH = struct.Struct("<I")
REQUEST, HEAD, BODY, END, CANCEL = range(5)
MAX_FRAME = 64 << 20  # larger frames mean a broken peer: the connection is closed


class ChannelGone(Exception):
    """The connection to the replica closed before the answer ended (the replica died)."""


def frame(stream: int, kind: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(len(payload), stream, kind) + payload


def pack(head: dict[str, Any], body: bytes) -> bytes:
    """A JSON head and raw bytes, as REQUEST and HEAD frames carry them."""
    encoded = json.dumps(head).encode()
    return LENGTH.pack(len(encoded)) + encoded + body


def unpack(payload: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = LENGTH.unpack_from(payload)
    return json.loads(payload[LENGTH.size : LENGTH.size + n]), payload[LENGTH.size + n :]


def _headers(pairs: list[tuple[bytes, bytes]]) -> list[list[str]]:
    return [[k.decode("latin-1"), v.decode("latin-1")] for k, v in pairs]


def _raw(pairs: list[list[str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs]


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """(stream, kind, payload) of the next frame; IncompleteReadError at the end."""
    length, stream, kind = FRAME.unpack(await reader.readexactly(FRAME.size))
    if length > MAX_FRAME:
        raise ConnectionError(f"a frame of {length} bytes: not a relay channel peer")
    return stream, kind, await reader.readexactly(length) if length else b""


class ChannelServer:
    """A replica's end: runs each request it is sent through `app` (serving/relay.py's `relayed`,
    so the routes, limits and errors are the replica's own) and sends the answer back in frames."""

    def __init__(self, app: ASGIApp, paths: Collection[str]) -> None:
        self.app, self.paths = app, frozenset(paths)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One gateway's connection, until it closes; its streams in flight are cancelled then."""
        streams: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                stream, kind, payload = await read_frame(reader)
                if kind == REQUEST:
                    streams[stream] = asyncio.create_task(
                        self._answer(stream, payload, writer, streams)
                    )
                elif kind == CANCEL and stream in streams:
                    streams[stream].cancel()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not isinstance(exc, asyncio.IncompleteReadError):
                log.warning("relay channel closed: %s", exc)
        finally:
            for task in list(streams.values()):
                task.cancel()
            writer.close()

    async def _answer(
        self,
        stream: int,
        payload: bytes,
        writer: asyncio.StreamWriter,
        streams: dict[int, asyncio.Task[None]],
    ) -> None:
        try:
            await self._send(stream, payload, writer)
        except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            log.warning("relay channel: a malformed request (%r); closing the connection", exc)
            writer.close()
        finally:
            streams.pop(stream, None)

    async def _send(self, stream: int, payload: bytes, writer: asyncio.StreamWriter) -> None:
        head, body = unpack(payload)
        if head["path"] not in self.paths:  # the channel carries the completion routes only
            answer = {"status": 404, "headers": [["content-type", "text/plain"]]}
            writer.write(frame(stream, HEAD, pack(answer, b"not a relayed route")))
            writer.write(frame(stream, END))
            return
        request = RelayRequest(
            head["method"], head["path"], head["query"].encode(), _raw(head["headers"]), body
        )
        # closed on the way out, cancelled or not: that cancels the app (relayed's contract)
        async with contextlib.aclosing(relayed(self.app, request)) as items:
            async for item in items:
                if isinstance(item, RelayHead):
                    answer = {"status": item.status, "headers": _headers(item.headers)}
                    writer.write(frame(stream, HEAD, pack(answer, item.body)))
                else:
                    writer.write(frame(stream, BODY, item))
                await writer.drain()
        writer.write(frame(stream, END))


class Channel:
    """A gateway's connection to one replica, carrying many answers at once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.streams: dict[int, asyncio.Queue[RelayHead | bytes | None | Exception]] = {}
        self.closed: Exception | None = None  # why, once the connection ended
        self._next = 0
        self._reading = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, host: str, port: int) -> Channel:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def relay(self, request: RelayRequest) -> AsyncGenerator[RelayHead | bytes, None]:
        """The answer to `request`: its head (with the body's first piece), then body pieces.
        Raises ChannelGone if the connection ends first; stopping early cancels the stream."""
        if self.closed is not None:
            raise ChannelGone(str(self.closed))
        stream, self._next = self._next, (self._next + 1) % 2**32
        items: asyncio.Queue[RelayHead | bytes | None | Exception] = asyncio.Queue()
        self.streams[stream] = items
        head = {
            "method": request.method,
            "path": request.path,
            "query": request.query.decode("latin-1"),
            "headers": _headers(request.headers),
        }
        self.writer.write(frame(stream, REQUEST, pack(head, request.body)))
        ended = False
        try:
            while (item := await items.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
            ended = True
        finally:
            self.streams.pop(stream, None)
            if not ended and self.closed is None:
                self.writer.write(frame(stream, CANCEL))

    def close(self) -> None:
        self._reading.cancel()
        self.writer.close()

    async def _read(self) -> None:
        try:
            while True:
                stream, kind, payload = await read_frame(self.reader)
                items = self.streams.get(stream)
                if items is None:  # cancelled: what was already on its way
                    continue
                if kind == HEAD:
                    head, body = unpack(payload)
                    items.put_nowait(RelayHead(head["status"], _raw(head["headers"]), body))
                elif kind == BODY:
                    items.put_nowait(payload)
                elif kind == END:
                    items.put_nowait(None)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self.closed = exc
        except asyncio.CancelledError:
            self.closed = ChannelGone("closed by the gateway")
            raise
        finally:
            self.closed = self.closed or ChannelGone("the connection ended")
            for items in self.streams.values():
                items.put_nowait(ChannelGone(f"the replica's connection ended: {self.closed!r}"))
            with contextlib.suppress(Exception):
                self.writer.close()
