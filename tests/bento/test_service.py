"""The Bento end to end: one real `bentoml serve` process on a loopback port, driven by the official `openai`
client, raw HTTP and `bentoml.SyncHTTPClient`; results checked against the offline `LLM` on the same weights.

The server runs the built-in tiny llama (`model=tiffin-tiny-llama`, written into a scratch BentoML model store
on first start), which is byte-identical to the `tiny_model` fixture's checkpoint. Loading waits on a gate
file, so /readyz is seen answering 503 before the weights load.
"""

import http.client
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
bentoml = pytest.importorskip("bentoml")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tiffin import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NUM_KV_BLOCKS = 256  # passed as `--arg`; the kv total gauge shows it arrived
MODEL = "tiffin-tiny-llama"
CONTEXT = 1024  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def server(bento_server, tmp_path_factory):
    gate = tmp_path_factory.mktemp("gate") / "load-gate"
    srv = bento_server(
        args={"model": MODEL, "num_kv_blocks": NUM_KV_BLOCKS},
        # every request here verifies n-gram proposals (of one token: the tiny model repeats few longer ones)
        env={
            "TIFFIN_LOAD_GATE": str(gate),
            "TIFFIN_MAX_NUM_SEQS": "16",
            "TIFFIN_SPECULATIVE_CONFIG": '{"method": "ngram", "prompt_lookup_min": 1}',
        },
        ready="/livez",
        timeout=90,
    )
    time.sleep(0.5)  # the loader is parked on the gate: readiness must not flip by itself
    srv.before_load = (srv.status("/readyz"), srv.http.get("/v1/models"))
    gate.touch()
    srv.wait("/readyz", 200, timeout=120)
    return srv


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("llama"), num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0]


