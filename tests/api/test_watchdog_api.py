"""The engine watchdog over HTTP, in-process: a hung step ends the stream in flight with an error event naming the
stall, /livez (the Bento's Guard over the service's `failure`) answers 503 naming it, new requests 503, and
`tiffin_engine_last_step_age_seconds` shows the step's age; once the step ends, all is served again."""

import functools
import json
import threading
import time

import pytest

pytest.importorskip("bentoml")

from fastapi.testclient import TestClient  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Mount, Route  # noqa: E402

from tiffin.plugin.guard import Guard  # noqa: E402
from tiffin.plugin.metrics import engine_metrics  # noqa: E402

BODY = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def test_a_hung_step_over_http(openai_app, monkeypatch):
    from prometheus_client import REGISTRY

    from tiffin.plugin.service import Tiffin

    on_age = functools.partial(engine_metrics().on_step_age, "model")
    with openai_app(num_kv_blocks=64, engine_stall_timeout=1, on_step_age=on_age) as api:
        service = object.__new__(Tiffin.inner)  # the service's liveness over this engine, nothing loaded
        service.load_error, service.engines = None, [api.engine]
        ok = lambda request: PlainTextResponse("ok")
        app = Guard(Starlette(routes=[Route("/livez", ok), Mount("/v1", api.app)]), failure=service.failure)
        runner = api.engine.engine.model_runner
        execute, calls, release = runner.execute, [], threading.Event()

        def hang_at_fourth(scheduler_output):
            calls.append(1)
            if len(calls) == 4:
                release.wait(30)
            return execute(scheduler_output)

        monkeypatch.setattr(runner, "execute", hang_at_fourth)
        with TestClient(app) as client:
            assert client.get("/livez").status_code == 200
            with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                assert r.status_code == 200
                events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and len(events) > 2  # tokens, then the error
            error = json.loads(events[-2])["error"]
            assert "no engine step finished in 1 s while 1 request was in flight" in error["message"]
            livez = client.get("/livez")
            assert livez.status_code == 503 and "engine stalled" in livez.json()["error"]["message"]
            assert "engine_stall_timeout=1 s" in livez.json()["error"]["message"]
            assert not service.__is_alive__()
            refused = client.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and "engine stalled" in refused.json()["error"]["message"]
            age = REGISTRY.get_sample_value("tiffin_engine_last_step_age_seconds", {"engine": "model"})
            assert age > 1
            release.set()
            deadline = time.monotonic() + 5
            while client.get("/livez").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            done = client.post("/v1/completions", json={**BODY, "max_tokens": 3}).json()
            assert done["usage"]["completion_tokens"] == 3 and service.__is_alive__()
