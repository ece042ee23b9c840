"""Two changes to the HTTP server `bentoml serve` runs (BentoML 1.4 over uvicorn), made by `install()` in the
worker before the server starts; neither is a setting BentoML offers.

- The traffic timeout (seconds to a response's first byte) no longer holds each request for that long.
  BentoML's TimeoutMiddleware schedules one timer per request and never cancels it; a timer keeps the context
  it was scheduled in, with the request's OpenTelemetry spans and BentoML request context, until it fires: at
  tiffin's 600 s and 100 requests a second, the last 60,000 requests' worth (measured: +4 KiB of Python
  objects per request). Same behaviour (504 if no byte is sent in time), the timer dropped with the request.
- Idle keep-alive connections stay open `keep_alive` seconds, not uvicorn's 5. httpx (so the openai SDK)
  keeps an idle connection for 5 s too: a client reusing one just as the server closes it gets a connection
  reset (5 in 10,000 requests at concurrency 128). A server that waits longer than its clients never races
  them."""

import asyncio

from starlette.responses import JSONResponse


async def _call(self, scope, receive, send) -> None:
    if scope["type"] not in ("http", "websocket"):
        return await self.app(scope, receive, send)
    first_byte = asyncio.get_running_loop().create_future()

    async def sending(message) -> None:
        if not first_byte.done():
            first_byte.set_result(None)
        await send(message)

    app = asyncio.ensure_future(self.app(scope, receive, sending))
    try:
        # asyncio.wait cancels its timer when it returns
        await asyncio.wait({first_byte, app}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server gave up on the request: so does the app
        app.cancel()
        raise
    if not first_byte.done() and not app.done() and app.cancel():
        error = {"error": f"Not able to process the request in {self.timeout} seconds"}
        return await JSONResponse(error, status_code=504)(scope, receive, send)
    await app


def install(keep_alive: float) -> None:
    import uvicorn
    from bentoml._internal.server.http.traffic import TimeoutMiddleware

    TimeoutMiddleware.__call__ = _call
    config_init = uvicorn.Config.__init__

    def init(config: uvicorn.Config, *args, **kwargs) -> None:
        config_init(config, *args, **kwargs)
        config.timeout_keep_alive = keep_alive

    uvicorn.Config.__init__ = init
