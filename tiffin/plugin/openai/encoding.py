"""JSON answers encoded off the event loop.

A JSON body of megabytes (2,048 embeddings, a Response echoing a large schema, 1.3M token ids) takes from tenths
of a second to seconds to encode, and FastAPI's own path (`jsonable_encoder`, then `json.dumps`) walks it on the
event loop, stalling every stream and probe meanwhile. Routes that may answer that much hand FastAPI a `Response`
of bytes encoded here, on a worker thread, instead of a dict.

Invariant: the bytes are what Starlette's JSONResponse would send (compact UTF-8, no NaN or Infinity: a
non-finite number is a ValueError, never invalid JSON)."""

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import Response


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def json_response(body: Any, status_code: int = 200) -> Response:
    """`body` as a JSON response, encoded on a worker thread."""
    return json_bytes_response(await asyncio.to_thread(dumps, body), status_code)


async def built_json_response(build: Callable[[], Any]) -> Response:
    """The JSON response of what `build()` returns, built and encoded on a worker thread (what builds it must not
    be shared with the event loop meanwhile)."""
    return json_bytes_response(await asyncio.to_thread(lambda: dumps(build())))


def json_bytes_response(content: bytes, status_code: int = 200) -> Response:
    """Encoded JSON as a response, as it is: nothing to encode on the event loop."""
    return Response(content, status_code=status_code, media_type="application/json")