def test_readyz_503_until_weights_load(server):
    status, models = server.before_load
    assert status == 503
    assert models.status_code == 503 and "loading" in models.json()["error"]["message"]
    assert server.status("/readyz") == 200 and server.status("/livez") == 200


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completion_equals_offline_llm(client, llm):
    ref = greedy(llm, "Hello, tiffin", max_tokens=24)
    resp = client.completions.create(model=MODEL, prompt="Hello, tiffin", max_tokens=24, temperature=0)
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # token-id prompts, several prompts, n > 1: choice i*n + j is sample j of prompt i
    prompts = [ref.prompt_token_ids, "The quick brown fox"]
    resp = client.completions.create(model=MODEL, prompt=[prompts[1]], max_tokens=9, temperature=0, n=2)
    assert [c.text for c in resp.choices] == [greedy(llm, prompts[1], max_tokens=9).outputs[0].text] * 2
    resp = client.completions.create(
        model=MODEL,
        prompt=[ref.prompt_token_ids, [5, 6, 7]],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    texts = [greedy(llm, p, max_tokens=8, ignore_eos=True).outputs[0].text for p in (ref.prompt_token_ids, [5, 6, 7])]
    assert [c.index for c in resp.choices] == [0, 1] and [c.text for c in resp.choices] == texts
    assert resp.usage.completion_tokens == 16


def test_completion_stream_with_stop_and_usage(client, llm):
    free = greedy(llm, "The quick brown fox", max_tokens=40).outputs[0].text
    stop = free[10:13]
    ref = greedy(llm, "The quick brown fox", max_tokens=40, stop=[stop])
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=40,
            temperature=0,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text == free[: free.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_completions_stream_and_non_stream(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_logprobs_match_offline(client, llm):
    ref = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    assert lp.tokens == [d[t].decoded_token for t, d in zip(ref.token_ids, ref.logprobs)]
    for top, d in zip(lp.top_logprobs, ref.logprobs):
        best = sorted(d.values(), key=lambda x: x.rank)[:3]
        assert top == pytest.approx({x.decoded_token: x.logprob for x in best}, abs=1e-5)
    chat = (
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        .choices[0]
        .logprobs.content
    )
    assert len(chat) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in chat)


MALFORMED = [  # (endpoint, body, status, param)
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("completions", {"max_tokens": 5}, 400, "prompt"),
    ("completions", {"prompt": [-3, 5]}, 400, "prompt"),
    ("completions", {"prompt": [5, 10**6]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [7] * (CONTEXT + 10)}, 400, "prompt"),
    ("completions", {"prompt": [7] * (CONTEXT - 10), "max_tokens": 50}, 400, None),
    ("completions", {"prompt": 123}, 400, "prompt"),
    ("completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("completions", b'{"prompt": "x",', 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
        400,
        "logprobs",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_tokens",
    ),
]


def test_malformed_requests_get_openai_errors(server):
    for endpoint, body, status, param in MALFORMED:
        raw = isinstance(body, bytes)
        kw = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
        r = server.http.post(f"/v1/{endpoint}", **kw)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
        assert error["param"] == param, (body, error)
    assert len(MALFORMED) >= 15
    assert server.status("/readyz") == 200
    assert server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disconnects_abort_and_free_kv_blocks(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    generated = server.metrics()["tiffin_generation_tokens_total"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        assert [r.status_code for r in responses] == [200] * 3
        readers = [r.iter_lines() for r in responses]  # keep them: dropping a reader closes its connection
        for lines in readers:
            assert all(next(line for line in lines if line.startswith("data: ")) for _ in range(3))
        busy = server.metrics()
        for s in streams:
            s.__exit__(None, None, None)
    assert busy["tiffin_requests_running"] == 3 and busy["tiffin_kv_cache_blocks_used"] > 0
    assert busy["tiffin_kv_cache_blocks_total"] == NUM_KV_BLOCKS
    idle = _assert_idle_soon(server)
    assert idle["tiffin_generation_tokens_total"] - generated < 3 * body["max_tokens"]  # cut short, not finished
    # a non-streamed request whose client gives up is aborted too; 16 samples of 1,000 tokens take seconds even
    # where one sample runs in well under one
    n = 16
    with pytest.raises(httpx.TimeoutException):
        server.http.post("/v1/completions", json={**body, "stream": False, "n": n}, timeout=0.5)
    after = _assert_idle_soon(server)
    assert after["tiffin_generation_tokens_total"] - idle["tiffin_generation_tokens_total"] < n * body["max_tokens"]


def _assert_idle_soon(server, within: float = 5.0) -> dict:
    deadline = time.monotonic() + within
    while (m := server.metrics())["tiffin_requests_running"] or m["tiffin_kv_cache_blocks_used"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    return m


def test_sync_http_client(server, llm):
    ref = greedy(llm, "Hello, tiffin", max_tokens=16).outputs[0].text
    with bentoml.SyncHTTPClient(server.url) as c:
        assert c.generate(prompt="Hello, tiffin", max_tokens=16, temperature=0) == ref
        assert "".join(c.generate_stream(prompt="Hello, tiffin", max_tokens=16, temperature=0)) == ref
        with pytest.raises(bentoml.exceptions.BentoMLException, match="temperature"):
            c.generate(prompt="x", temperature=-1)


COERCIBLE = [  # (field, value): what a lax validator would run as another value
    ("max_tokens", True),
    ("max_tokens", "4"),
    ("max_tokens", 4.0),
    ("seed", "12"),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("temperature", "0.5"),
    ("top_k", False),
    ("prompt", 5),
]


@pytest.mark.parametrize("api", ["generate", "generate_stream"])
def test_typed_endpoints_take_json_types_as_the_v1_routes_do(server, api):
    for field, value in COERCIBLE:
        r = server.http.post(f"/{api}", json={"prompt": "x", "max_tokens": 2, field: value})
        assert r.status_code == 400, (field, value, r.text)
        body = r.json()  # BentoML's shape for a validation error, naming the field
        assert "validation error" in body["error"] and [d["loc"][-1] for d in body["detail"]] == [field], body
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": 12, "ignore_eos": True}
    assert server.http.post(f"/{api}", json=body).status_code == 200  # a JSON integer is a valid float


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """httpx and the openai SDK keep an idle connection 5 s; uvicorn closed it at 5 s too, and a client reusing it
    as it closed got a reset. The server now waits longer: a request 6 s after the last is answered."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for pause in (0, 6):
            time.sleep(pause)
            conn.request("GET", "/livez")
            response = conn.getresponse()  # RemoteDisconnected if the server closed the connection
            assert response.status == 200 and response.read(), f"after {pause} s idle"
            assert conn.sock is not None  # the same connection
    finally:
        conn.close()


def test_metrics(server, client):
    before = server.metrics()
    client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    assert after["tiffin_generation_tokens_total"] - before["tiffin_generation_tokens_total"] == 40
    spec = {
        k: after[f"tiffin_spec_decode_num_{k}_total"] - before.get(f"tiffin_spec_decode_num_{k}_total", 0)
        for k in ("drafts", "draft_tokens", "accepted_tokens")
    }
    assert 0 < spec["drafts"] <= spec["draft_tokens"] and spec["accepted_tokens"] <= spec["draft_tokens"], spec
    samples = [s for f in text_string_to_metric_families(server.http.get("/metrics").text) for s in f.samples]
    per_pos = {s.labels["position"]: s.value for s in samples if s.name.endswith("accepted_tokens_per_pos_total")}
    accepted = next(s.value for s in samples if s.name == "tiffin_spec_decode_num_accepted_tokens_total")
    assert sorted(per_pos) == ["0", "1", "2", "3"] and sum(per_pos.values()) == accepted, per_pos  # 4 proposals
    assert after["tiffin_prompt_tokens_total"] > before["tiffin_prompt_tokens_total"]
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"tiffin_{name}_count"] == before[f"tiffin_{name}_count"] + 1
    assert "tiffin_preemptions_total" in after and after["tiffin_requests_waiting"] == 0
    assert after["tiffin_kv_cache_bytes_per_token"] > 0 and after["tiffin_requests_swapped"] == 0
    assert after["tiffin_prefill_tokens_total"] > before.get("tiffin_prefill_tokens_total", 0)
    assert after["tiffin_prefix_cache_queries_total"] >= after["tiffin_prefix_cache_hits_total"]
    for name in (
        "prefix_cache_host_hits",
        "prefix_cache_host_evictions",
        "swapped_out_sequences",
        "swapped_in_sequences",
    ):
        assert f"tiffin_{name}_total" in after
    assert "tiffin_host_kv_cache_bytes_used" in after


def test_structured_outputs_and_tools_through_the_bento(server, client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=8)
        kind: Literal["cat", "dog"]

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "not": {"const": 1}}}}
    r = server.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "response_format": bad}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format" and "'not'" in r.text
    pet = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A pet"}], response_format=Pet, temperature=0, max_tokens=100
    )
    assert isinstance(pet.choices[0].message.parsed, Pet)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Call f"}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls] == [("f", "{}")]
    with bentoml.SyncHTTPClient(server.url) as c:
        assert c.generate(prompt="Yes?", structured_outputs={"choice": ["yes", "no"]}, temperature=0) in ("yes", "no")
        with pytest.raises(bentoml.exceptions.BentoMLException, match="regex is invalid"):
            c.generate(prompt="x", structured_outputs={"regex": "a("})


def test_responses_api_through_the_bento(client):
    """The Responses API as OpenAI's Agents SDK calls it: plain, streamed, a function tool round trip through
    `function_call_output` and `previous_response_id`, and `text.format` json_schema."""
    ask = {"model": MODEL, "input": "Hello", "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and whole.usage.output_tokens == 8
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    called = client.responses.create(
        model=MODEL, input="Call f", tools=[tool], tool_choice="required", temperature=0, max_output_tokens=100
    )
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "f" and isinstance(json.loads(call.arguments), dict)
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
        max_output_tokens=4,
        temperature=0,
    )
    assert answered.output_text and answered.usage.input_tokens > called.usage.input_tokens
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"format": {"type": "json_schema", "name": "ok", "schema": schema}}
    shaped = client.responses.create(model=MODEL, input="JSON", text=fmt, temperature=0, max_output_tokens=60)
    assert isinstance(json.loads(shaped.output_text)["ok"], bool)
    assert client.responses.retrieve(called.id).id == called.id


def test_messages_api_through_the_bento(server):
    """Anthropic's client against the Messages API: plain, streamed (== plain for greedy), a tool use round trip,
    and the key given as `x-api-key` (the client's header)."""
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    greedy = {"model": MODEL, "max_tokens": 8, "extra_body": {"temperature": 0}}
    ask = [{"role": "user", "content": "Hello"}]
    message = claude.messages.create(messages=ask, **greedy)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    with claude.messages.stream(messages=ask, **greedy) as stream:
        assert stream.get_final_text() == message.content[0].text
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    called = claude.messages.create(
        messages=[{"role": "user", "content": "Call f"}],
        tools=[tool],
        tool_choice={"type": "tool", "name": "f"},
        **{**greedy, "max_tokens": 100},
    )
    use = next(block for block in called.content if block.type == "tool_use")
    assert called.stop_reason == "tool_use" and use.name == "f" and isinstance(use.input, dict)
    answered = claude.messages.create(
        messages=[
            {"role": "user", "content": "Call f"},
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
        ],
        **greedy,
    )
    assert answered.content[0].type == "text" and answered.usage.input_tokens > called.usage.input_tokens
