"""Idefics3 / SmolVLM end to end on a tiny random fp32 checkpoint written by transformers
(`tiffin.testing.tiny_idefics3`): tiles and pixel values equal to transformers' `Idefics3ImageProcessorPil` on varied
images, the pixel shuffle equal to transformers' connector's, prompt ids equal to `Idefics3Processor`'s (tile markers,
global image, image-token runs), greedy tokens and their logprobs equal to transformers' `generate` with one and two
images of different sizes and aspect ratios, mixed with text-only requests in one batch, also with image-token runs
split across prefill chunks, and after a prefix-cache hit on the text before an image; each distinct tile encoded
once."""

import numpy as np
import pytest
import torch
from references import reference_vlm, vision_language_model

from tests.engine.test_llava import assert_matches, generate, prompt, random_image
from tiffin import LLM, SamplingParams

PIL = pytest.importorskip("PIL.Image")
NEW_TOKENS = 32
ONE = "<|bos|>User:<image>What is shown here?<end_of_utterance>\nAssistant:"
TWO = "<|bos|>User:<image>and<image>Compare the two.<end_of_utterance>\nAssistant:"
TEXT = "<|bos|>User: Say something about the standard library.<end_of_utterance>\nAssistant:"


def load_hf(path) -> tuple:
    """transformers' model and processor (its PIL image processor) of the checkpoint at `path`."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    return vision_language_model(path), processor


@pytest.fixture(scope="module")
def hf(tiny_idefics3):
    return load_hf(tiny_idefics3)


@pytest.fixture(scope="module")
def llm(tiny_idefics3):
    return LLM(tiny_idefics3, dtype="float32")


@pytest.fixture(scope="module")
def images():
    """3 x 3 tiles, 1 x 3 (wide), 3 x 1 (tall), and one small enough for a single tile's grid of 3 x 3."""
    return [random_image(1, (70, 90)), random_image(2, (120, 30)), random_image(3, (20, 64)), random_image(4, (9, 9))]


def processed(hf, text: str, images: list) -> dict:
    """`Idefics3Processor`'s inputs (the text carries its own bos, as the chat template writes it)."""
    return hf[1](text=text, images=images or None, return_tensors="pt", add_special_tokens=False)


def reference(hf, text: str, images: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs over the processor's inputs."""
    return reference_vlm(hf[0], processed(hf, text, images), NEW_TOKENS)[:2]


def as_prompt(text: str, images: list) -> dict:
    return {**prompt(text, images), "add_special_tokens": False}


@pytest.mark.parametrize(
    "mode, size",
    [("RGB", (1, 1)), ("RGB", (4000, 300)), ("RGB", (300, 4000)), ("RGB", (5, 300)), ("RGB", (57, 91)),
     ("RGB", (32, 32)), ("RGB", (33, 31)), ("RGB", (96, 64)), ("RGB", (200, 131)), ("RGBA", (77, 60)),
     ("L", (33, 90)), ("LA", (90, 33)), ("P", (64, 64)), ("RGB", (5000, 4))],
)  # fmt: skip
def test_tiles_equal_transformers_pil_processor(llm, hf, mode, size):
    image = random_image(sum(size), size, mode)
    expected = hf[1].image_processor(image, return_tensors="pt", return_row_col_info=True)
    tiles, rows, cols = llm.llm_engine.model_config.multimodal.processor(image)
    assert (rows, cols) == (expected["rows"][0][0], expected["cols"][0][0])
    want = expected["pixel_values"][0]
    assert tiles.dtype == want.dtype and torch.equal(tiles, want)


def test_unsplit_images_and_palette_transparency_equal_transformers(llm, hf):
    """`do_image_splitting` false: the image squeezed into one tile; a palette image with a transparent index."""
    from dataclasses import replace

    processor = llm.llm_engine.model_config.multimodal.processor
    unsplit = replace(processor, do_image_splitting=False)
    image = random_image(5, (70, 40), "P")
    image.info["transparency"] = 3
    for ours, kwargs in ((processor, {}), (unsplit, {"do_image_splitting": False})):
        want = hf[1].image_processor(image, return_tensors="pt", **kwargs)["pixel_values"][0]
        assert torch.equal(ours(image)[0], want)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_pixel_shuffle_equals_transformers(scale):
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    from tiffin.engine.models.idefics3 import pixel_shuffle

    x = torch.randn(3, (scale * 3) ** 2, 5)
    assert torch.equal(pixel_shuffle(x, scale), Idefics3Connector.pixel_shuffle(None, x, scale))


def test_prompt_ids_equal_the_processors(llm, hf, images):
    """Tile markers, newlines, the global image and each tile's run of 16 image tokens, as Idefics3Processor writes
    them; each tile an image of its own, placed on its run."""
    got = llm.llm_engine.tokenize(as_prompt(TWO, images[:2]))
    want = processed(hf, TWO, images[:2])
    assert got.token_ids == want["input_ids"][0].tolist()
    image_id = hf[0].config.image_token_id
    assert len(got.images) == 10 + 4 and all(got.token_ids[i.offset - 1] != image_id for i in got.images)
    assert all(set(got.token_ids[i.offset : i.offset + i.length]) == {image_id} for i in got.images)
    tiles = want["pixel_values"][0][: len(got.images)]
    assert all(torch.equal(i.pixel_values, t) for i, t in zip(got.images, tiles))


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 40}], ids=["plain", "chunked"])
def test_greedy_and_logprobs_match_transformers_mixed_with_text(tiny_idefics3, hf, images, engine_args):
    """One and two images of different sizes and aspect ratios and a text-only prompt in one continuous batch;
    `chunked`: a 40-token budget splits the 16-token runs across steps."""
    cases = [(ONE, images[:1]), (TEXT, []), (TWO, images[1:3]), (ONE, images[3:])]
    llm = LLM(tiny_idefics3, dtype="float32", **engine_args)
    got = generate(llm, [as_prompt(text, imgs) for text, imgs in cases])
    for g, (text, imgs) in zip(got, cases):
        assert_matches(g, reference(hf, text, imgs))
    assert llm.llm_engine.stats().kv_blocks_used == 0


