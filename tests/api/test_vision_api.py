"""Images through the OpenAI chat, Responses and Anthropic Messages APIs in-process, on the tiny LLaVA checkpoint: an
`image_url` part with a `data:` URL (PNG, JPEG, WebP, a GIF's first frame), a Response's `input_image` and a Messages
base64 `image` block give the tokens the engine gives for the same decoded image called directly; hostile images
(truncated, a 30000x30000 declared size, an unsupported or wrongly declared format, bad base64, too many images, a
remote URL, malformed parts and blocks, a palette PIL cannot convert, EXIF too large or unparsable) are 400s naming
the problem, and the engine serves the next request as before."""

import asyncio
import base64
import io
import struct
import zlib

import httpx
import pytest

pytest.importorskip("fastapi")
PIL = pytest.importorskip("PIL.Image")

from fastapi.testclient import TestClient  # noqa: E402

from tests.engine.test_llava import random_image  # noqa: E402
from tiffin import LLM, SamplingParams  # noqa: E402
from tiffin.testing.hostile_images import hostile_images  # noqa: E402

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def checkpoint(tiny_llava):
    return tiny_llava


@pytest.fixture(scope="module")
def api(openai_app, checkpoint):
    with openai_app(model=checkpoint, dtype="float32", limit_mm_per_prompt=2) as api:
        yield api


