"""BentoML's traffic timeout as tiffin installs it: a 504 when no byte comes in time, the app's own answer
otherwise, and requests not kept alive once answered (BentoML's timer held each request's context, spans and
all, for the whole timeout: tiffin's is 600 s)."""

import asyncio
import contextvars
import gc
import weakref

import pytest

pytest.importorskip("bentoml")

from bentoml._internal.server.http.traffic import TimeoutMiddleware  # noqa: E402

from tiffin.plugin import http_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
REQUEST = contextvars.ContextVar("request")
SCOPE = {"type": "http", "method": "GET", "path": "/", "headers": []}


class Marker:
    """Stands for what a request's context holds (OpenTelemetry spans, BentoML's request context)."""


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    import uvicorn

    monkeypatch.setattr(TimeoutMiddleware, "__call__", TimeoutMiddleware.__call__)  # put back after the test
    monkeypatch.setattr(uvicorn.Config, "__init__", uvicorn.Config.__init__)
    http_server.install(keep_alive=75)


async def answer(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve(app, timeout: float, alive: weakref.WeakSet) -> list[dict]:
    """One request through the middleware, in a task and context of its own as a server gives it."""
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    async def request():
        REQUEST.set(Marker())
        alive.add(REQUEST.get())
        await TimeoutMiddleware(app, timeout)(SCOPE, receive, send)

    await asyncio.create_task(request())
    return sent


def test_answered_requests_are_not_kept_for_the_timeout():
    async def main():
        alive = weakref.WeakSet()
        for _ in range(1000):
            assert [m.get("status") for m in await _serve(answer, 600, alive)] == [200, None]
        gc.collect()
        return len(alive)

    assert asyncio.run(main()) < 250  # asyncio drops cancelled timers once they are most of its queue


def test_no_byte_in_time_is_a_504_and_the_app_is_cancelled():
    cancelled = asyncio.Event()

    async def silent(scope, receive, send):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        sent = await _serve(silent, 0.05, weakref.WeakSet())
        await asyncio.wait_for(cancelled.wait(), 5)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 504 and b"0.05 seconds" in sent[1]["body"]


def test_a_slow_stream_that_started_in_time_runs_to_its_end():
    async def slow_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    sent = asyncio.run(_serve(slow_stream, 0.02, weakref.WeakSet()))
    assert [m.get("body") for m in sent] == [None, b"x", b"x", b"x", b""]


def test_the_apps_error_reaches_the_server():
    async def failing(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(_serve(failing, 600, weakref.WeakSet()))
