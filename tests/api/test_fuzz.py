"""Property-based request bodies against the OpenAI app in-process (issue #16): fields drawn from each request
model's own annotations, mixed with arbitrary JSON, bounds probed on both sides. Whatever arrives, the answer
is never a 5xx, its JSON is standard (no NaN), and the engine stays healthy and leaks nothing.

Generation stays cheap so thousands of examples run in seconds: `max_tokens` is always present and either 1-2
or out of range, prompts are short, and the engine's `max_n` is small."""

import collections
import json
import os
import sys

import pytest
from structured_specs import nested_schema, ref_chain

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tiffin.plugin.openai.messages import CountTokensRequest, MessagesRequest  # noqa: E402
from tiffin.plugin.openai.protocol import ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest  # noqa: E402
from tiffin.plugin.openai.responses_request import ResponsesRequest  # noqa: E402
from tiffin.plugin.openai.tokenize import DetokenizeRequest, TokenizeRequest  # noqa: E402

pytestmark = [pytest.mark.slow]

EXAMPLES = int(os.environ.get("TIFFIN_FUZZ_EXAMPLES", 2000))
VOCAB = 2048  # the tiny model's

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
valid = lambda strategy, invalid: st.one_of(strategy, strategy, strategy, invalid)  # mostly the first
text = valid(st.text(max_size=40), st.sampled_from(["hi \ud800", "\ud83d\ude00", "", " ", "\x00", "<|im_end|>"]))
unit = valid(st.floats(0, 1), st.floats() | st.integers())
token_ids = valid(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), st.lists(st.integers(), max_size=4))
small_or_out_of_range = valid(st.integers(1, 2), st.integers(max_value=0) | st.integers(min_value=1025))