def test_each_distinct_tile_is_encoded_once(tiny_idefics3, images):
    """A tile is an image to the encoder cache: the same image twice costs its tiles once; a uniform image's tiles
    and global image, all alike, cost one."""
    llm = LLM(tiny_idefics3, dtype="float32", enable_prefix_caching=False)
    encoder = llm.llm_engine.model_runner.encoder
    generate(llm, [as_prompt(ONE, images[:1]), as_prompt(TWO, images[:1] * 2)])
    assert encoder.num_encoded == 10  # 3 x 3 tiles and the global image
    flat = PIL.new("RGB", (64, 64), (10, 200, 30))
    generate(llm, [as_prompt(ONE, [flat])])
    assert encoder.num_encoded == 10 + 1


def test_prefix_hit_on_the_text_before_an_image(llm, hf, images):
    """The same text before different images: the second request finds the text's full blocks in the prefix cache,
    none past the first image placeholder, and answers as transformers does."""
    text = "<|bos|>User: a b c d e f g h i j k l m n o p q r s t<image>What is it?<end_of_utterance>\nAssistant:"
    first, second = (as_prompt(text, [image]) for image in images[:2])
    offset = llm.llm_engine.tokenize(first).images[0].offset
    assert offset > 16
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = [*llm.generate([first], params, use_tqdm=False), *llm.generate([second], params, use_tqdm=False)]
    assert 16 <= outs[1].num_cached_tokens <= offset and outs[1].num_cached_tokens % 16 == 0
    for out, image in zip(outs, images[:2]):
        c = out.outputs[0]
        assert_matches((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]),
                       reference(hf, text, [image]))  # fmt: skip


def test_chat_template_places_the_image(llm, hf, images):
    """A chat with an image part renders as the processor's chat template writes it."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = hf[1].apply_chat_template(messages, add_generation_prompt=True)
    rendered = llm.llm_engine.render_chat(messages_with(messages, images[0]))
    assert rendered.token_ids == processed(hf, text, images[:1])["input_ids"][0].tolist()


def messages_with(messages: list[dict], image) -> list[dict]:
    """`messages` with each image part an `image_url` part holding `image` as a PNG data URL."""
    import base64
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    url = {"url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()}
    return [{**m, "content": [{"type": "image_url", "image_url": url} if p["type"] == "image" else p
                              for p in m["content"]]} for m in messages]  # fmt: skip


def test_different_images_give_different_outputs(llm, images):
    """Different images give different greedy outputs (the images reach the language model)."""
    a, b = (generate(llm, [as_prompt(ONE, [image])])[0] for image in images[:2])
    assert a[0] != b[0] and not np.allclose(a[1], b[1])


CUDA_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def cuda_cases(llm, images):
    """The prompts of the CUDA test (a wide image of 1 x 3 tiles, a text-only chat) and the CPU engine's outputs for
    them, computed before any emulation starts."""
    cases = [as_prompt(ONE, images[1:2]), as_prompt(TEXT, [])]
    return cases, [llm.generate(case, CUDA_PARAMS, use_tqdm=False)[0].outputs[0] for case in cases]


def test_cuda_path_with_graphs_equals_cpu(tiny_idefics3, cuda_cases, cuda_emulation, monkeypatch):
    """The CUDA path (emulated on the CPU, Triton under the interpreter), its decode steps replaying graphs: the
    tokens are the CPU engine's."""
    from tiffin.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    kwargs = dict(dtype="float32", max_num_batched_tokens=128, max_num_seqs=2, max_model_len=128)
    cuda = LLM(tiny_idefics3, device="cuda", num_kv_blocks=32, **kwargs)
    assert cuda.llm_engine.model_runner.decode_graphs is not None
    cases, want = cuda_cases
    replays = cuda_emulation.replays
    got = [cuda.generate(case, CUDA_PARAMS, use_tqdm=False)[0].outputs[0] for case in cases]
    assert cuda_emulation.replays > replays
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)],
                                   [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)], atol=1e-3)  # fmt: skip
