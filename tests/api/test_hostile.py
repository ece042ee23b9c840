"""Hostile and careless requests against the OpenAI app in-process: each defect a hostile-input run found is
refused by name with a 4xx, a failing request fails alone, adapters are confined at every read, and the engine
keeps serving."""

import asyncio
import json
import math
import os
import shutil

import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tiffin import AsyncLLMEngine, SamplingParams  # noqa: E402
from tiffin.engine.errors import EngineError  # noqa: E402
from tiffin.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from tiffin.plugin.openai.responses import ChatResponses, CompletionResponses  # noqa: E402

BASE = {"prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app(num_kv_blocks=256, max_num_seqs=32) as api:
        yield api


@pytest.fixture(scope="module")
def client(api):
    with TestClient(api.app) as client:
        yield client


def refused(client, body, param, status=400, endpoint="completions"):
    raw = isinstance(body, bytes)
    kw = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
    r = client.post(f"/{endpoint}", **kw)
    assert r.status_code == status, (str(body)[:200], r.text[:500])
    error = r.json()["error"]
    assert error["param"] == param, (str(body)[:200], error)
    return error["message"]


def still_serving(client):
    r = client.post("/completions", json={**BASE, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_top_k_beyond_the_vocabulary(client):
    for top_k in (2**63, 10**6):
        assert "top_k" in refused(client, {**BASE, "top_k": top_k}, "top_k")
    still_serving(client)


def test_lone_surrogates(client):
    chat = '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    refused(client, b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt")
    refused(client, chat.encode(), "messages", endpoint="chat/completions")
    refused(client, b'{"prompt": "hi", "model": "m\\ud800"}', "model")
    refused(client, b'{"prompt": "hi", "stop": ["\\udfff"]}', "stop")
    # a surrogate pair is one valid character
    pair = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'
    assert client.post("/completions", content=pair, headers={"content-type": "application/json"}).status_code == 200
    still_serving(client)


def test_prompt_far_beyond_the_context_is_not_tokenized(client, api, monkeypatch):
    tokenizer = api.engine.tokenizer
    lengths = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: lengths.append(len(text)) or encode(text, *a, **kw))
    huge = "lorem ipsum " * 400_000  # 4.8 MB
    assert "context length" in refused(client, {**BASE, "prompt": huge}, "prompt")
    chat = {"messages": [{"role": "user", "content": huge}]}
    refused(client, chat, "messages", endpoint="chat/completions")
    assert all(n < 1_000_000 for n in lengths), lengths
    monkeypatch.undo()
    still_serving(client)


def test_stop_lists_are_capped(client):
    refused(client, {**BASE, "stop_token_ids": list(range(1_000_000)), "min_tokens": 2, "n": 8}, "stop_token_ids")
    refused(client, {**BASE, "stop": ["x"] * 1000}, "stop")
    refused(client, {**BASE, "stop": "x" * 100_000}, "stop")
    still_serving(client)


def test_n_is_bounded(client):
    assert "n" in refused(client, {**BASE, "n": 10_000}, "n")
    still_serving(client)


def test_seed_out_of_range_names_seed(client):
    refused(client, {**BASE, "seed": 2**70}, "seed")
    refused(client, {**BASE, "seed": -(2**70)}, "seed")
    seeded = {**BASE, "seed": 2**63 - 1, "n": 2, "temperature": 1.0}
    assert client.post("/completions", json=seeded).status_code == 200


def test_unsupported_fields_are_refused_by_name(client):
    refused(client, {**BASE, "best_of": 2}, "best_of")
    refused(client, {**BASE, "stream_options": {"include_usage": True}}, "stream_options")
    refused(client, {**BASE, "stream": False, "stream_options": {"include_usage": True}}, "stream_options")
    assert client.post("/completions", json={**BASE, "best_of": 1}).status_code == 200


def test_priority_out_of_range_says_so(client):
    for priority in (2**63, -(2**63) - 1):
        message = refused(client, {**BASE, "priority": priority}, "priority")
        assert "64-bit" in message and "range" in message, message
    assert client.post("/completions", json={**BASE, "priority": 2**63 - 1}).status_code == 200


def _nested(depth: int) -> str:
    """JSON text of `depth` objects in each other."""
    return '{"a": ' * depth + "1" + "}" * depth


def _call_history(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]


@pytest.mark.parametrize("depth", [200, 5000])  # past the limit; past what json.loads can recurse
def test_deep_tool_call_arguments_are_refused_by_name(client, depth):
    history = _call_history(_nested(depth))
    message = refused(client, {"messages": history, "max_tokens": 2}, "messages", endpoint="chat/completions")
    assert "messages[1].tool_calls[0].function.arguments" in message and "128" in message, message
    message = refused(client, {"messages": history}, "messages", endpoint="tokenize")
    assert "arguments" in message and "128" in message, message
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": _nested(depth)},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    message = refused(client, {"input": items, "max_output_tokens": 2}, "input", endpoint="responses")
    assert "arguments" in message and "128" in message, message
    # within the limit, a call's arguments are read as before
    r = client.post("/tokenize", json={"messages": _call_history(_nested(100))})
    assert r.status_code == 200, r.text
    still_serving(client)


def _raw(client, endpoint: str, body: str):
    return client.post(f"/{endpoint}", content=body.encode(), headers={"content-type": "application/json"})


def test_deep_bodies_are_refused_naming_the_field(client):
    deep = _nested(900)  # json.loads reads it; encoding it again (the store, a chat turn) recursed past the limit
    r = _raw(client, "responses", f'{{"input": "hi", "max_output_tokens": 2, "text": {{"x": {deep}}}}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    assert "128" in r.json()["error"]["message"]
    use = f'{{"type": "tool_use", "id": "t", "name": "f", "input": {{"x": {deep}}}}}'
    turns = f'[{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": [{use}]}}]'
    r = _raw(client, "messages", f'{{"model": "tiny", "max_tokens": 2, "messages": {turns}}}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "messages" in r.json()["error"]["message"]
    r = _raw(client, "chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], "metadata": {deep}}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    # a tool's schema 64 levels deep (the structured-outputs limit) is well within the body's
    schema = '{"type": "object", "properties": {"a": ' * 30 + '{"type": "integer"}' + "}}" * 30
    tool = f'{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}'
    r = _raw(client, "tokenize", f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": [{tool}]}}')
    assert r.status_code == 200, r.text
    still_serving(client)


def test_non_finite_logprobs_never_reach_json():
    out = CompletionOutput(
        0, "ab", [1, 2], "length", None, [{1: Logprob(math.nan, 1, "a")}, {2: Logprob(-math.inf, 1, "b")}]
    )
    final = RequestOutput("r", "p", [3], [out], True)
    for chat in (False, True):
        fmt = (ChatResponses if chat else CompletionResponses)(model="m", n=1, logprobs=1)
        json.dumps(fmt.response([final]), allow_nan=False)
        json.dumps(fmt.delta_events(0, final), allow_nan=False)


# --- failure isolation ---

PROMPTS = [f"request number {i} says" for i in range(16)]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_k=50, seed=i, max_tokens=12, ignore_eos=True, logprobs=2)


async def _run(engine, params: list[SamplingParams], tag: str) -> list:
    async def one(i):
        try:
            return [out async for out in engine.generate(PROMPTS[i], params[i], f"{tag}-{i}")][-1]
        except EngineError as e:
            return e

    return await asyncio.gather(*(one(i) for i in range(len(params))))


def test_one_bad_request_in_a_batch_of_16_fails_alone(tiny_model):
    engine = AsyncLLMEngine.from_engine_args(tiny_model("llama"), num_kv_blocks=256, max_num_seqs=32)
    try:
        clean = asyncio.run(_run(engine, [_params(i) for i in range(16)], "clean"))
        params = [_params(i) for i in range(16)]
        params[6].top_k = 2**63  # the sampler fails on this row...
        engine.engine._check_params = lambda params: None  # ...once validation misses it, as a bug would
        steps = []
        step = engine.engine.step
        engine.engine.step = lambda: steps.append(len(engine.engine.scheduler.running)) or step()
        dirty = asyncio.run(_run(engine, params, "dirty"))
        assert isinstance(dirty[6], EngineError)
        for i in set(range(16)) - {6}:
            assert [o.token_ids for o in dirty[i].outputs] == [o.token_ids for o in clean[i].outputs], i
            assert [o.text for o in dirty[i].outputs] == [o.text for o in clean[i].outputs], i
        assert max(steps) >= 15  # they shared steps with the bad one
        assert engine.healthy
        assert engine.stats().num_running == 0
    finally:
        engine.shutdown()


def test_an_engine_that_cannot_recover_fails_every_request_and_readiness(tiny_model):
    engine = AsyncLLMEngine.from_engine_args(tiny_model("llama"), num_kv_blocks=64)
    try:

        def broken(sched):
            raise RuntimeError("device lost")

        engine.engine.model_runner.execute = broken
        results = asyncio.run(_run(engine, [_params(i) for i in range(4)], "dead"))
        assert all(isinstance(r, EngineError) for r in results)
        assert not engine.healthy
        with pytest.raises(EngineError, match="device lost"):
            asyncio.run(_run_one(engine))
    finally:
        engine.shutdown()


async def _run_one(engine):
    return [out async for out in engine.generate("x", SamplingParams(max_tokens=2))]


# --- LoRA: confinement at every read, bad configs, non-finite weights ---


@pytest.fixture(scope="module")
def lora(tiny_model, openai_app, tmp_path_factory):
    from lora_adapters import make_adapter
    from transformers import AutoModelForCausalLM

    base = tiny_model("llama")
    root, outside = tmp_path_factory.mktemp("roots"), tmp_path_factory.mktemp("outside")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    kw = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    for name, seed, where in (("a", 1, root), ("b", 2, root), ("evil", 3, outside)):
        make_adapter(base, where / name, seed=seed, model=hf, scale=4.0, **kw)
    with (
        openai_app(num_kv_blocks=128, enable_lora=True, max_loras=1, max_cpu_loras=1, lora_roots=str(root)) as api,
        TestClient(api.app) as client,
    ):
        yield client, root, outside


def _load(client, name, path):
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def _text(client, model):
    r = client.post("/completions", json={"model": model, "prompt": "The fox", "max_tokens": 8, "temperature": 0})
    return r.status_code, r.json()


def test_an_evicted_adapter_is_reread_only_from_where_it_was_loaded(lora):
    client, root, outside = lora
    assert _load(client, "evil", outside / "evil").status_code == 400  # outside the roots
    shutil.copytree(outside / "evil", root / "evil-inside")
    assert _load(client, "evil", root / "evil-inside").status_code == 200
    evil = _text(client, "evil")[1]["choices"][0]["text"]
    assert _load(client, "a", root / "a").status_code == 200
    status, body = _text(client, "a")
    assert status == 200
    a_text = body["choices"][0]["text"]
    assert a_text != evil
    assert _load(client, "b", root / "b").status_code == 200
    assert _text(client, "b")[0] == 200  # host cache holds one adapter: "a" is evicted
    assert _text(client, "a")[1]["choices"][0]["text"] == a_text  # re-read from the same files: fine
    assert _text(client, "b")[0] == 200
    (root / "a").rename(root / "a-moved")
    os.symlink(outside / "evil", root / "a")  # the adapter's directory now leads outside the roots
    status, body = _text(client, "a")
    assert status == 400 and "outside the LoRA roots" in body["error"]["message"], body
    os.unlink(root / "a")
    shutil.copytree(root / "evil-inside", root / "a")  # inside the roots, but other files than were loaded
    assert _text(client, "b")[0] == 200
    status, body = _text(client, "a")
    assert status == 400 and "changed" in body["error"]["message"], body
    still_serving(client)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"rank_pattern": [8]}, "rank_pattern"),
        ({"rank_pattern": {"(": 8}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
        ({"target_modules": 5, "r": "4"}, "r"),
    ],
)
def test_bad_adapter_configs_are_400_naming_the_field(lora, change, field):
    client, root, _ = lora
    name = f"cfg-{field}-{abs(hash(json.dumps(change))) % 1000}"
    shutil.copytree(root / "b", root / name)
    config = json.loads((root / name / "adapter_config.json").read_text())
    (root / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
    r = _load(client, name, root / name)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    still_serving(client)


def test_non_finite_adapter_weights_are_refused(lora):
    from safetensors.torch import load_file, save_file

    client, root, _ = lora
    for value in (math.nan, math.inf):
        name = f"nonfinite-{value}"
        shutil.copytree(root / "b", root / name)
        path = root / name / "adapter_model.safetensors"
        tensors = load_file(path)
        key = next(k for k in tensors if "lora_B" in k)
        tensors[key][0, 0] = value
        save_file(tensors, path)
        r = _load(client, name, root / name)
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"], r.text
    r = client.post("/completions", json={"model": "b", "prompt": "The fox", "max_tokens": 3, "logprobs": 2})
    assert r.status_code == 200
