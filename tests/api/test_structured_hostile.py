"""Hostile structured-outputs requests through the OpenAI app in-process: each is a 400 naming its field (never a
500), checked off the event loop, and compiled without holding back other requests, within the deadline."""

import asyncio
import time

import httpx
import pytest
import structured_specs

pytest.importorskip("fastapi")
xgrammar = pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app(num_kv_blocks=256) as api:
        yield api


@pytest.fixture(scope="module")
def client(api):
    with TestClient(api.app) as client:
        yield client


def _response_format(schema) -> dict:
    return {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _tools(schema) -> dict:
    return {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


def _structured(**spec) -> dict:
    return {**COMPLETION, "structured_outputs": spec}


HOSTILE = [
    ("chat/completions", _response_format(structured_specs.nested_schema(100)), "response_format"),
    ("chat/completions", _tools(structured_specs.nested_schema(100)), "tools"),
    ("completions", _structured(json=structured_specs.nested_schema(100)), "structured_outputs"),
    ("completions", _structured(json="[" * 5000 + "]" * 5000), "structured_outputs"),
    (
        "completions",
        _structured(json={"type": "string", "pattern": "(" * 3000 + "a" + ")" * 3000}),
        "structured_outputs",
    ),
    (
        "chat/completions",
        _response_format({"type": "string", "pattern": "^a{99999999999999999999}$"}),
        "response_format",
    ),
    ("completions", _structured(grammar="root ::= root"), "structured_outputs"),
    ("completions", {**_structured(grammar="root ::= root"), "stream": True}, "structured_outputs"),
    ("chat/completions", _response_format({"$ref": "http://example.com/s.json"}), "response_format"),
    ("chat/completions", _tools({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}), "tools"),
    ("completions", _structured(json={"type": "string", "format": "hostname"}), "structured_outputs"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), HOSTILE, ids=lambda v: str(v)[:40])
def test_hostile_structured_requests_are_400s_naming_the_field(client, endpoint, body, param):
    r = client.post(f"/{endpoint}", json=body)
    assert r.status_code == 400, r.text[:500]
    assert r.json()["error"]["param"] == param, r.text[:500]
    assert client.post("/completions", json={**COMPLETION, "temperature": 0}).status_code == 200


async def _with_ticker(app, requests):
    """Run `requests(http)` against the app on this event loop while a 10 ms ticker measures how late the loop
    wakes it; (result, the worst lateness in seconds)."""
    lateness = []

    async def tick():
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            lateness.append(time.perf_counter() - started - 0.01)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiffin", timeout=10) as http:
        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)  # the ticker is running
        try:
            return await requests(http), max(lateness, default=0.0)
        finally:
            ticker.cancel()


def test_schema_checks_run_off_the_event_loop(api, monkeypatch):
    from tiffin.engine.structured import params

    check = params.check_json_schema
    monkeypatch.setattr(params, "check_json_schema", lambda schema: time.sleep(1.0) or check(schema))
    body = _structured(json={"type": "integer", "minimum": 0, "maximum": 9})
    r, lateness = asyncio.run(_with_ticker(api.app, lambda http: http.post("/completions", json=body)))
    assert r.status_code == 200 and lateness < 0.3, (r.text[:300], lateness)


@pytest.fixture
def slow_compiles(monkeypatch):
    """Compiles of grammars that mention 'slow-marker' wait until the returned event is set."""
    release = structured_specs.slow_compiles(monkeypatch, "slow-marker")
    yield release
    release.set()


def test_a_slow_compile_does_not_hold_back_other_requests(api, slow_compiles):
    async def requests(http):
        slow = asyncio.create_task(http.post("/completions", json=_structured(choice=["slow-marker"])))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        try:
            quick = await asyncio.wait_for(http.post("/completions", json=_structured(choice=["quick", "fast"])), 5)
        finally:
            slow_compiles.set()
        return quick, time.monotonic() - started, await slow

    (quick, elapsed, slow), lateness = asyncio.run(_with_ticker(api.app, requests))
    assert quick.status_code == 200 and elapsed < 2.0, (quick.text[:300], elapsed)
    assert slow.status_code == 200 and lateness < 0.3


def test_a_compile_past_its_deadline_is_a_400_naming_the_setting(openai_app, slow_compiles):
    with openai_app(num_kv_blocks=64, grammar_compile_timeout=0.5) as api, TestClient(api.app) as client:
        body = _response_format({"enum": ["slow-marker", "other"]})
        started = time.monotonic()
        r = client.post("/chat/completions", json=body)
        assert r.status_code == 400 and time.monotonic() - started < 2.0, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == "response_format" and "grammar_compile_timeout=0.5" in error["message"]
        assert client.post("/completions", json=_structured(choice=["served"])).status_code == 200
        slow_compiles.set()  # the compile finishes in the background and is cached: a retry is served at once
        deadline = time.monotonic() + 10
        while (r := client.post("/chat/completions", json=body)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200, r.text[:300]


def test_a_grammar_larger_than_the_cache_is_a_400_naming_the_setting(openai_app):
    with openai_app(num_kv_blocks=64, grammar_cache_bytes=32 << 10) as api, TestClient(api.app) as client:
        r = client.post("/completions", json=_structured(choice=[f"option number {i}" for i in range(300)]))
        assert r.status_code == 400 and "grammar_cache_bytes" in r.json()["error"]["message"], r.text[:300]
        assert client.post("/completions", json=_structured(choice=["yes", "no"])).status_code == 200
