"""Structured outputs and tools through the OpenAI API, in process, driven by the official `openai` client and
raw HTTP: every refusal is a 400 naming its param and the server keeps serving; streamed == non-streamed;
`chat.completions.parse` with a Pydantic model; a tool-call round trip, streamed and not."""

import json
from typing import Literal

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 3},
        "temp": {"type": "number", "minimum": -30, "maximum": 45},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,5}$"}]},
    },
    "required": ["city", "days", "temp"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]


@pytest.fixture(scope="module")
def http(openai_app):
    with openai_app("qwen2", num_kv_blocks=256) as api, TestClient(api.app) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=str(http.base_url), api_key="unused", http_client=http, max_retries=0)


def _chat(http, **body) -> dict:
    r = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def _sse(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


REFUSALS = [
    ("/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "unknown type 'xml'"),
    ("/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ("/chat/completions", {"response_format": "json"}, "response_format", ""),
    (
        "/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        "response_format",
        "invalid JSON schema",
    ),
    (
        "/chat/completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                },
            }
        },
        "response_format",
        "keyword 'uniqueItems' at #",
    ),
    ("/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex is invalid"),
    ("/completions", {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "grammar is invalid"),
    (
        "/completions",
        {"structured_outputs": {"json": {"type": "string", "format": "iri"}}},
        "structured_outputs",
        "'format'",
    ),
    ("/completions", {"structured_outputs": {"choice": ["a"], "min_tokens": 1}}, "structured_outputs", "unknown field"),
    ("/completions", {"structured_outputs": {"choice": ["a"]}, "min_tokens": 2}, "min_tokens", "structured_outputs"),
    (
        "/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
        "tools",
        "keyword 'not'",
    ),
    (
        "/chat/completions",
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "no function named 'nope'",
    ),
    (
        "/chat/completions",
        {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "only one of",
    ),
]


@pytest.mark.parametrize(("path", "extra", "param", "message"), REFUSALS)
def test_refusals_are_400s_naming_the_param(http, path, extra, param, message):
    body = {"prompt": "Hi"} if path == "/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = http.post(path, json={**body, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    assert _chat(http, max_tokens=2)["usage"]["completion_tokens"] >= 1  # still serving


def test_json_schema_greedy_stream_equals_non_stream(http):
    body = {
        "messages": [{"role": "user", "content": "Weather as JSON"}],
        "temperature": 0,
        "max_tokens": 300,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}},
    }
    message = _chat(http, **body)["choices"][0]
    jsonschema.validate(json.loads(message["message"]["content"]), SCHEMA)
    chunks = _sse(http, "/chat/completions", body)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == message["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == message["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "structured",
    [{"regex": r"[A-Z][a-z]{2,4}-\d{2}"}, {"choice": ["alpha", "beta", "gamma delta"]}, {"json_object": True}],
)
def test_completions_structured_outputs_stream_equals_non_stream(http, structured):
    body = {"prompt": "Say:", "temperature": 0, "max_tokens": 200, "structured_outputs": structured}
    r = http.post("/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if "regex" in structured:
        assert choice["finish_reason"] == "stop" and __import__("re").fullmatch(structured["regex"], choice["text"])
    elif "choice" in structured:
        assert choice["text"] in structured["choice"]
    elif choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    streamed = "".join(c["choices"][0]["text"] for c in _sse(http, "/completions", body))
    assert streamed == choice["text"]


def test_n_samples_each_validate(http):
    body = {
        "n": 3,
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 300,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    }
    for choice in _chat(http, **body)["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_openai_parse_with_a_pydantic_model(client):
    for temperature in (0, 1.0):
        completion = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            temperature=temperature,
            seed=7,
            max_tokens=200,
        )
        assert isinstance(completion.choices[0].message.parsed, Pet)


def _accumulate(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_required_call_cut_off_by_max_tokens(client):
    """tool_choice required and max_tokens cutting the call: no content of its markup, streamed or not (#50)."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kwargs = dict(model="tiny", tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=5)
    choice = client.chat.completions.create(messages=messages, **kwargs).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls
    content, calls, finish = _accumulate(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert (content, calls, finish) == ("", [], "length")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_tool_call_round_trip(client, tool_choice):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kwargs = dict(model="tiny", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice, temperature=0, max_tokens=200)
    kwargs["parallel_tool_calls"] = False  # else a random model keeps calling tools until max_tokens
    first = client.chat.completions.create(messages=messages, **kwargs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, streamed, finish = _accumulate(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert finish == "tool_calls" and content == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert all(c["id"].startswith("call_") for c in streamed)

    messages.append(choice.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 12}'} for c in calls]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=8
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    content, streamed, _ = _accumulate(
        client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=8, stream=True
        )
    )
    assert content == answer.choices[0].message.content and not streamed


def test_grammar_failure_fails_only_that_request(http, monkeypatch):
    from tiffin.engine.structured.backend import GrammarState

    monkeypatch.setattr(GrammarState, "verdict", lambda self, ids: ("error", "the grammar rejected token 7"))
    body = {"prompt": "x", "max_tokens": 5, "structured_outputs": {"regex": "[a-z]+"}}
    r = http.post("/completions", json=body)
    assert r.status_code == 500 and "rejected token 7" in r.json()["error"]["message"]
    chunks = _sse(http, "/completions", body)
    assert "rejected token 7" in chunks[-1]["error"]["message"]
    monkeypatch.undo()
    assert _chat(http, max_tokens=2)["usage"]["completion_tokens"] >= 1
