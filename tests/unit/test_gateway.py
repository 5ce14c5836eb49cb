"""The completions gateway without Serve: how it splices a replayed answer onto what the client
already has (serving/gateway.py's Splice), how it seeds requests, and the relay of a request
through a replica's ASGI app (serving/relay.py). The gateway under Serve, with a replica killed
mid-stream, is tested in tests/integration/test_completions.py."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pydantic
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message

from serving import gateway
from serving.channel import FRAME, Channel, ChannelGone, ChannelServer
from serving.errors import ReplicaLostError, error_response
from serving.gateway import Diverged, Refused, Splice, with_seed
from serving.hotpaths import HotPaths, HotRoute
from serving.relay import RelayHead, RelayRequest, relayed
from serving.routes import BodyLimit, relay_entry

SSE = RelayHead(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
JSON = RelayHead(200, [(b"content-type", b"application/json")])
TEXTS = ["Once", " upon", "", " a time", " there", " was", "."]


def completion_events(ident: str, texts: Sequence[str], usage: bool = True) -> list[bytes]:
    """A streamed completion as a replica writes it: an event per text (the last one finishing),
    the usage event, [DONE]."""
    head = {"id": ident, "object": "text_completion", "created": hash(ident) % 1000, "model": "m"}
    out = []
    for i, text in enumerate(texts):
        finish = "length" if i == len(texts) - 1 else None
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        out.append({**head, "choices": [choice]})
    if usage:
        out.append({**head, "choices": [], "usage": {"completion_tokens": len(texts)}})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in out] + [b"data: [DONE]\n\n"]


def chat_events(ident: str, texts: Sequence[str]) -> list[bytes]:
    head = {"id": ident, "created": 7, "model": "m", "object": "chat.completion.chunk"}
    out = []
    for i, text in enumerate(texts):
        delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        out.append(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode())
    return [*out, b"data: [DONE]\n\n"]


class Client:
    """What a splice sends: the ASGI messages a client's connection would carry."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        (start,) = [m for m in self.messages if m["type"] == "http.response.start"]
        return int(start["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    @property
    def ended(self) -> bool:
        last = self.messages[-1]
        return last["type"] == "http.response.body" and not last.get("more_body", False)


def pieces(data: bytes, seed: int) -> list[bytes]:
    """`data` cut at random places (a relay's pieces need not end at events)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), min(12, len(data) - 1)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


async def attempt(splice: Splice, head: RelayHead, body: Sequence[bytes]) -> None:
    """The relay's items as a replica yields them: the head with the first piece, then the rest."""
    first, *rest = body or [b""]
    await splice.take(RelayHead(head.status, head.headers, first))
    for piece in rest:
        await splice.take(piece)


@pytest.mark.parametrize("kept", [1 << 20, 300], ids=["kept", "read-as-they-come"])
@pytest.mark.parametrize("cut", [1, 3, 5, 8])
def test_a_replay_continues_a_stream_exactly_where_the_client_was(
    cut: int, kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the first attempt's events were kept as sent or (a long answer: past
    HISTORY_BYTES) read as they came."""
    monkeypatch.setattr(gateway, "HISTORY_BYTES", kept)
    whole = completion_events("cmpl-first", TEXTS)
    client = Client()

    async def run() -> None:
        splice = Splice(client)
        first = b"".join(whole[:cut]) + whole[cut][:10]  # the replica died mid-event
        await attempt(splice, SSE, pieces(first, cut))
        assert splice.resumable and splice.kept <= kept + max(len(e) for e in whole)
        splice.restart()
        replay = b"".join(completion_events("cmpl-second", TEXTS))  # its own id and time
        await attempt(splice, SSE, pieces(replay, cut + 1))
        await splice.finish()

    asyncio.run(run())
    # The client's stream is the one an unbroken answer would have been, byte for byte.
    assert client.status == 200 and client.body == b"".join(whole) and client.ended


def test_a_chat_replay_sends_the_role_and_the_words_once() -> None:
    whole = chat_events("chatcmpl-1", TEXTS)
    client = Client()

    async def run() -> None:
        splice = Splice(client)
        await attempt(splice, SSE, whole[:2])
        splice.restart()
        await attempt(splice, SSE, chat_events("chatcmpl-2", TEXTS))
        await splice.finish()

    asyncio.run(run())
    assert client.body == b"".join(whole)


def test_choices_replayed_in_another_order_each_continue_where_they_were() -> None:
    """Several prompts' events interleave as their tokens come, which differs between attempts."""

    def events(ident: str, order: Sequence[tuple[int, str]]) -> list[bytes]:
        head = {"id": ident, "created": 1}
        return [
            f"data: {json.dumps({**head, 'choices': [{'text': t, 'index': i}]})}\n\n".encode()
            for i, t in order
        ]

    first = [(0, "a"), (1, "x"), (0, "b")]
    replay = [(1, "x"), (1, "y"), (0, "a"), (0, "b"), (0, "c"), (1, "z")]
    client = Client()

    async def run() -> None:
        splice = Splice(client)
        await attempt(splice, SSE, events("one", first))
        splice.restart()
        await attempt(splice, SSE, events("two", replay))

    asyncio.run(run())
    got = [json.loads(e.removeprefix(b"data: ")) for e in client.body.split(b"\n\n") if e]
    assert {e["id"] for e in got} == {"one"}
    by_choice = {
        i: "".join(e["choices"][0]["text"] for e in got if e["choices"][0]["index"] == i)
        for i in (0, 1)
    }
    assert by_choice == {0: "abc", 1: "xyz"}


def test_a_replay_that_differs_from_what_was_sent_is_refused() -> None:
    async def run() -> None:
        splice = Splice(Client())
        await attempt(splice, SSE, completion_events("a", TEXTS)[:3])
        splice.restart()
        await attempt(splice, SSE, completion_events("b", ["Once", " UPON", "", " a time"]))

    with pytest.raises(Diverged, match="UPON"):
        asyncio.run(run())


def test_a_first_answer_passes_whatever_its_status_but_a_replay_must_be_200() -> None:
    busy = RelayHead(503, [(b"content-type", b"application/json"), (b"retry-after", b"1")])
    client = Client()

    async def run() -> None:
        splice = Splice(client)
        await attempt(splice, busy, [b'{"error": {}}'])
        await splice.finish()
        streaming = Splice(Client())
        await attempt(streaming, SSE, completion_events("a", TEXTS)[:2])
        streaming.restart()
        with pytest.raises(Refused, match="503"):
            streaming.take_head(busy)

    asyncio.run(run())
    assert client.status == 503 and client.body == b'{"error": {}}' and client.ended


def test_a_json_answer_or_a_stream_past_its_end_is_not_sent_again() -> None:
    async def run() -> None:
        plain = Splice(Client())
        assert plain.resumable  # nothing sent: ask again
        await attempt(plain, JSON, [b'{"choices": []}'])
        assert not plain.resumable
        stream = Splice(Client())
        await attempt(stream, SSE, completion_events("a", TEXTS))
        assert not stream.resumable  # [DONE] went out: only the response's end is left

    asyncio.run(run())


def test_a_failure_is_an_openai_error_before_the_stream_and_an_error_event_in_it() -> None:
    lost = ReplicaLostError("no replica finished it within 120 s; send the request again")
    before, during = Client(), Client()

    async def run() -> None:
        await Splice(before).fail(lost)
        splice = Splice(during)
        await attempt(splice, SSE, completion_events("a", TEXTS)[:2])
        await splice.fail(lost)

    asyncio.run(run())
    assert before.status == 503 and before.ended
    assert json.loads(before.body)["error"]["message"].startswith("no replica finished it")
    assert (b"retry-after", b"1") in before.messages[0]["headers"]
    *_, error, done = [e for e in during.body.split(b"\n\n") if e]
    assert json.loads(error.removeprefix(b"data: "))["error"]["type"] == "server_busy"
    assert done == b"data: [DONE]" and during.status == 200 and during.ended


def test_requests_without_a_seed_get_one_and_others_are_left_alone() -> None:
    seeded = json.loads(with_seed(b'{"model": "m", "prompt": "hi"}'))
    assert isinstance(seeded["seed"], int) and 0 <= seeded["seed"] < 2**63
    assert json.loads(with_seed(b'{"prompt": "hi", "seed": null}'))["seed"] is not None
    assert with_seed(b'{"prompt": "hi", "seed": 5}') == b'{"prompt": "hi", "seed": 5}'
    for body in (b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000):
        assert with_seed(body) == body  # the replica answers what is wrong with it


def echo_app(stopped: asyncio.Event) -> FastAPI:
    """POST /echo answers its JSON body; POST /stream streams 1000 events, setting `stopped` when
    its stream ends (finished or cancelled)."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return {"got": body}

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                stopped.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def request(path: str, body: bytes) -> RelayRequest:
    """A JSON POST as the gateway relays it."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return RelayRequest("POST", path, b"", headers, body)


def test_a_relayed_request_meets_the_app_and_a_closed_relay_stops_its_stream() -> None:
    stopped = asyncio.Event()
    app = echo_app(stopped)

    async def run() -> tuple[list[RelayHead | bytes], list[RelayHead | bytes]]:
        answered = [item async for item in relayed(app, request("/echo", b'{"a": 1}'))]
        bad = [item async for item in relayed(app, request("/echo", b"{"))]
        streamed = relayed(app, request("/stream", b""))
        head = await anext(streamed)
        assert isinstance(head, RelayHead) and head.status == 200
        assert head.body.startswith(b"data: 0")
        await streamed.aclose()  # the gateway's client went away
        await asyncio.wait_for(stopped.wait(), 5)
        return answered, bad

    answered, bad = asyncio.run(run())
    (head,) = answered  # a whole answer is one item: the head with its body
    assert isinstance(head, RelayHead) and head.status == 200
    assert json.loads(head.body) == {"got": {"a": 1}}
    assert isinstance(bad[0], RelayHead) and bad[0].status == 422


def test_the_relay_channel_carries_answers_cancels_streams_and_reports_a_lost_replica() -> None:
    """Many answers over one connection; a gateway that stops reading a stream cancels it on the
    replica; a path other than the relayed ones is refused; a closed connection fails the
    answers in flight with ChannelGone (the gateway then sends them again)."""
    stopped = asyncio.Event()
    app = echo_app(stopped)

    async def answer(channel: Channel, path: str, body: bytes) -> list[RelayHead | bytes]:
        return [item async for item in channel.relay(request(path, body))]

    async def run() -> None:
        server = ChannelServer(app, ("/echo", "/stream"))
        connections: list[asyncio.StreamWriter] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            await server.serve(reader, writer)

        listening = await asyncio.start_server(serve, "127.0.0.1", 0)
        channel = await Channel.open("127.0.0.1", listening.sockets[0].getsockname()[1])
        answers = await asyncio.gather(
            *(answer(channel, "/echo", b'{"a": %d}' % i) for i in range(20))
        )
        for i, (head, *rest) in enumerate(answers):
            assert isinstance(head, RelayHead) and head.status == 200
            assert json.loads(head.body + b"".join(rest)) == {"got": {"a": i}}  # type: ignore[arg-type]
        (refused,) = await answer(channel, "/admin/ops", b"{}")
        assert isinstance(refused, RelayHead) and refused.status == 404

        streamed = channel.relay(request("/stream", b""))
        head = await anext(streamed)
        assert isinstance(head, RelayHead) and head.body.startswith(b"data: 0")
        await streamed.aclose()  # the gateway's client went away
        await asyncio.wait_for(stopped.wait(), 5)

        stopped.clear()
        cut = channel.relay(request("/stream", b""))
        await anext(cut)
        connections[-1].transport.abort()  # the replica dies mid-answer
        with pytest.raises(ChannelGone):
            async for _ in cut:
                pass
        channel.close()

        # a peer that is not a gateway is hung up on; the replica serves the others
        reader, writer = await asyncio.open_connection(*listening.sockets[0].getsockname()[:2])
        writer.write(FRAME.pack(1 << 31, 0, 0))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        other = await Channel.open("127.0.0.1", listening.sockets[0].getsockname()[1])
        (head,) = await answer(other, "/echo", b"{}")
        assert isinstance(head, RelayHead) and head.status == 200
        other.close()
        listening.close()

    asyncio.run(run())


class Echo(pydantic.BaseModel):
    a: int


def test_the_channels_entry_keeps_the_apps_body_limit_hot_routes_and_error_answer() -> None:
    """relay_entry skips FastAPI's own layers but not ours: a hot route answers as through the
    whole app, a body over the limit gets 413, and a bug gets the app's 500 answer."""

    async def answer(body: Echo, tail: str) -> Response:
        if body.a < 0:
            raise RuntimeError("a bug")
        return JSONResponse({"got": body.a})

    api = FastAPI()
    api.add_middleware(HotPaths, routes={"/hot": HotRoute(Echo, answer)}, on_error=error_response)
    api.add_middleware(BodyLimit, limit=64, on_reject=lambda: None)

    @api.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> Response:
        return JSONResponse({"bug": str(exc)}, status_code=500)

    entry = relay_entry(api)
    assert entry is not api

    async def post(app: Any, body: bytes) -> tuple[int, bytes]:
        items = [item async for item in relayed(app, request("/hot", body))]
        head = items[0]
        assert isinstance(head, RelayHead)
        return head.status, head.body + b"".join(i for i in items[1:] if isinstance(i, bytes))

    async def run() -> list[tuple[int, bytes]]:
        bodies = (b'{"a": 3}', b'{"a": %s}' % (b"1" * 100), b'{"a": -1}')
        return [await post(app, body) for body in bodies for app in (entry, api)]

    ok, ok_api, big, big_api, buggy, buggy_api = asyncio.run(run())
    assert ok == ok_api == (200, b'{"got":3}')
    assert big[0] == big_api[0] == 413
    assert buggy == buggy_api == (500, b'{"bug":"a bug"}')
