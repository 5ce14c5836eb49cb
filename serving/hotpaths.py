"""`HotPaths`: the busiest POST routes answered straight from their JSON body, past FastAPI.

Where a replica's event loop time went under load (py-spy, bench/NOTES.md): FastAPI's routing,
middleware, dependency solving and validation of the parsed body were 11 of the 24 points of
replica samples a /v1/ops request spent under Serve's wrapper, and ~15% of the loop's time a
completion. The data plane (serving/routes.py) and the completion routes (serving/completions.py)
declare their FastAPI routes as always and hand HotPaths the same answers as `HotRoute`s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OURS
from .relay import body_then, header

INLINE_JSON_BYTES = 1 << 16  # smaller bodies are parsed on the event loop (a thread costs more)
OnError = Callable[[BaseException, str], Response]  # (exception, path) -> its error answer


@dataclass(frozen=True)
class HotRoute:
    """A POST route HotPaths answers itself: its body's model, and its answer to a valid body given
    the path's last segment (the `{op}` of a route keyed with a trailing `/`, else "")."""

    model: type[pydantic.BaseModel]
    answer: Callable[[Any, str], Awaitable[Response]]


class HotPaths:
    """ASGI middleware: a POST with a JSON body (or no content type, which FastAPI reads as JSON
    too) to a path in `routes` (or one segment under a key ending in `/`) goes straight to its
    answer, the body validated from its bytes in one pass by the route's model. A body the model
    refuses, and any other request (these routes with another content type included), goes on to
    the app, where these routes are declared: FastAPI answers it as it always has. Errors our code
    raises on purpose are answered by `on_error`; anything else is a bug, answered by the app's
    outermost middleware. Sits inside the body limit, which hands the whole body over at once."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, HotRoute], on_error: OnError) -> None:
        self.app, self.routes, self.on_error = app, dict(routes), on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self._route(scope)
        if hot is None:
            await self.app(scope, receive, send)
            return
        route, tail = hot
        body = (await receive()).get("body", b"")
        try:
            request = (
                route.model.model_validate_json(body)
                if len(body) < INLINE_JSON_BYTES
                else await asyncio.to_thread(route.model.model_validate_json, body)
            )
        except pydantic.ValidationError:  # rare: the route's own words for what is wrong
            await self.app(scope, body_then(body, receive), send)
            return
        try:
            response = await route.answer(request, tail)
        except OURS as exc:
            response = self.on_error(exc, scope["path"])
        await response(scope, receive, send)

    def _route(self, scope: Scope) -> tuple[HotRoute, str] | None:
        """(route, path tail) of a request HotPaths takes, else None."""
        if scope["type"] != "http" or scope["method"] != "POST" or not _json_content(scope):
            return None
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        route = self.routes.get(path)
        if route is not None and not path.endswith("/"):
            return route, ""
        parent, _, tail = path.rpartition("/")
        route = self.routes.get(parent + "/")
        return (route, tail) if route is not None and tail else None


def _json_content(scope: Scope) -> bool:
    value = header(scope["headers"], b"content-type")
    return value is None or value.partition(b";")[0].strip().lower() == b"application/json"
