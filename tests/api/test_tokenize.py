"""/tokenize and /detokenize in process: ids and text as the model's own tokenizer has them, a conversation as
/chat/completions runs it, prompts too long for the context counted (not refused), and every bad input a 400
naming its field."""

import json

import pytest
from references import work_on_the_loop

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app(num_kv_blocks=64) as api:
        yield api


@pytest.fixture(scope="module")
def http(api):
    with TestClient(api.app) as client:
        yield client


def tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(http, path: str, body: dict, status: int = 400) -> str | None:
    """The field a refusal names; the body is sent as JSON escapes it (lone surrogates too)."""
    r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == status, (body, r.status_code, r.text)
    return r.json()["error"]["param"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(text=st.text(max_size=60) | st.text(st.characters(codec="utf-8"), max_size=20), special=st.booleans())
def test_round_trip_is_the_tokenizers_own(http, api, text, special):
    tokenizer = api.engine.tokenizer
    expected = tokenizer.encode(text, add_special_tokens=special)
    if not expected:  # no tokens: refused as an empty prompt is
        assert refused(http, "/tokenize", {"prompt": text, "add_special_tokens": special}) == "prompt"
        return
    answer = tokenize(http, prompt=text, add_special_tokens=special, return_token_strs=True)
    assert answer == {
        "count": len(expected),
        "max_model_len": api.engine.max_model_len,
        "tokens": expected,
        "token_strs": tokenizer.convert_ids_to_tokens(expected),
    }
    r = http.post("/detokenize", json={"tokens": answer["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(expected)}


def test_add_special_tokens_writes_bos_for_a_prompt_by_default(http, api):
    bos = api.engine.tokenizer.bos_token_id
    assert tokenize(http, prompt="hello")["tokens"][0] == bos
    assert tokenize(http, prompt="hello", add_special_tokens=None)["tokens"][0] == bos  # null: the default
    assert bos not in tokenize(http, prompt="hello", add_special_tokens=False)["tokens"]
    assert tokenize(http, prompt="hello")["token_strs"] is None


def test_messages_are_the_tokens_chat_completions_runs(http, api):
    engine = api.engine.engine
    for generation_prompt in (True, False):
        answer = tokenize(http, messages=CHAT, add_generation_prompt=generation_prompt)
        assert answer["tokens"] == engine.render_chat(CHAT, generation_prompt).token_ids
    with_tools = tokenize(http, messages=CHAT, tools=TOOLS)["tokens"]
    assert with_tools == engine.render_chat(CHAT, True, tools=TOOLS).token_ids
    chat = http.post("/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == tokenize(http, messages=CHAT)["count"]
    # the template writes the BOS; add_special_tokens encodes the rendered text as a prompt (vLLM's way)
    bos = api.engine.tokenizer.bos_token_id
    plain = tokenize(http, messages=CHAT)["tokens"]
    assert plain[0] == bos and plain[1] != bos
    assert tokenize(http, messages=CHAT, add_special_tokens=True)["tokens"][:2] == [bos, bos]
    history = [*CHAT, {"role": "assistant", "content": "Hel"}]
    continued = tokenize(http, messages=history, add_generation_prompt=False, continue_final_message=True)
    assert api.engine.tokenizer.decode(continued["tokens"]).endswith("Hel")


def test_a_prompt_too_long_for_the_context_is_counted_not_refused(http, api):
    text = "hello " * api.engine.max_model_len
    answer = tokenize(http, prompt=text)
    assert answer["count"] > answer["max_model_len"] == api.engine.max_model_len
    assert refused(http, "/completions", {"prompt": text, "max_tokens": 1}) == "prompt"  # running it is refused
    long_chat = tokenize(http, messages=[{"role": "user", "content": text}])
    assert long_chat["count"] > api.engine.max_model_len
    r = http.post("/detokenize", json={"tokens": answer["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == api.engine.tokenizer.decode(answer["tokens"])
    assert refused(http, "/tokenize", {"prompt": "x" * (api.engine.engine.max_prompt_chars + 1)}) == "prompt"


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": CHAT}, "messages"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": "", "add_special_tokens": False}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "true"}, "add_special_tokens"),
        ({"prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
        ({"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ({"messages": CHAT, "add_generation_prompt": 0}, "add_generation_prompt"),
        ({"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_tokenize_bodies_are_a_400_naming_the_field(http, body, param):
    assert refused(http, "/tokenize", body) == param
    assert refused(http, "/tokenize", {"prompt": "a", "model": "other"}, 404) == "model"


def test_detokenize_refuses_ids_outside_the_vocabulary_and_too_many(http, api):
    vocab = api.engine.engine.model_config.vocab_size
    for tokens in ([vocab], [-1], [1, 2**63], ["1"], [True], [1.0], "1 2", None):
        assert refused(http, "/detokenize", {"tokens": tokens}) == "tokens", tokens
    assert refused(http, "/detokenize", {"tokens": [1] * (api.engine.engine.max_prompt_chars + 1)}) == "tokens"
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    assert http.post("/detokenize", json={"tokens": [vocab - 1], "model": "tiny"}).status_code == 200


def test_the_root_app_and_an_embedding_model_tokenize(api, tmp_path):
    from tiffin import AsyncLLMEngine
    from tiffin.plugin.openai.app import create_app, create_root_app
    from tiffin.plugin.openai.pooling import PoolingServing
    from tiffin.tiny_bert import make_tiny_bert

    embed = AsyncLLMEngine.from_engine_args(str(make_tiny_bert(tmp_path / "bert")), dtype="float32")
    try:
        v1 = create_app([api.serving, PoolingServing(embed, "tiny-bert")])
        with TestClient(v1) as http, TestClient(create_root_app(v1)) as root:
            assert tokenize(root, prompt="hello world") == tokenize(http, prompt="hello world")  # the chat model's
            bert = tokenize(http, prompt="hello world", model="tiny-bert")
            assert bert["tokens"] == embed.tokenizer.encode("hello world")
            assert root.post("/detokenize", json={"tokens": bert["tokens"], "model": "tiny-bert"}).status_code == 200
            assert root.get("/models").status_code == 404  # the root app serves only the two
    finally:
        embed.shutdown()


def test_at_most_max_tokenize_ids_go_in_or_out(api):
    from tiffin.plugin.openai.app import create_app, create_root_app

    v1 = create_app(api.serving, max_tokenize_ids=8)
    with TestClient(v1) as http, TestClient(create_root_app(v1)) as root:
        for client in (http, root):
            assert tokenize(client, prompt="a b", add_special_tokens=False)["count"] <= 8
            assert refused(client, "/tokenize", {"prompt": "one two three four five six seven eight nine"}) == "prompt"
            assert refused(client, "/tokenize", {"messages": [{"role": "user", "content": "hi " * 20}]}) == "messages"
            assert client.post("/detokenize", json={"tokens": [1] * 8}).status_code == 200
            assert refused(client, "/detokenize", {"tokens": [1] * 9}) == "tokens"


def test_a_huge_answer_is_encoded_off_the_event_loop(api):
    """A few hundred thousand ids and their strings were walked and encoded on the event loop, stalling every
    stream and probe for seconds (0.3-0.55 s here); now the tokenizer and the JSON encoder run on worker threads."""
    import tiffin.plugin.openai.tokenize as tokenize_module

    tokenizer = api.engine.tokenizer
    watched = [(api.engine.engine, "tokenize"), (tokenizer, "convert_ids_to_tokens"), (tokenizer, "decode"),
               (tokenize_module, "dumps")]  # fmt: skip
    text = ("hello world " * 200_000)[: api.engine.engine.max_prompt_chars]  # the longest prompt /tokenize takes
    on_loop, r = work_on_the_loop(
        api.app, "POST", "/tokenize", watched, json={"prompt": text, "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["count"] == len(answer["tokens"]) == len(answer["token_strs"]) >= 100_000
    assert on_loop == []
    on_loop, r = work_on_the_loop(api.app, "POST", "/detokenize", watched, json={"tokens": answer["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] and on_loop == []
