"""Images on /v1/embeddings, in process: vLLM's chat-style `messages` (an `image_url` data URL, or text parts) to a
tiny CLIP embedding model beside a tiny BERT one, through the official `openai` client as vLLM's example sends it and
raw HTTP. An image's embedding and a text's equal transformers' `get_image_features` / `get_text_features`
(normalized, 1e-5) and the engine's for the same input; `messages` text embeds as the same text given as `input`.
Bad input is a 400 naming the problem, with nothing left running: an image to the text-only model, an image URL that
is not a data URL, more images than one, more than `limit_mm_per_prompt`, an image beside text, both `input` and
`messages` or neither."""

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
PIL = pytest.importorskip("PIL.Image")

TOL = 1e-5
TEXT = "a photo of a cat"


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(7)
    return PIL.fromarray(rng.integers(0, 256, (41, 57, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tiffin.testing.tiny_dual_encoder import make_tiny_dual_encoder

    return str(make_tiny_dual_encoder(tmp_path_factory.mktemp("clip"), "clip"))


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    from tiffin import AsyncLLMEngine
    from tiffin.tiny_bert import make_tiny_bert

    clip = AsyncLLMEngine.from_engine_args(checkpoint, dtype="float32")
    bert = AsyncLLMEngine.from_engine_args(str(make_tiny_bert(tmp_path_factory.mktemp("bert"))), dtype="float32")
    yield clip, bert
    for engine in (clip, bert):
        engine.shutdown()


@pytest.fixture(scope="module")
def http(engines):
    from fastapi.testclient import TestClient

    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.pooling import PoolingServing

    clip, bert = engines
    with TestClient(create_app([PoolingServing(clip, "tiny-clip"), PoolingServing(bert, "tiny-bert")])) as client:
        yield client


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

    model = CLIPModel.from_pretrained(checkpoint).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint), CLIPImageProcessorPil.from_pretrained(checkpoint)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def embed(http, **body) -> list[float]:
    r = http.post("/embeddings", json={"model": "tiny-clip", "encoding_format": "float", **body})
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["embedding"]


def test_images_and_texts_embed_as_transformers(http, hf, image, engines):
    from tiffin import PoolingParams

    model, tokenizer, processor = hf
    with torch.no_grad():
        want_image = model.get_image_features(**processor(image, return_tensors="pt")).pooler_output[0]
        want_text = model.get_text_features(**tokenizer(TEXT, return_tensors="pt")).pooler_output[0]
    got_image = torch.tensor(embed(http, messages=user(image_part(data_url(image)))))
    assert torch.allclose(got_image, torch.nn.functional.normalize(want_image, dim=0), atol=TOL)
    alone = asyncio.run(engines[0].encode({"prompt": "", "multi_modal_data": {"image": image}}, PoolingParams("embed")))
    assert got_image.tolist() == alone.outputs.embedding
    got_text = torch.tensor(embed(http, messages=user({"type": "text", "text": TEXT})))
    assert torch.allclose(got_text, torch.nn.functional.normalize(want_text, dim=0), atol=TOL)
    assert got_text.tolist() == embed(http, input=TEXT) == embed(http, messages=[{"role": "user", "content": TEXT}])


def test_openai_client_posts_vllms_chat_embeddings_shape(http, image):
    openai = pytest.importorskip("openai")
    from openai.types.create_embedding_response import CreateEmbeddingResponse

    client = openai.OpenAI(base_url=str(http.base_url), api_key="unused", http_client=http, max_retries=0)
    body = {"model": "tiny-clip", "messages": user(image_part(data_url(image, "JPEG")))}
    out = client.post("/embeddings", cast_to=CreateEmbeddingResponse, body={**body, "encoding_format": "float"})
    assert len(out.data) == 1 and out.usage.prompt_tokens == 1  # an image is one placeholder token
    assert out.data[0].embedding == embed(http, **body)
    assert abs(float(np.linalg.norm(out.data[0].embedding)) - 1) < 1e-6


def test_bad_inputs_are_400s_naming_the_problem(http, image, engines):
    url = data_url(image)
    cases = [
        ({"model": "tiny-bert", "messages": user(image_part(url))}, "messages", "needs a model that reads images"),
        ({"messages": user(image_part("https://example.com/cat.png"))}, "messages", "allowed_media_domains"),
        ({"messages": user(image_part("file:///etc/passwd"))}, "messages", "a data URL must be"),
        ({"messages": user(image_part(url), image_part(url))}, "messages", "embeds one image per input"),
        ({"messages": user(*[image_part(url)] * 5)}, "messages", "limit_mm_per_prompt=4"),
        ({"messages": user(image_part(url), {"type": "text", "text": TEXT})}, "messages", "not both"),
        ({"messages": user(image_part("data:image/png;base64,iVBOR"))}, "messages", "messages\\[0\\].content\\[0\\]"),
        ({"messages": user({"type": "audio"})}, "messages", "'audio' is not supported"),
        ({"messages": [{"role": "user"}]}, "messages", "needs 'content'"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"input": TEXT, "messages": user(image_part(url))}, "input", "one of them"),
        ({}, "input", "one of them"),
    ]
    for body, param, problem in cases:
        r = http.post("/embeddings", json={"model": "tiny-clip", **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, (body, r.text)
        assert __import__("re").search(problem, error["message"]), (problem, error["message"])
    for engine in engines:
        assert not engine.engine.has_unfinished_requests()
