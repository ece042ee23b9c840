"""Prompt logprobs over the OpenAI API, against transformers' log_softmax on the same tiny fp32 llama (1e-4):
/completions with `echo` and `logprobs` (OpenAI's shape: the prompt's tokens first, the first one's logprob null),
streamed and not; vLLM's `prompt_logprobs` field on /completions (per choice) and /chat/completions (per response);
bad values refused by name, the engine serving on."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def api(openai_app):
    with openai_app(num_kv_blocks=64, dtype="float32") as api:
        yield api


@pytest.fixture(scope="module")
def client(api):
    with TestClient(api.app) as client:
        yield client


@pytest.fixture(scope="module")
def prompt(api, tiny_model) -> tuple[list[int], torch.Tensor]:
    """A prompt's token ids and transformers' logprobs at each of its positions."""
    ids = api.engine.tokenizer("The quick brown fox jumps over")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    with torch.inference_mode():
        return ids, hf(torch.tensor([ids])).logits[0].log_softmax(-1)


def completion(client, **body) -> dict:
    r = client.post("/completions", json={"max_tokens": 3, "temperature": 0, "ignore_eos": True} | body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_vllm_prompt_logprobs(got: list, ids: list[int], want: torch.Tensor, k: int) -> None:
    """vLLM's JSON: null, then per token {token id: {logprob, rank, decoded_token}} with its own and the top k."""
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        entry, row = {int(t): lp for t, lp in got[j].items()}, want[j - 1]
        assert ids[j] in entry and len(entry) in (k, k + 1)
        kth = row.topk(max(k, 1)).values[-1]
        for t, lp in entry.items():
            assert abs(lp["logprob"] - row[t].item()) < TOL and lp["rank"] >= 1 and lp["decoded_token"] is not None
            assert t == ids[j] or row[t] >= kth - TOL  # the others: the top k


def test_echo_with_logprobs(client, prompt):
    """The echoed prompt's tokens, then the completion's, as one logprobs list; text the prompt's, then the
    completion's (the completion's part equal to the request without echo)."""
    ids, want = prompt
    plain = completion(client, prompt=ids, logprobs=2)["choices"][0]
    choice = completion(client, prompt=ids, logprobs=2, echo=True)["choices"][0]
    lp, n = choice["logprobs"], len(ids)
    assert choice["text"].endswith(plain["text"]) and len(choice["text"]) > len(plain["text"])
    assert len(lp["tokens"]) == n + 3 and lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:n])
    assert (got - want[torch.arange(n - 1), torch.tensor(ids[1:])]).abs().max() < TOL
    for j in range(1, n):  # each alternative one of the top 2 (texts of two tokens may coincide)
        top2 = want[j - 1].topk(2).values
        assert all((top2 - v).abs().min() < TOL for v in lp["top_logprobs"][j].values())
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=TOL)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert_vllm_prompt_logprobs(choice["prompt_logprobs"], ids, want, 2)


def test_echo_streamed_adds_up_to_echo_whole(client, prompt):
    ids, _ = prompt
    whole = completion(client, prompt=ids, logprobs=1, echo=True, n=2, seed=5, temperature=0.9)["choices"]
    body = {"prompt": ids, "logprobs": 1, "echo": True, "n": 2, "seed": 5, "temperature": 0.9, "max_tokens": 3}
    with client.stream("POST", "/completions", json=body | {"stream": True, "ignore_eos": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for choice in whole:
        chunks = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == choice["logprobs"]["tokens"]
        logprobs = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
        assert logprobs[0] is None and logprobs[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:])


def test_prompt_logprobs_field(client, prompt):
    """vLLM's field: per choice on /completions (no logprobs asked: none), per response on /chat/completions."""
    ids, want = prompt
    choice = completion(client, prompt=ids, prompt_logprobs=3)["choices"][0]
    assert choice["logprobs"] is None
    assert_vllm_prompt_logprobs(choice["prompt_logprobs"], ids, want, 3)
    assert "prompt_logprobs" not in completion(client, prompt=ids)["choices"][0]
    messages = [{"role": "user", "content": "Hi there"}]
    r = client.post("/chat/completions", json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    assert len(got) == r.json()["usage"]["prompt_tokens"] and got[0] is None
    assert all(len(entry) == 1 for entry in got[1:])


@pytest.mark.parametrize(
    "body",
    [
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 21},
        {"prompt_logprobs": "2"},
        {"prompt_logprobs": 1, "stream": True},
        {"logprobs": 21, "echo": True},
    ],
)
def test_bad_prompt_logprobs_refused(client, body):
    r = client.post("/completions", json={"prompt": "Hi", "max_tokens": 2} | body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == next(iter(body)), r.json()
    assert completion(client, prompt="Hi")["usage"]["completion_tokens"] == 3  # still serving
