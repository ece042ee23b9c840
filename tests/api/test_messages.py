"""Anthropic's Messages API (/v1/messages) in process, driven by the official `anthropic` client and raw HTTP:
messages, streamed events that add up to the non-streamed message, a tool-use round trip, stop reasons, a thinking
model's thinking blocks, and refusals in Anthropic's error shape naming the field.

The client speaks httpx2, which reaches an in-process app only through its async ASGITransport: `claude` runs
one call of the async client; raw HTTP goes through fastapi's TestClient. The client no longer sends sampling
fields (temperature): `GREEDY` passes it as an extra."""

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
httpx2 = pytest.importorskip("httpx2")
pytest.importorskip("xgrammar")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from tiffin.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tiffin.engine.reasoning import ReasoningMarkers  # noqa: E402
from tiffin.plugin.openai.answer import AnswerReader  # noqa: E402
from tiffin.plugin.openai.messages import MessagesBuilder  # noqa: E402
from tiffin.plugin.openai.tools import HermesToolParser  # noqa: E402

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = {"extra_body": {"temperature": 0}}
T = TypeVar("T")


def served(app: FastAPI) -> TestClient:
    """A client of `app` mounted at /v1, as the Bento mounts it (the anthropic client asks for /v1/messages)."""
    root = FastAPI()
    root.mount("/v1", app)
    return TestClient(root)


