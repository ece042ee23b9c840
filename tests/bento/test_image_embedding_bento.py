"""A tiny CLIP checkpoint as the Bento's embedding model beside the tiny llama in one `bentoml serve`: an image
(vLLM's chat-style `messages` with a data URL) and a text on /v1/embeddings give the offline `LLM`'s embeddings of the
same files; an image with text beside it is a 400 naming `messages`, an image to the chat model a 400 naming its
task."""

import base64
import io

import numpy as np
import pytest

openai = pytest.importorskip("openai")
bentoml = pytest.importorskip("bentoml")
PIL = pytest.importorskip("PIL.Image")

from tiffin import LLM  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NAME = "tiny-clip"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tiffin.testing.tiny_dual_encoder import make_tiny_dual_encoder

    return str(make_tiny_dual_encoder(tmp_path_factory.mktemp("clip"), "clip"))


@pytest.fixture(scope="module")
def server(bento_server, checkpoint):
    args = {"model": "tiffin-tiny-llama", "embedding_model": checkpoint, "embedding_served_model_name": NAME}
    return bento_server(args=args, env={"TIFFIN_MAX_NUM_SEQS": "8"}, timeout=180)


def image_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_images_and_texts_on_the_bentos_v1_embeddings(server, checkpoint):
    image = PIL.fromarray(np.random.default_rng(3).integers(0, 256, (37, 52, 3), dtype=np.uint8))
    want = LLM(checkpoint).embed(["a photo of a cat", {"prompt": "", "multi_modal_data": {"image": image}}])
    part = {"type": "image_url", "image_url": {"url": image_url(image)}}

    def post(**body):
        return server.http.post("/v1/embeddings", json={"model": NAME, "encoding_format": "float", **body})

    got_image = post(messages=[{"role": "user", "content": [part]}]).json()["data"][0]["embedding"]
    got_text = post(input="a photo of a cat").json()["data"][0]["embedding"]
    for got, out in zip((got_text, got_image), want):
        assert max(abs(a - b) for a, b in zip(got, out.outputs.embedding)) <= 1e-6
    both = post(messages=[{"role": "user", "content": [part, {"type": "text", "text": "a cat"}]}])
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"
    assert "not both" in both.json()["error"]["message"]
    chat = server.http.post(
        "/v1/embeddings", json={"model": "tiffin-tiny-llama", "messages": [{"role": "user", "content": [part]}]}
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
