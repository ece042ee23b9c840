"""The OpenAI layer in-process (no BentoML): an engine failure after a stream started reaches the client as an
error event followed by `data: [DONE]`, and the engine keeps serving."""

import json

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app(num_kv_blocks=64) as api:
        yield api


def test_failure_mid_stream_sends_error_event_then_done(api, fail_step, monkeypatch):
    app = api.app
    fail_step(api.engine.engine.model_runner, 4, RuntimeError("device lost"))
    body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True, "temperature": 0}
    with TestClient(app) as client, client.stream("POST", "/completions", json=body) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("choices" in c for c in chunks[:-1]) and len(chunks) > 1  # tokens arrived before the failure
    assert "device lost" in chunks[-1]["error"]["message"] and chunks[-1]["error"]["type"] == "server_error"
    monkeypatch.undo()
    with TestClient(app) as client:
        done = client.post("/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).json()
    assert done["usage"]["completion_tokens"] == 3