def claude(http: TestClient, call: "Callable[[anthropic.AsyncAnthropic], Awaitable[T]]") -> T:
    """`call(client)` with the anthropic client of the app `http` serves."""

    async def run() -> T:
        transport = httpx2.ASGITransport(app=http.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://tiffin", timeout=60) as client:
            return await call(
                anthropic.AsyncAnthropic(base_url="http://tiffin", api_key="x", http_client=client, max_retries=0)
            )

    return asyncio.run(run())


def create(http: TestClient, **body) -> "anthropic.types.Message":
    return claude(http, lambda c: c.messages.create(**body))


def streamed(http: TestClient, **body) -> tuple[str, "anthropic.types.Message"]:
    """The text deltas and the final message of the client's stream helper."""

    async def call(c):
        async with c.messages.stream(**body) as stream:
            text = "".join([t async for t in stream.text_stream])
            return text, await stream.get_final_message()

    return claude(http, call)


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app("qwen2", num_kv_blocks=256) as api:
        yield api


@pytest.fixture(scope="module")
def http(api):
    with served(api.app) as client:
        yield client


@pytest.fixture(scope="module", params=[False, True], ids=["split-markers", "marker-tokens"])
def thinking_http(request, openai_app, thinking_model):
    with openai_app(model=thinking_model(request.param), num_kv_blocks=256) as api, served(api.app) as client:
        yield client


def events(http: TestClient, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed request, each name the type its data says."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        text = "".join(r.iter_text())
    assert "[DONE]" not in text
    framed = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n")
        framed.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert framed[-1][0] == framed[-1][1]["type"]
    return framed


def assembled(stream: list[tuple[str, dict]]) -> dict:
    """The message a well-formed event sequence adds up to: message_start, then each block's start, deltas and
    stop (one block open at a time, indexes in order), then message_delta and message_stop."""
    names = [name for name, _ in stream]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    message, open_index = stream[0][1]["message"], None
    assert message["content"] == [] and message["usage"]["input_tokens"] > 0
    for name, data in stream[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(message["content"])
            open_index = data["index"]
            message["content"].append({**data["content_block"], "partial_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = message["content"][open_index], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
            block[key[delta["type"]]] += delta[key[delta["type"]]]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None
    for block in message["content"]:
        partial = block.pop("partial_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
    message.update(stream[-2][1]["delta"])
    message["usage"]["output_tokens"] = stream[-2][1]["usage"]["output_tokens"]
    return message


def post(http: TestClient, **body) -> dict:
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 8, "messages": HELLO, **body})
    assert r.status_code == 200, r.text
    return r.json()


def without_ids(content: list[dict]) -> list[dict]:
    return [{k: v for k, v in block.items() if k != "id"} for block in content]


def test_a_plain_message(http):
    for system in (None, "Be brief.", [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]):
        kwargs = {} if system is None else {"system": system}
        message = create(http, model="tiny", max_tokens=6, messages=HELLO, **GREEDY, **kwargs)
        assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
        assert message.model == "tiny" and [b.type for b in message.content] in (["text"], [])
        assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
        assert message.usage.input_tokens > 0 and 1 <= message.usage.output_tokens <= 6
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    raw = post(http, messages=history, metadata={"user_id": "u1"}, top_k=5, top_p=0.9, seed=3, priority=0)
    assert raw["type"] == "message" and raw["usage"]["output_tokens"] >= 1


def test_streamed_adds_up_to_the_message(http):
    body = {"model": "tiny", "max_tokens": 24, "messages": HELLO, "temperature": 0}
    whole = post(http, **body)
    assert whole["content"], whole
    assembled_stream = assembled(events(http, body))
    assert assembled_stream["content"] == whole["content"]
    assert [assembled_stream[k] for k in ("stop_reason", "stop_sequence")] == [whole["stop_reason"], None]
    assert assembled_stream["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    text, final = streamed(http, model="tiny", max_tokens=24, messages=HELLO, **GREEDY)
    assert text == whole["content"][0]["text"] and final.model_dump(exclude_none=True)["content"] == whole["content"]


def test_stop_sequences_and_max_tokens(http):
    ask = dict(model="tiny", messages=HELLO, **GREEDY)
    full = create(http, max_tokens=24, **ask).content[0].text
    # two characters from its second half (no spaces: the tokenizer may split them; no undecoded bytes)
    middle = range(len(full) // 2, len(full) - 1)
    sequence = next(full[i : i + 2] for i in middle if not {" ", "\ufffd"} & set(full[i : i + 2]))
    stopped = create(http, max_tokens=24, stop_sequences=[sequence], **ask)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    assert [b.text for b in stopped.content] in ([full[: full.find(sequence)]], [])
    short = create(http, max_tokens=2, **ask)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 2)


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}],
    ids=["named", "any"],
)
def test_tool_use_round_trip(http, tool_choice):
    ask = dict(model="tiny", max_tokens=200, tools=[WEATHER, TIME], tool_choice=tool_choice)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = create(http, messages=messages, **ask, **GREEDY)
    assert first.stop_reason == "tool_use" and first.content[-1].type == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    if tool_choice["type"] == "tool":
        assert uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}[uses[0].name])
    raw = assembled(events(http, {**ask, "messages": messages, "temperature": 0}))
    assert without_ids(raw["content"]) == without_ids(first.model_dump(exclude_none=True)["content"])
    assert raw["stop_reason"] == "tool_use"
    _, final = streamed(http, messages=messages, **ask, **GREEDY)
    assert without_ids(final.model_dump(exclude_none=True)["content"]) == without_ids(raw["content"])

    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": '{"temp": 12}'}]},
    ]
    answer = create(http, model="tiny", max_tokens=8, messages=messages, tools=[WEATHER], **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    result_blocks = [{"type": "text", "text": "12 degrees"}]
    messages[-1]["content"] = [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result_blocks}]
    messages[-1]["content"][0]["is_error"] = True
    assert post(http, messages=messages, tools=[WEATHER])["type"] == "message"


