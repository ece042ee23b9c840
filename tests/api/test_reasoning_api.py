"""A thinking model through /chat/completions: `reasoning_content` apart from the content, streamed as
`delta.reasoning_content` adding up to the non-streamed message (markers split across tokens or single tokens), a
thinking budget that forces the end marker, `chat_template_kwargs` turning thinking off, and tool calls and
structured outputs that apply to the answer, not the thinking."""

import json

import jsonschema
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402

from tiffin.testing.thinking import THINK_END  # noqa: E402

ASK = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
}


@pytest.fixture(scope="module", params=[False, True], ids=["split-markers", "marker-tokens"])
def api(request, openai_app, thinking_model):
    with openai_app(model=thinking_model(request.param), num_kv_blocks=128) as api, TestClient(api.app) as http:
        yield api, http


def chat(http, **body) -> dict:
    r = http.post("/chat/completions", json={**ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed(http, **body) -> tuple[str | None, str, list, str]:
    """(reasoning, content, tool call deltas, finish_reason) of a streamed chat."""
    r = http.post("/chat/completions", json={**ASK, **body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas) or None
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    return reasoning, content, calls, deltas[-1]["finish_reason"]


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_budget_ends_the_thinking_and_splits_the_answer(api, budget):
    http = api[1]
    body = {"thinking_token_budget": budget, "max_tokens": budget + 12, "ignore_eos": True}
    choice = chat(http, **body)
    message = choice["message"]
    assert message["content"] and THINK_END not in message["content"]
    assert bool(message.get("reasoning_content")) == (budget > 0)  # the thinking of a budget of 0 is empty
    reasoning, content, _, finish_reason = streamed(http, **body)
    assert (reasoning, content, finish_reason) == (message.get("reasoning_content"), message["content"], "length")
    alias = {**body, "max_thinking_tokens": body.pop("thinking_token_budget")}
    assert chat(http, **alias) == choice


def test_unbounded_thinking_is_all_reasoning(api):
    http = api[1]
    message = chat(http, max_tokens=10, ignore_eos=True)["message"]
    assert message["reasoning_content"] and message["content"] == ""
    assert streamed(http, max_tokens=10, ignore_eos=True)[:2] == (message["reasoning_content"], "")


def test_thinking_off_in_the_template(api):
    http = api[1]
    off = {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 10, "ignore_eos": True}
    message = chat(http, **off)["message"]
    assert "reasoning_content" not in message and message["content"]
    assert streamed(http, **off)[:2] == (None, message["content"])
    r = http.post("/chat/completions", json={**ASK, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_structured_outputs_apply_to_the_answer(api):
    http = api[1]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    body = {"response_format": fmt, "thinking_token_budget": 4, "max_tokens": 80}
    message = chat(http, **body)["message"]
    assert message["reasoning_content"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert streamed(http, **body)[:2] == (message["reasoning_content"], message["content"])


def test_tool_calls_apply_to_the_answer(api):
    http = api[1]
    body = {
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "thinking_token_budget": 4,
        "max_tokens": 300,
    }
    choice = chat(http, **body)
    message = choice["message"]
    assert message["reasoning_content"] and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    reasoning, _, calls, finish_reason = streamed(http, **body)
    assert reasoning == message["reasoning_content"] and finish_reason == "tool_calls"
    assert "".join(c["function"]["arguments"] for c in calls) == message["tool_calls"][0]["function"]["arguments"]
