"""The tiny LLaVA served by `bentoml serve`: the `openai` client's chat with an `image_url` data URL and the
`anthropic` client's base64 `image` block give the tokens the offline `LLM` gives for the same decoded images."""

import base64
import io

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
PIL = pytest.importorskip("PIL.Image")

from tiffin import LLM, SamplingParams  # noqa: E402
from tiffin.testing.images import random_image  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server(bento_server, tiny_llava):
    return bento_server(args={"model": tiny_llava, "dtype": "float32", "num_kv_blocks": 128}, timeout=180)


def offline(checkpoint: str, images: list, max_tokens: int, ignore_eos: bool) -> str:
    """The greedy text of LLaVA's prompt over `images`, the engine called directly."""
    prompt = "USER: " + "<image>\n" * len(images) + QUESTION + "\nASSISTANT:"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    out = LLM(checkpoint, dtype="float32").generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)
    return out[0].outputs[0].text


def encoded(image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def test_openai_and_anthropic_clients_images_give_the_offline_tokens(server, tiny_llava):
    png, jpeg = encoded(random_image(21, (61, 83)), "PNG"), encoded(random_image(22, (40, 90)), "JPEG")
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}},
        {"type": "text", "text": QUESTION},
    ]
    name = chat.models.list().data[0].id
    answer = chat.chat.completions.create(
        model=name, messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    decoded = [PIL.open(io.BytesIO(data)).convert("RGB") for data in (png, jpeg)]
    assert answer.choices[0].message.content == offline(tiny_llava, decoded, 12, ignore_eos=True)

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(jpeg).decode()}}  # fmt: skip
    content = [block, {"type": "text", "text": QUESTION}]
    message = claude.messages.create(
        model=name, max_tokens=12, messages=[{"role": "user", "content": content}], extra_body={"temperature": 0}
    )
    assert message.content[0].text == offline(tiny_llava, decoded[1:], 12, ignore_eos=False)


def test_typed_generate_takes_uploaded_images(server, tiny_llava, tmp_path):
    """`bentoml.SyncHTTPClient`'s `generate` with image files (multipart uploads) gives the offline tokens; a URL
    string, a corrupt file and more images than placeholders are 400s naming the problem, the text-only JSON request
    still served."""
    import bentoml
    import httpx

    images = [random_image(23, (50, 70)), random_image(24, (90, 30))]
    files = [tmp_path / "a.png", tmp_path / "b.jpg"]
    for image, path in zip(images, files):
        image.save(path)
    prompt = "USER: <image>\n<image>\n" + QUESTION + "\nASSISTANT:"
    with bentoml.SyncHTTPClient(server.url, timeout=120) as client:
        text = client.generate(prompt=prompt, images=files, max_tokens=12, temperature=0, ignore_eos=True)
        decoded = [PIL.open(path).convert("RGB") for path in files]
        assert text == offline(tiny_llava, decoded, 12, ignore_eos=True)
        with pytest.raises(bentoml.exceptions.BentoMLException, match="placeholder"):
            client.generate(prompt="USER: <image>\nHi\nASSISTANT:", images=files, max_tokens=2)

    def post(files: list, **fields) -> httpx.Response:
        data = {"prompt": '"USER: <image>\\nHi\\nASSISTANT:"', "max_tokens": "2", **fields}
        return httpx.post(server.url + "/generate", data=data, files=files, timeout=60)

    url = post([("images", (None, "https://example.com/cat.png"))])  # a part with no filename: a string
    assert url.status_code == 400 and "URLs are not fetched" in url.text
    corrupt = post([("images", ("cat.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "image/png"))])
    assert corrupt.status_code == 400 and "image[0]" in corrupt.text, corrupt.text
    plain = httpx.post(server.url + "/generate", json={"prompt": "USER: Hi\nASSISTANT:", "max_tokens": 2}, timeout=60)
    assert plain.status_code == 200, plain.text