@pytest.mark.parametrize(
    "body, status, kind, words",
    [
        ({"max_tokens": None}, 400, "invalid_request_error", ["max_tokens"]),
        ({"messages": []}, 400, "invalid_request_error", ["messages"]),
        ({"max_tokens": 0}, 400, "invalid_request_error", ["max_tokens"]),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", ["messages.0.role"]),
        ({"temperature": "0"}, 400, "invalid_request_error", ["temperature"]),
        ({"stop_sequences": [""]}, 400, "invalid_request_error", ["stop_sequences"]),
        ({"thinking": {"type": "enabled", "budget_tokens": -1}}, 400, "invalid_request_error", ["thinking"]),
        ({"thinking": {"type": "sometimes"}}, 400, "invalid_request_error", ["thinking"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", ["tool_choice.name"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, 400, "invalid_request_error", ["x"]),
        ({"tools": [{"name": "f"}]}, 400, "invalid_request_error", ["tools.0.input_schema"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "url", "url": "x"}}]}]},
            400,
            "invalid_request_error",
            ["messages.0.content.0", "document", "not supported"],
        ),
        (  # a text-only model: the chat path names the part the image became
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            400,
            "invalid_request_error",
            ["messages[0].content[0]", "image", "reads images"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            400,
            "invalid_request_error",
            ["messages.0.content.0", "user message", "tool_use"],
        ),
        (
            {"mcp_servers": [{"type": "url", "url": "https://example.com/sse", "name": "x"}]},
            400,
            "invalid_request_error",
            ["mcp_servers", "not supported"],
        ),
        ({"model": "nope"}, 404, "not_found_error", ["nope"]),
    ],
)
def test_refusals_in_anthropics_shape(http, body, status, kind, words):
    request = {"model": "tiny", "max_tokens": 8, "messages": HELLO, **body}
    r = http.post("/v1/messages", json={k: v for k, v in request.items() if v is not None})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    assert all(w in error["error"]["message"] for w in words), error


def test_errors_elsewhere_stay_openais_and_the_client_raises(http):
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        create(http, model="nope", max_tokens=4, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        create(http, model="tiny", max_tokens=4, messages=HELLO, stop_sequences=[""])


def test_a_failure_mid_stream_is_an_error_event(api, http, fail_step):
    fail_step(api.engine.engine.model_runner, 4, RuntimeError("device lost"))
    with http.stream(
        "POST",
        "/v1/messages",
        json={"model": "tiny", "max_tokens": 30, "messages": HELLO, "stream": True, "temperature": 0},
    ) as r:
        frames = "".join(r.iter_text()).strip().split("\n\n")
    assert frames[0].startswith("event: message_start\n") and frames[-1].startswith("event: error\n")
    error = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))
    assert (
        error["type"] == "error"
        and error["error"]["type"] == "api_error"
        and "device lost" in error["error"]["message"]
    )


def reasoning_of_first_tokens(http: TestClient, n: int) -> str:
    """What the thinking model writes first, greedy: `n` tokens, all of them thinking."""
    body = {"model": "tiny", "messages": HELLO, "max_tokens": n, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["reasoning_content"]


def test_a_thinking_budget_gives_a_thinking_block_then_text(thinking_http):
    """Waits on the engine's thinking budget (`SamplingParams.thinking_token_budget` forcing the end marker)."""
    body = {"model": "tiny", "max_tokens": 24, "messages": HELLO, "temperature": 0}
    body["thinking"] = {"type": "enabled", "budget_tokens": 4}
    whole = post(thinking_http, **body)
    assert [b["type"] for b in whole["content"]][:2] == ["thinking", "text"], whole
    assert whole["content"][0] == {
        "type": "thinking",
        "thinking": reasoning_of_first_tokens(thinking_http, 4),
        "signature": "",
    }
    assert assembled(events(thinking_http, body))["content"] == whole["content"]
    _, final = streamed(thinking_http, **{k: v for k, v in body.items() if k != "temperature"}, **GREEDY)
    assert final.model_dump(exclude_none=True)["content"] == whole["content"]


def test_thinking_streams_as_a_block_disabled_thinks_not(thinking_http):
    """Without a budget a greedy answer is all thinking up to max_tokens; disabled, the template closes the think
    block and all is text."""
    body = {"model": "tiny", "max_tokens": 12, "messages": HELLO, "temperature": 0}
    whole = post(thinking_http, **body)
    assert [b["type"] for b in whole["content"]][0] == "thinking" and whole["stop_reason"] == "max_tokens"
    assert assembled(events(thinking_http, body))["content"] == whole["content"]
    assert post(thinking_http, **body, thinking={"type": "adaptive"})["content"] == whole["content"]
    body["thinking"] = {"type": "disabled"}
    plain = post(thinking_http, **body)
    assert "thinking" not in [b["type"] for b in plain["content"]]
    assert assembled(events(thinking_http, body))["content"] == plain["content"]
    history = [
        *HELLO,
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Hi"}],
        },
        {"role": "user", "content": "Again"},
    ]
    assert post(thinking_http, messages=history)["type"] == "message"