# Structured outputs on both sides of the limits of tiffin.engine.structured.limits (issue #32): deep, wide, long
# $ref chains, huge patterns and repetition counts, references outside the schema, formats; sizes are sampled
# rather than drawn so that each example stays cheap.
hostile_patterns = st.one_of(
    st.sampled_from([1, 63, 65, 3000]).map(lambda n: "(" * n + "a" + ")" * n),
    st.sampled_from([0, 100_000, 100_001, 2**32, 10**20]).map(lambda n: f"^a{{{n}}}$"),
    st.text(max_size=12),
)
hostile_schemas = st.one_of(
    st.sampled_from([1, 30, 33, 100, 400]).map(nested_schema),
    st.sampled_from([2, 4095, 4097, 6000]).map(lambda n: {"anyOf": [{"type": "integer"}] * n}),
    st.sampled_from([1, 60, 64, 200]).map(ref_chain),
    hostile_patterns.map(lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(["http://example.com/s.json", "file:///etc/passwd", "#x", "#/$defs/none", "#", "#/$defs"]).map(
        lambda ref: {"$defs": {}, "type": "object", "properties": {"a": {"$ref": ref}}}
    ),
    st.sampled_from(["date", "date-time", "time", "ipv4", "ipv6", "uuid", "email", "uri", "hostname", "x"]).map(
        lambda fmt: {"type": "string", "format": fmt}
    ),
)
hostile_structured_outputs = st.one_of(
    hostile_schemas.map(lambda schema: {"json": schema}),
    st.sampled_from([3, 5000]).map(lambda n: {"json": "[" * n + "]" * n}),
    hostile_patterns.map(lambda regex: {"regex": regex}),
    st.sampled_from(["root ::= root", 'root ::= "a" root', "root ::= r0\n" + "r0 ::= r0 r0\n" * 2000]).map(
        lambda grammar: {"grammar": grammar}
    ),
    st.sampled_from([10, 20_000]).map(lambda n: {"choice": [f"choice number {i}" for i in range(n)]}),
)
# Tool-call histories: assistant turns that called tools, well formed or not (issue #32's item 4)
tool_call = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": text}, optional={"arguments": text | json_values}) | json_values},
    optional={"id": text, "type": st.just("function") | text},
)
tool_calls = valid(st.lists(tool_call, max_size=3), json_values | st.lists(json_values, max_size=2))
content = text | st.lists(st.fixed_dictionaries({"type": text, "text": text}), max_size=2)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]) | text}, optional={"content": content}
)
tool_history_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["assistant", "tool"]) | text},
    optional={"content": content, "tool_calls": tool_calls, "tool_call_id": text | json_values},
)
# Responses API input items and Anthropic message blocks, well formed or not
response_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | text},
        optional={"type": st.just("message") | text, "content": content | st.lists(json_values, max_size=2)},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": text, "name": text, "arguments": text | json_values}
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": text | json_values},
        optional={"output": text | json_values},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"]) | text}),
)
anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text, "input": json_values}),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": text}, optional={"content": content, "is_error": st.booleans()}
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "image", "document"]) | text}, optional={"thinking": text}
    ),
)
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]) | text, "content": text | st.lists(anthropic_block, max_size=3)}
)
BY_NAME = {  # fields whose range decides the cost of a request, or that need a shape to get anywhere
    "max_tokens": small_or_out_of_range,
    "max_completion_tokens": small_or_out_of_range,
    "min_tokens": st.integers(0, 2) | st.integers(),
    "n": st.integers(-1, 10) | st.integers(),
    "prompt": text | token_ids | st.lists(text, max_size=3) | st.lists(token_ids, max_size=3),
    "messages": valid(
        st.lists(valid(message, tool_history_message), min_size=1, max_size=3), st.lists(json_values, max_size=2)
    ),
    "stop": text | st.lists(text, max_size=70),
    "stop_token_ids": st.lists(st.integers(-2, VOCAB) | st.integers(), max_size=70),
    "top_k": st.integers(-2, VOCAB + 2) | st.integers(),
    "logprobs": st.integers(-1, 21) | st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "seed": st.integers(),
    "temperature": valid(st.floats(0, 2), st.floats() | st.integers()),
    "top_p": unit,
    "min_p": unit,
    "presence_penalty": unit,
    "frequency_penalty": unit,
    "repetition_penalty": valid(st.floats(0.5, 2), st.floats() | st.integers()),
    "model": st.sampled_from(["tiny", "other", "m\ud800"]) | text,
    # structured outputs and tools: nested `Any` that hypothesis cannot draw from the annotations
    "response_format": json_values
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]) | text},
        optional={"json_schema": json_values},
    )
    | hostile_schemas.map(lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
    "structured_outputs": json_values | hostile_structured_outputs,
    "tools": json_values
    | hostile_schemas.map(lambda schema: [{"type": "function", "function": {"name": "f", "parameters": schema}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "chat_template"]), text)
    | json_values,
    "tokens": token_ids | st.lists(st.integers(-1, VOCAB), max_size=4),
    "max_output_tokens": small_or_out_of_range,
    "input": text | st.lists(response_item, max_size=3),
    "text": json_values
    | st.fixed_dictionaries(
        {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])})}
    )
    | hostile_schemas.map(lambda schema: {"format": {"type": "json_schema", "name": "x", "schema": schema}}),
    "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "minimal", "low", "high", "max"]) | text}),
    "previous_response_id": text,
    "anthropic_messages": st.lists(anthropic_message, min_size=1, max_size=3) | st.lists(json_values, max_size=2),
    "stop_sequences": st.lists(text, max_size=70),
    "thinking": json_values
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive"])}, optional={"budget_tokens": st.integers()}
    ),
}


def _annotated(annotation) -> st.SearchStrategy:
    """The annotation's own strategy, else arbitrary JSON (e.g. for `Any`, which hypothesis cannot draw)."""
    try:
        strategy = st.from_type(annotation)
        strategy.validate()  # resolves the lazy strategy now rather than at the first draw
        return strategy
    except Exception:
        return json_values


