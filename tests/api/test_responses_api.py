"""The Responses API through the `openai` client, in-process: plain, streamed (the events add up to the non-streamed
Response), a function tool round trip through `function_call_output` and `previous_response_id`, `text.format`
json_schema, the store (owner-only, bounded, expiring), reasoning items from a thinking model, and refusals naming
the Responses API's fields."""

import json
import time

import jsonschema
import pytest
from references import work_on_the_loop

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from tiffin.plugin.openai import responses_request  # noqa: E402
from tiffin.plugin.openai.store import ResponseStore  # noqa: E402

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}
GREEDY = {"model": "tiny", "temperature": 0}


@pytest.fixture(scope="module")
def http(openai_app):
    with openai_app(num_kv_blocks=256, max_num_seqs=16) as api, TestClient(api.app) as http:
        yield http


def client(http, key: str = "key-a") -> "openai.OpenAI":
    return openai.OpenAI(base_url="http://testserver", api_key=key, http_client=http, max_retries=0)


def streamed(client, **body) -> tuple[list, dict]:
    """The events of a streamed request, and the Response its last event carries."""
    events = list(client.responses.create(stream=True, **body))
    return events, events[-1].response.model_dump()


def comparable(response: dict) -> list:
    """What two runs of one greedy request share: the output items without their ids."""
    drop = ("id", "call_id")
    return [{k: v for k, v in item.items() if k not in drop} for item in response["output"]]


def test_plain_and_streamed_agree(http):
    c = client(http)
    whole = c.responses.create(input="Tell me about Oslo", max_output_tokens=12, **GREEDY)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    events, final = streamed(c, input="Tell me about Oslo", max_output_tokens=12, **GREEDY)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final["output"][0]["content"][0]["text"]
    assert comparable(final) == comparable(whole.model_dump())


def test_function_tool_round_trip(http):
    c = client(http)
    first = c.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        **GREEDY,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    events, final = streamed(
        c,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        **GREEDY,
    )
    assert comparable(final) == comparable(first.model_dump())
    arguments = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in arguments] == [call.arguments]
    answer = c.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        max_output_tokens=6,
        **GREEDY,
    )
    assert answer.output_text and answer.previous_response_id == first.id
    # the follow-up ran the whole conversation: its prompt holds the first one's, and the tool's output
    assert answer.usage.input_tokens > first.usage.input_tokens + len("sunny, 21 C") // 4


def test_a_required_call_cut_off_by_max_output_tokens(http):
    """tool_choice required and max_output_tokens cutting the call: no output_text of its markup, streamed or not
    (#50); the Response is incomplete, for max_output_tokens."""
    c = client(http)
    ask = dict(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=5, **GREEDY)
    whole = c.responses.create(**ask).model_dump()
    _, last = streamed(c, **ask)
    assert whole["status"] == last["status"] == "incomplete"
    assert whole["incomplete_details"] == last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert comparable(whole) == comparable(last) == []


def test_text_format_json_schema(http):
    body = {"text": {"format": {"type": "json_schema", "name": "ab", "schema": SCHEMA}}, "max_output_tokens": 120}
    response = client(http).responses.create(input="json please", **body, **GREEDY)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    events, final = streamed(client(http), input="json please", **body, **GREEDY)
    assert comparable(final) == comparable(response.model_dump())
    with client(http).responses.stream(input="json please", **body, **GREEDY) as stream:
        for _ in stream:
            pass
    assert stream.get_final_response().output_text == response.output_text  # the SDK's own accumulation


