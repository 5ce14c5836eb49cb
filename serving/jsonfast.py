"""JSON answers of the data plane (/v1/ops, /v1/batch): orjson when it is installed, which writes
numpy arrays at C speed (a float32 as its shortest round-trip form), else pydantic's serializer
with arrays turned into lists first. Both write the same values; orjson is a dependency, and the
fallback keeps environments without it (an offline bundle) serving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pydantic_core
from starlette.responses import Response

log = logging.getLogger("gpuos.serving")


def _tolist(value: Any) -> Any:
    """pydantic's fallback for what it cannot write: numpy arrays (and numbers) as lists."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def _encoder() -> Callable[[Any], bytes]:
    try:
        import orjson
    except ImportError:
        log.warning("orjson is not installed: answers are written by pydantic (slower)")
        return partial(pydantic_core.to_json, fallback=_tolist)
    return partial(orjson.dumps, option=orjson.OPT_SERIALIZE_NUMPY)


dumps: Callable[[Any], bytes] = _encoder()  # JSON bytes of dicts, lists, numbers, numpy arrays
# Answers with more tensor elements than this are written in a worker thread: orjson writes 1M
# floats as a list in ~28 ms (64k in ~2 ms), time the replica's event loop would not serve others.
INLINE_ELEMENTS = 65536


def json_response(content: Any) -> Response:
    """A 200 answer with `content` written by `dumps` (no validation: the routes built it)."""
    return Response(dumps(content), media_type="application/json")


async def json_answer(content: Any, elements: int) -> Response:
    """`json_response` of an answer holding `elements` tensor elements: written off the event loop
    when there are more than INLINE_ELEMENTS."""
    if elements <= INLINE_ELEMENTS:
        return json_response(content)
    return Response(await asyncio.to_thread(dumps, content), media_type="application/json")