THINK = ReasoningMarkers("deepseek_r1", "<think>", "</think>")
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
BUILT = [
    (AnswerReader(THINK, True), "Let me see.</think>\n\nHi there.", ["thinking", "text"]),
    (AnswerReader(THINK, True), "Only thoughts, cut short", ["thinking"]),
    (
        AnswerReader(THINK, True, HermesToolParser()),
        f"Hm.</think>\n\nChecking.\n{CALL}\n{CALL}",
        ["thinking", "text", "tool_use", "tool_use"],
    ),
    (AnswerReader(None, False, HermesToolParser()), CALL, ["tool_use"]),
    (AnswerReader(), "", []),
]


def test_a_tool_use_cut_off_by_max_tokens_is_dropped_streamed_or_not():
    """A call cut off by max_tokens is no text block (#50), streamed or not: the message is the calls completed
    before it, stop_reason max_tokens."""
    text = f'{CALL}\n<tool_call>\n{{"name": "get_'
    reader = AnswerReader(None, False, HermesToolParser())

    def output(end: int, finished: bool) -> RequestOutput:
        o = CompletionOutput(0, text[:end], list(range(end)), "length" if finished else None)
        return RequestOutput("r", None, [1, 2, 3], [o], finished, num_cached_tokens=1)

    builder = MessagesBuilder("tiny", reader)
    stream = [e for end in range(0, len(text), 3) for e in builder.delta_events(0, output(end, False))]
    final = output(len(text), True)
    stream += builder.delta_events(0, final) + builder.last_events([final])
    whole = MessagesBuilder("tiny", reader).response([final])
    assert [b["type"] for b in whole["content"]] == ["tool_use"] and whole["stop_reason"] == "max_tokens"
    message = assembled([(e["type"], e) for e in stream])
    assert without_ids(message["content"]) == without_ids(whole["content"]) and message["stop_reason"] == "max_tokens"


def test_tool_choice_any_cut_off_by_max_tokens(http):
    ask = dict(model="tiny", max_tokens=5, tools=[WEATHER], tool_choice={"type": "any"}, temperature=0)
    ask["messages"] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    whole = post(http, **ask)
    raw = assembled(events(http, ask))
    assert whole["stop_reason"] == raw["stop_reason"] == "max_tokens"
    assert whole["content"] == raw["content"] == []  # not the call's markup as text


@pytest.mark.parametrize("reader, text, kinds", BUILT)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_the_builder_streams_what_it_answers_whole(reader, text, kinds, step):
    """Outputs that grow `step` characters at a time stream blocks that add up to the whole message, whatever the
    think markers and tool calls are split by."""

    def output(end: int, finished: bool) -> RequestOutput:
        o = CompletionOutput(0, text[:end], list(range(end)), "stop" if finished else None)
        return RequestOutput("r", None, [1, 2, 3], [o], finished, num_cached_tokens=1)

    builder = MessagesBuilder("tiny", reader)
    stream = [e for end in range(0, len(text), step) for e in builder.delta_events(0, output(end, False))]
    final = output(len(text), True)
    stream += builder.delta_events(0, final) + builder.last_events([final])
    whole = MessagesBuilder("tiny", reader).response([final])
    assert [b["type"] for b in whole["content"]] == kinds
    assert whole["usage"] == {"input_tokens": 2, "cache_read_input_tokens": 1, "output_tokens": len(text)}
    message = assembled([(e["type"], e) for e in stream])
    assert without_ids(message["content"]) == without_ids(whole["content"])
    assert message["stop_reason"] == whole["stop_reason"] == ("tool_use" if "tool_use" in kinds else "end_turn")


def test_count_tokens_counts_what_messages_runs(http):
    """/messages/count_tokens: the prompt tokens a Messages request runs (its `usage.input_tokens` with no cache
    hit), tools and system included; refusals in Anthropic's shape."""
    body = {
        "model": "tiny",
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Count me, please"}],
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
    }
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    ran = http.post("/v1/messages", json={**body, "max_tokens": 1, "temperature": 0}).json()["usage"]
    assert counted.json() == {"input_tokens": ran["input_tokens"] + ran["cache_read_input_tokens"]}
    refused = http.post("/v1/messages/count_tokens", json={**body, "messages": []})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