def body_strategy(model, required: str | None, **named: str) -> st.SearchStrategy:
    """The length limit where the model has one (`max_tokens`, `max_output_tokens`) and the `required` field
    (mostly), plus up to three other fields, each typed by the model (mostly). `named`: fields drawn from another
    BY_NAME entry than their own name's (an API's `messages` of its own shape)."""
    fields = {
        name: valid(BY_NAME.get(named.get(name, name), _annotated(field.annotation)), json_values)
        for name, field in model.model_fields.items()
    }
    base = {name: BY_NAME[name] for name in ("max_tokens", "max_output_tokens") if name in fields}
    if required is not None:
        base[required] = BY_NAME[named.get(required, required)]
    others = sorted(set(fields) - set(base))
    return st.tuples(
        st.fixed_dictionaries(base),
        st.lists(st.sampled_from(others), max_size=3, unique=True).flatmap(
            lambda names: st.fixed_dictionaries({name: fields[name] for name in names})
        ),
    ).map(lambda parts: {**parts[0], **parts[1]})


def anthropic_bodies(model) -> st.SearchStrategy:
    """Bodies of a Messages API route: its messages drawn in Anthropic's shape, its required model mostly ours."""
    return body_strategy(model, "messages", messages="anthropic_messages").map(lambda body: {"model": "tiny", **body})


# (path, its bodies, weight: draws per draw of a weight-1 route): a route to fuzz is one more line. Arbitrary JSON
# goes to every route besides, as often as a weight-1 route is drawn; EXAMPLES are shared by all.
ROUTES = [
    ("/completions", body_strategy(CompletionRequest, "prompt"), 3),
    ("/chat/completions", body_strategy(ChatCompletionRequest, "messages"), 3),
    ("/load_lora_adapter", body_strategy(LoadLoRAAdapterRequest, None), 1),
    ("/tokenize", body_strategy(TokenizeRequest, "prompt") | body_strategy(TokenizeRequest, "messages"), 1),
    ("/detokenize", body_strategy(DetokenizeRequest, "tokens"), 1),
    ("/responses", body_strategy(ResponsesRequest, "input"), 2),
    ("/messages", anthropic_bodies(MessagesRequest), 2),
    ("/messages/count_tokens", anthropic_bodies(CountTokensRequest), 1),
]
# what the last event of a stream is, by route (OpenAI's classic routes end with a [DONE] line)
LAST_EVENTS = {"/responses": ("response.completed", "response.incomplete"), "/messages": ("message_stop",)}
requests = st.one_of(
    *[st.tuples(st.just(path), bodies) for path, bodies, weight in ROUTES for _ in range(weight)],
    st.tuples(st.sampled_from([path for path, _, _ in ROUTES]), json_values),
)


def _standard_json(raw: str):
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(raw, parse_constant=refuse)


@pytest.fixture(scope="module")
def fuzz_client(openai_app):
    with (
        openai_app(num_kv_blocks=128, max_n=4, max_num_seqs=64) as api,
        TestClient(api.app, raise_server_exceptions=False) as client,
    ):
        yield client, api.engine


def test_fuzzed_bodies_never_get_a_5xx(fuzz_client):
    client, engine = fuzz_client
    statuses = collections.Counter()  # (path, status)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests)
    def check(request):
        path, body = request
        content = json.dumps(body, default=lambda m: m.model_dump()).encode()  # escapes lone surrogates
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        statuses[path, r.status_code] += 1
        assert r.status_code < 500, (body, r.text[:500])
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            if path in LAST_EVENTS:
                events = [_standard_json(event) for event in events]
                assert events[-1]["type"] in LAST_EVENTS[path], (body, events[-1])
            else:
                assert events.pop() == "[DONE]"
                events = [_standard_json(event) for event in events]
            for event in events:
                assert "error" not in event and event.get("type") != "error", (body, event)
        else:
            _standard_json(r.text)
        assert engine.healthy

    check()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    generating = ("/completions", "/chat/completions", "/responses", "/messages")
    answered = sum(n for (path, status), n in statuses.items() if status == 200 and path in generating)
    # the engine ran too: ~6% of the bodies generate (131 of 2000 run alone, 99 after other tests' imports, whose
    # constants Hypothesis mixes into its draws), so the bound leaves room for the draws to move
    assert statuses.total() >= EXAMPLES and answered > EXAMPLES // 40, statuses
    assert {path for path, _ in statuses} == {path for path, _, _ in ROUTES}, statuses
    print(f"fuzz statuses: {dict(sorted(statuses.items()))}", file=sys.stderr)
