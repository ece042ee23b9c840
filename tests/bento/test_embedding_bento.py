"""A chat model and an embedding model side by side in one `bentoml serve`: both behind one /v1 (routed by `model`
and task), /readyz ready once both are up, the typed `embed` and `rerank` APIs for `bentoml.SyncHTTPClient`, the
embedding counters in /metrics. Results checked against the offline `LLM` on the same files: the built-in tiny
BERT (`embedding_model=tiffin-tiny-bert`) the server wrote into its model store (a second `make_tiny_bert` could
differ: its WordPiece training orders tied tokens differently from one process to the next)."""

import base64
import struct
import time

import pytest

openai = pytest.importorskip("openai")
bentoml = pytest.importorskip("bentoml")

from tiffin import LLM, PoolingParams  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

MODEL, EMBEDDING_MODEL = "tiffin-tiny-llama", "tiffin-tiny-bert"
NUM_KV_BLOCKS = 128  # the chat engine's; the kv total gauge must show it, not the embedding engine's
TEXTS = ["hello world", "Déjà vu: naïve café, 東京 and 😀", "def main(): return [x ** 2 for x in range(10)]", ""]
QUERY, DOCUMENTS = "how are modules imported", ["import the module", "hello world", "the import system", ""]


@pytest.fixture(scope="module")
def server(bento_server, tmp_path_factory):
    gate = tmp_path_factory.mktemp("gate") / "load-gate"
    srv = bento_server(
        args={"model": MODEL, "embedding_model": EMBEDDING_MODEL, "num_kv_blocks": NUM_KV_BLOCKS},
        env={
            "TIFFIN_LOAD_GATE": str(gate),
            "TIFFIN_MAX_NUM_SEQS": "16",
            "TIFFIN_LORA_ROOTS": str(tmp_path_factory.mktemp("lora-root")),
        },
        ready="/livez",
        timeout=90,
    )
    srv.before_load = srv.status("/readyz")
    gate.touch()
    srv.wait("/readyz", 200, timeout=180)
    return srv


@pytest.fixture(scope="module")
def bert(server):
    stored = server.log.parent / "bentoml" / "models" / EMBEDDING_MODEL  # the server's BentoML home
    return LLM(str(next(p for p in stored.iterdir() if p.is_dir())))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def embedded(llm: LLM, texts: list[str], **params) -> list[list[float]]:
    """Each text's embedding, requested alone."""
    return [llm.embed([t], PoolingParams(**params), use_tqdm=False)[0].outputs.embedding for t in texts]


def close(got: list[list[float]], want: list[list[float]], tol: float = 1e-6) -> bool:
    return len(got) == len(want) and all(max(abs(x - y) for x, y in zip(a, b)) <= tol for a, b in zip(got, want))


def test_both_models_on_one_v1_after_both_load(server, client, bert):
    assert server.before_load == 503
    cards = server.http.get("/v1/models").json()["data"]
    assert [(c["id"], c["tasks"]) for c in cards] == [(MODEL, ["generate"]), (EMBEDDING_MODEL, ["embed", "score"])]
    floats = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS)  # base64 on the wire
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]
    assert close([d.embedding for d in floats.data], embedded(bert, TEXTS))
    ids = bert.embed(TEXTS, use_tqdm=False)
    assert floats.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ids)
    short = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[1], dimensions=16)  # base64, decoded
    assert close([short.data[0].embedding], embedded(bert, TEXTS[1:2], dimensions=16))
    raw = server.http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    blob = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(blob) // 4}f", blob)) == floats.data[0].embedding
    # the chat model answers beside it, and neither does the other's task
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3).usage.completion_tokens == 3
    r = server.http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "serves generate" in r.text
    r = server.http.post("/v1/chat/completions", json={"model": EMBEDDING_MODEL, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and "serves embed, score" in r.text
    # no LoRA adapter of the chat model may take the embedding model's name
    r = server.http.post("/v1/load_lora_adapter", json={"lora_name": EMBEDDING_MODEL, "lora_path": "any"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name" and "another model" in r.text


def test_score_and_rerank_routes(server, bert):
    want = [o.outputs.score for o in bert.score(QUERY, DOCUMENTS, use_tqdm=False)]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    body = server.http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    for path in ("/v1/rerank", "/v2/rerank"):
        body = server.http.post(path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == order[:3], body
        assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order[:3]]


def test_typed_embed_and_rerank(server, bert):
    want = [o.outputs.score for o in bert.score(QUERY, DOCUMENTS, use_tqdm=False)]
    with bentoml.SyncHTTPClient(server.url) as c:
        assert close(c.embed(texts=TEXTS), embedded(bert, TEXTS))
        assert close(
            c.embed(texts=TEXTS[:2], dimensions=8, normalize=False),
            embedded(bert, TEXTS[:2], dimensions=8, normalize=False),
        )
        ranked = c.rerank(query=QUERY, documents=DOCUMENTS, top_n=2)
        assert [r["index"] for r in ranked] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])[:2]
        assert ranked[0]["relevance_score"] == pytest.approx(max(want), abs=1e-6)
        assert ranked[0]["document"] == {"text": DOCUMENTS[ranked[0]["index"]]}
        with pytest.raises(bentoml.exceptions.BentoMLException, match="dimensions"):
            c.embed(texts=["x"], dimensions=1000)
        with pytest.raises(bentoml.exceptions.BentoMLException, match="truncate_prompt_tokens"):
            c.embed(texts=["modules and packages " * 60])  # past the context: refused, naming the way out
    for body in ({"texts": []}, {"texts": "x"}, {"texts": ["x"], "dimensions": "8"}, {"texts": ["x"], "normalize": 1}):
        r = server.http.post("/embed", json=body)
        assert r.status_code == 400, (body, r.text)
    assert server.http.post("/rerank", json={"query": "q", "documents": ["d"], "top_n": 0}).status_code == 400


def test_metrics_count_embedding_requests_and_tokens(server, client):
    before = server.metrics()
    used = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[:3]).usage.prompt_tokens
    deadline = time.monotonic() + 5
    while (after := server.metrics())["tiffin_embedding_requests_total"] < before[
        "tiffin_embedding_requests_total"
    ] + 3:
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert after["tiffin_embedding_requests_total"] - before["tiffin_embedding_requests_total"] == 3
    assert after["tiffin_embedding_tokens_total"] - before["tiffin_embedding_tokens_total"] == used
    assert after["tiffin_kv_cache_blocks_total"] == NUM_KV_BLOCKS  # the chat engine's gauges are its own
    assert after["tiffin_embedding_kv_cache_blocks_total"] > 0
    assert after["tiffin_embedding_kv_cache_blocks_used"] == 0  # its blocks are freed in the step that pools
    assert after["tiffin_prompt_tokens_total"] == before["tiffin_prompt_tokens_total"]