def encoded(image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def body(msgs, max_tokens: int = 16) -> dict:
    return {"model": "tiny", "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def chat(client, msgs):
    return client.post("/chat/completions", json=body(msgs))


def refused(response, *words):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and all(w in error["message"] for w in words), error


def declared_size(png: bytes, width: int, height: int) -> bytes:
    """`png` with its IHDR chunk declaring `width` x `height` (CRC fixed): a decompression bomb's header."""
    ihdr = png[12:16] + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


@pytest.fixture(scope="module")
def direct(checkpoint):
    """The engine called directly: greedy text of the LLaVA prompt over each image."""
    llm = LLM(checkpoint, dtype="float32")

    def run(*images, max_tokens: int = 16, ignore_eos: bool = True) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        text = "USER: " + "<image>\n" * len(images) + QUESTION + "\nASSISTANT:"
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": list(images)}}, params, use_tqdm=False)
        return out[0].outputs[0].text

    return run


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_data_url_image_gives_the_engines_tokens(api, direct, fmt):
    image = random_image(7, (61, 83))
    if fmt == "GIF":  # two frames: the first is read
        data = encoded(image.convert("P"), "GIF", save_all=True, append_images=[random_image(8, (61, 83)).convert("P")])
    else:
        data = encoded(image, fmt)
    decoded = PIL.open(io.BytesIO(data))
    decoded.load()
    with TestClient(api.app) as client:
        response = chat(client, messages(data_url(data, f"image/{fmt.lower()}")))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == direct(decoded)


def test_two_images_and_a_text_only_chat(api, direct):
    """Two images in one message; /tokenize counts the chat's tokens, image tokens included, as the chat ran them."""
    a, b = random_image(1, (40, 90)), random_image(2, (90, 40))
    with TestClient(api.app) as client:
        response = chat(client, messages(data_url(encoded(a, "PNG")), data_url(encoded(b, "PNG"))))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == direct(a, b)
        msgs = messages(data_url(encoded(a, "PNG")), data_url(encoded(b, "PNG")))
        counted = client.post("/tokenize", json={"model": "tiny", "messages": msgs}).json()["count"]
        assert counted == response.json()["usage"]["prompt_tokens"] > 2 * 16  # the image tokens counted
        assert chat(client, [{"role": "user", "content": "hello"}]).status_code == 200


def test_hostile_images_are_400s_while_an_image_chat_runs(api, direct):
    """Every hostile image is refused by name while a well-formed image chat runs beside them, which answers as the
    engine does alone; nothing is left running or holding KV blocks."""
    png = encoded(random_image(3, (64, 64)), "PNG")
    bmp = encoded(random_image(3, (64, 64)), "BMP")
    cases = [
        (messages(data_url(png[: len(png) // 2])), "cannot be decoded"),  # truncated
        (messages(data_url(declared_size(png, 30000, 30000))), "max_image_pixels=16777216"),  # a bomb's header
        (messages(data_url(declared_size(png, 5000, 5000))), "5000x5000 pixels", "max_image_pixels=16777216"),
        (messages(data_url(bmp, "image/bmp")), "not an image in a supported format"),
        (messages(data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)), "not an image"),  # corrupt after the magic
        (messages("data:image/png;base64,@@@@"), "not valid base64"),
        (messages("data:image/png,abc"), "data URL must be"),
        (messages("https://example.com/cat.png"), "allowed_media_domains"),
        (messages(*[data_url(png)] * 3), "limit_mm_per_prompt=2"),
    ]
    worst = {c.name: c for c in hostile_images(frames=2)}  # unnamed, a 500, a 1.4 s parse before
    for name in ("PNG tRNS longer than its palette", "PNG eXIf PIL cannot parse", "PNG eXIf of 65535 entries (768 KB)"):
        cases.append((messages(data_url(worst[name].data)), *worst[name].words))

    async def run():
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiffin", timeout=60) as http:

            def post(msgs, max_tokens=16):
                body = {
                    "model": "tiny",
                    "messages": msgs,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                return http.post("/chat/completions", json=body)

            return await asyncio.gather(post(messages(data_url(png)), 64), *(post(m) for m, *_ in cases))

    running, *hostile = asyncio.run(asyncio.wait_for(run(), 60))
    for response, (msgs, *words) in zip(hostile, cases):
        refused(response, f"messages[0].content[{len(msgs[0]['content']) - 2}]", *words)
    assert running.status_code == 200, running.text
    assert running.json()["choices"][0]["message"]["content"] == direct(PIL.open(io.BytesIO(png)), max_tokens=64)
    stats = api.engine.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_an_image_to_a_text_only_model_is_a_400_naming_the_part(openai_app):
    with openai_app(num_kv_blocks=64) as text_api, TestClient(text_api.app) as client:
        url = data_url(encoded(random_image(3, (8, 8)), "PNG"))
        refused(chat(client, messages(url)), "messages[0].content[0]", "'image_url'", "reads images")
        assert [c["input_modalities"] for c in client.get("/models").json()["data"]] == [["text"]]


def test_models_list_the_image_modality(api):
    with TestClient(api.app) as client:
        assert [c["input_modalities"] for c in client.get("/models").json()["data"]] == [["text", "image"]]


def image_item(*urls: str, question: str = QUESTION) -> dict:
    """A Responses input message of `input_image` parts and the question."""
    parts = [{"type": "input_image", "image_url": url, "detail": "auto"} for url in urls]
    return {"role": "user", "content": [*parts, {"type": "input_text", "text": question}]}


def respond(client, *items, max_tokens: int = 16):
    body = {"model": "tiny", "input": list(items), "max_output_tokens": max_tokens, "temperature": 0, "store": False}
    return client.post("/responses", json=body)


def test_responses_input_image_gives_the_engines_tokens(api, direct):
    """Two `input_image` parts (PNG, WebP) in a Response's input read as the engine reads the decoded images."""
    a, b = random_image(11, (50, 70)), random_image(12, (70, 50))
    webp = encoded(b, "WEBP")
    with TestClient(api.app) as client:
        response = respond(client, image_item(data_url(encoded(a, "PNG")), data_url(webp, "image/webp")))
    assert response.status_code == 200, response.text
    message = next(item for item in response.json()["output"] if item["type"] == "message")
    assert message["content"][0]["text"] == direct(a, PIL.open(io.BytesIO(webp)), ignore_eos=False)


def test_anthropic_image_block_gives_the_engines_tokens(api, direct):
    """The `anthropic` client's base64 `image` block (a JPEG) reads as the engine reads the decoded image."""
    pytest.importorskip("anthropic")
    from tests.api.test_messages import claude, served

    jpeg = encoded(random_image(13, (66, 41)), "JPEG")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(jpeg).decode()}}  # fmt: skip
    messages = [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}]
    message = claude(
        served(api.app),
        lambda c: c.messages.create(model="tiny", max_tokens=16, messages=messages, extra_body={"temperature": 0}),
    )
    assert message.content[0].text == direct(PIL.open(io.BytesIO(jpeg)), ignore_eos=False)


def anthropic_image(media: str = "image/png", data: bytes | str = b"", kind: str = "base64") -> dict:
    data = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "image", "source": {"type": kind, "media_type": media, "data": data}}


def test_hostile_images_in_responses_and_messages_are_400s(api):
    """Each API's malformed image is a 400 naming the problem, in that API's error shape; the engine is left idle."""
    png = encoded(random_image(3, (64, 64)), "PNG")
    jpeg = encoded(random_image(3, (64, 64)), "JPEG")
    in_responses = [
        ({"type": "input_image", "file_id": "file-1"}, "file_id"),
        ({"type": "input_image", "image_url": 3}, "non-empty string"),
        ({"type": "input_image", "image_url": data_url(png), "detail": "ultra"}, "detail"),
        ({"type": "input_image", "image_url": data_url(png[:100])}, "cannot be decoded"),
        ({"type": "input_image", "image_url": data_url(png, "image/jpeg")}, "declares image/jpeg but holds PNG"),
        ({"type": "input_image", "image_url": "data:image/png;base64,@@"}, "not valid base64"),
        ({"type": "input_image", "image_url": data_url(declared_size(png, 30000, 30000))}, "max_image_pixels"),
        ({"type": "input_image", "image_url": "https://example.com/cat.png"}, "allowed_media_domains"),
        ({"type": "input_file", "file_id": "file-1"}, "only text and input_image parts"),
    ]
    in_messages = [
        (anthropic_image("image/bmp", png), "media_type: must be one of image/jpeg"),
        (anthropic_image(data=png, kind="file"), ".source: must be"),
        ({"type": "image", "source": "x"}, ".source: must be"),
        (anthropic_image(data=""), "source.data"),
        (anthropic_image(data="@@@@"), "not valid base64"),
        (anthropic_image("image/png", jpeg), "declares image/png but holds JPEG"),
        (anthropic_image(data=png[: len(png) // 2]), "cannot be decoded"),
        (anthropic_image(data=declared_size(png, 5000, 5000)), "5000x5000 pixels", "max_image_pixels"),
        ({"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}, "allowed_media_domains"),
        ({"type": "tool_result", "tool_use_id": "t", "content": [anthropic_image(data=png)]}, "tool results"),
    ]
    with TestClient(api.app) as client:
        for part, *words in in_responses:
            response = respond(client, {"role": "user", "content": [part]})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "input" and all(w in error["message"] for w in words), error
        for block, *words in in_messages:
            body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
            response = client.post("/messages", json=body)
            assert response.status_code == 400, response.text
            error = response.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
            assert all(w in error["error"]["message"] for w in words), error
        many = [anthropic_image(data=png)] * 3
        response = client.post("/messages", json={"model": "tiny", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": many}]})  # fmt: skip
        assert response.status_code == 400 and "limit_mm_per_prompt=2" in response.text
    stats = api.engine.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
