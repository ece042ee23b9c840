"""Sleep, wake and weight reload over HTTP (tiffin.engine.sleep_mode), at the root as vLLM serves them:

- `POST /sleep?level=1|2`: every engine of the service sleeps once its requests in flight finished (level 1 frees
  the KV cache, 2 the weights too); `POST /wake_up` wakes them, answering the seconds it took; `GET /is_sleeping`:
  `{"is_sleeping": bool}` (vLLM's shape).
- `POST /update_weights` `{"model_path", "abort_all_requests": false, "model": null}` (SGLang's field names): the
  engine serving `model` (default: the first, the chat model) serves the checkpoint at `model_path`, a directory or
  GGUF file on the server with the served one's architecture and shapes; a mismatch is a 400 naming it, the old
  weights serving on. Requests in flight finish first, or are aborted with `abort_all_requests`.

The Guard (tiffin.plugin.guard) puts /sleep, /wake_up and /update_weights behind the admin key, and refuses them
outright on a server without any key: they load files named by the request and stop serving. Requests arriving
while the engines sleep get a 503 naming the state, or wait up to `asleep_request_wait` seconds for the wake; an
engine asleep for being idle (`idle_sleep_seconds`) is woken by the next request. /readyz stays ready while asleep
(as vLLM's does): a replica asleep for being idle must still receive the request that wakes it.
"""

import time

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict

from tiffin.engine.errors import EngineAsleep, EngineBusy
from tiffin.plugin.openai.app import _body, _router
from tiffin.plugin.openai.protocol import APIError


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    abort_all_requests: bool = False
    model: str | None = None


def add_sleep_routes(app: FastAPI, v1: FastAPI) -> None:
    """The routes on `app`, over the engines of the servings of the /v1 app `v1`."""

    def engines() -> list:
        return list({id(s.engine): s.engine for s in _router(v1).servings}.values())

    @app.post("/sleep")
    async def sleep(level: int = Query(1)):
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 or 2, got {level}", param="level")
        for engine in engines():
            await engine.sleep(level)
        return {"is_sleeping": True, "level": level}

    @app.post("/wake_up")
    async def wake_up():
        started = time.monotonic()
        for engine in engines():
            await engine.wake_up()
        return {"is_sleeping": False, "wake_seconds": round(time.monotonic() - started, 3)}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": any(engine.is_sleeping() for engine in engines())}

    @app.post("/update_weights")
    async def update_weights(raw: Request):
        req = await _body(raw, UpdateWeightsRequest)
        servings = _router(v1).servings
        serving = next((s for s in servings if req.model in (None, s.model_name)), None)
        if serving is None:
            raise APIError(404, f"no model {req.model!r} is served here", type="not_found_error", param="model")
        try:
            await serving.engine.update_weights(req.model_path, req.abort_all_requests)
        except ValueError as e:
            raise APIError(400, str(e), param="model_path") from None
        except (EngineAsleep, EngineBusy) as e:
            raise APIError(409, str(e), type="conflict_error") from None
        return {"success": True, "message": f"{serving.model_name} serves the weights of {req.model_path}"}