def test_store_is_per_key(http):
    a, b = client(http, "key-a"), client(http, "key-b")
    response = a.responses.create(input="remember me", max_output_tokens=2, **GREEDY)
    assert a.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(previous_response_id=response.id, input="and?", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(response.id)
    a.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(response.id)
    unstored = a.responses.create(input="forget me", store=False, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


def test_store_bounds():
    store = ResponseStore(max_entries=3, max_bytes=2000, ttl=3600)
    for i in range(5):
        store.put("a", {"id": f"r{i}", "text": "x" * 100}, [])
    assert len(store) == 3 and store.get("a", "r0") is None and store.get("a", "r4") is not None
    store.put("a", {"id": "big", "text": "x" * 1950}, [])
    assert store.num_bytes <= 2000 and store.get("a", "big") is not None and len(store) == 1
    store.put("a", {"id": "huge", "text": "x" * 5000}, [])  # larger than the store: not kept
    assert store.get("a", "huge") is None and store.num_bytes <= 2000
    short = ResponseStore(ttl=0.05)
    short.put(None, {"id": "r"}, [])
    time.sleep(0.1)
    assert short.get(None, "r") is None and len(short) == 0


def test_one_keys_churn_evicts_only_its_own_responses():
    """Key B's 1,001 tiny stored responses do not push key A's out of the store (#50): each key pays for its own."""
    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.clients import client_id

    store = ResponseStore()  # 1,000 entries in all
    a, b = client_id(b"key-a"), client_id(b"key-b")
    store.put(a, {"id": "resp_a", "object": "response"}, [])
    for i in range(1001):
        store.put(b, {"id": f"resp_b{i}", "object": "response"}, [])
    with TestClient(create_app(None, store)) as http:  # no engine: a GET reads the store alone
        assert http.get("/responses/resp_a", headers={"authorization": "Bearer key-a"}).status_code == 200
        assert http.get("/responses/resp_b0", headers={"authorization": "Bearer key-b"}).status_code == 404
        assert http.get("/responses/resp_b1000", headers={"authorization": "Bearer key-b"}).status_code == 200
    assert len(store) <= 1000 and store.held_by(a) == (1, store.get(a, "resp_a").size)


def test_the_store_keeps_a_quota_per_key_in_entries_and_bytes():
    store = ResponseStore(max_entries=10, max_bytes=4000, owners=2)  # each key: 5 entries, 2,000 bytes
    for i in range(3):
        store.put("a", {"id": f"a{i}"}, [])
    for i in range(20):
        store.put("b", {"id": f"b{i}"}, [])
    assert store.held_by("a")[0] == 3 and store.held_by("b")[0] == 5 and store.get("b", "b19") is not None
    for i in range(4):
        store.put("b", {"id": f"big{i}", "text": "x" * 900}, [])
    assert store.held_by("b")[1] <= 2000 and store.get("b", "big3") is not None and store.held_by("a")[0] == 3
    store.put("b", {"id": "huge", "text": "x" * 2500}, [])  # over B's quota, though not the store's: not kept
    assert store.get("b", "huge") is None and store.get("b", "big3") is not None
    for owner in "cdef":  # more keys than the store was sized for: the sum limit holds, the largest pays
        for i in range(5):
            store.put(owner, {"id": f"{owner}{i}"}, [])
    assert len(store) <= 10 and store.num_bytes <= 4000 and store.held_by("a")[0] >= 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}, "text"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_123"}, "conversation"),
        ({"input": "hi", "conversation": {"id": "conv_123"}}, "conversation"),
        ({"input": "hi", "prompt": {"id": "pmpt_123", "variables": {"city": "Oslo"}}}, "prompt"),
        ({"input": "hi", "instructions": "lorem ipsum " * 400_000}, "instructions"),  # far past the context
        ({"input": "hi", "instructions": "lorem ipsum " * 2000}, "instructions"),  # past it in tokens
        ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": 3}, "input"),
        # what a Response echoes and the store keeps is bounded (#50)
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": "hi", "tools": [{**WEATHER, "extra": "x" * 1000}]}, "tools"),
        (
            {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather", "x": 1}},
            "tool_choice",
        ),
        ({"input": "hi", "text": {"format": {"type": "text"}, "extra": [1] * 1000}}, "text"),
        ({"input": "hi", "text": {"format": {"type": "text", "extra": 1}}}, "text"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": {}}}}, "text"),
        ({"input": "hi", "text": {"verbosity": "loud"}}, "text"),
    ],
)
def test_refusals_name_the_field(http, body, param):
    r = http.post("/responses", json={"model": "tiny", **body})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_echoed_fields_within_openais_bounds_are_echoed_and_stored(http):
    metadata = {f"{i:0>64}": "v" * 512 for i in range(16)}
    text = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}, "verbosity": "low"}
    tool = {**WEATHER, "description": "the weather", "strict": False}
    body = {"input": "hi", "max_output_tokens": 2, "metadata": metadata, "tools": [tool], "text": text, **GREEDY}
    r = http.post("/responses", json=body, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["metadata"] == metadata and answer["tools"] == [tool] and answer["text"] == text
    stored = http.get(f"/responses/{answer['id']}", headers={"authorization": "Bearer key-a"})
    assert stored.status_code == 200 and stored.json() == answer


def test_the_store_holds_and_counts_the_encoded_json():
    store = ResponseStore()
    response = {"id": "r", "metadata": {f"k{i}": "v" for i in range(1000)}}
    store.put("a", response, [{"role": "user", "content": "hi"}])
    entry = store.get("a", "r")
    assert isinstance(entry.response, bytes) and isinstance(entry.messages, bytes)  # not Python objects, 6-8x larger
    assert json.loads(entry.response) == response and json.loads(entry.messages) == [{"role": "user", "content": "hi"}]
    assert store.num_bytes == len(entry.response) + len(entry.messages)


def test_a_large_stored_response_is_answered_without_stalling_the_loop():
    """A GET answers the stored bytes as they are: nothing walks or encodes the response on the event loop (a
    response of 300,000 keys stalled every other request for seconds, on each GET)."""
    from tiffin.plugin.openai.app import create_app

    store = ResponseStore()
    big = {"id": "resp_big", "object": "response", "output": [{"k": i, "v": [i]} for i in range(300_000)]}
    store.put(None, big, [])
    app = create_app(None, store)  # no engine: a GET reads the store alone

    import fastapi.routing

    watched = [(json, "dumps"), (fastapi.routing, "jsonable_encoder")]
    on_loop, r = work_on_the_loop(app, "GET", "/responses/resp_big", watched)
    assert r.status_code == 200 and json.loads(r.content) == big
    assert on_loop == []


@pytest.fixture(scope="module", params=[False, True], ids=["split-markers", "marker-tokens"])
def thinking_http(request, openai_app, thinking_model):
    with (
        openai_app(model=thinking_model(request.param), num_kv_blocks=128) as api,
        TestClient(api.app) as http,
    ):
        yield http


def test_reasoning_items(thinking_http, monkeypatch):
    monkeypatch.setitem(responses_request.EFFORT_BUDGETS, "low", 3)  # a budget the tiny model's output shows
    c = client(thinking_http)
    body = {"input": "think first", "max_output_tokens": 16, "reasoning": {"effort": "low"}, **GREEDY}
    whole = c.responses.create(**body).model_dump()
    events, final = streamed(c, **body)
    assert comparable(final) == comparable(whole)
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"], whole["output"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == whole["output"][0]["content"][0]["text"]
    unbounded = c.responses.create(input="think first", max_output_tokens=8, **GREEDY).model_dump()
    assert [item["type"] for item in unbounded["output"]] == ["reasoning"]  # the random model never closes
    no_thinking = c.responses.create(input="think first", max_output_tokens=8, reasoning={"effort": "none"}, **GREEDY)
    assert [item.type for item in no_thinking.output] == ["message"]


def test_http_errors_are_openai_shaped(http):
    r = http.get("/responses/resp_nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert http.delete("/responses/resp_nothing").status_code == 404
