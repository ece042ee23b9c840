"""LLaVA end to end on a tiny random fp32 checkpoint written by transformers (`tiffin.testing.tiny_llava`): pixel
values equal to transformers' PIL CLIP processor; greedy tokens and their logprobs equal to transformers' `generate`
on the same pixel values, with one and two images, mixed with text-only requests in one batch, with the image's
placeholder run split across prefill chunks; images in the prefix cache's block hashes; the encoder run once per
image content."""

import gc

import numpy as np
import pytest
import torch
from references import reference_vlm, vision_language_model

from tiffin import LLM, SamplingParams
from tiffin.engine.errors import ParamError
from tiffin.testing.images import random_image

PIL = pytest.importorskip("PIL.Image")
NEW_TOKENS = 32
TOKENS_PER_IMAGE = 16  # 56 px, 14 px patches
ONE = "USER: <image>\nWhat is shown here? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nCompare the two. ASSISTANT:"
TEXT = "USER: Say something about the standard library. ASSISTANT:"


@pytest.fixture(scope="module")
def checkpoint(tiny_llava):
    return tiny_llava


def load_hf(path) -> tuple:
    """transformers' model, tokenizer and PIL image processor of the checkpoint at `path`."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil

    return vision_language_model(path), AutoTokenizer.from_pretrained(path), CLIPImageProcessorPil.from_pretrained(path)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


@pytest.fixture(scope="module")
def images():
    return [random_image(1, (70, 90)), random_image(2, (64, 48)), random_image(3, (57, 57))]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), dtype="float32")


def processed(hf, text: str, images: list) -> dict:
    """transformers' inputs: the prompt's placeholders expanded as LlavaProcessor does, the pixel values."""
    model, tokenizer, processor = hf
    image_id = model.config.image_token_id
    ids = [t for t0 in tokenizer(text)["input_ids"] for t in ([t0] * TOKENS_PER_IMAGE if t0 == image_id else [t0])]
    x = torch.tensor([ids])
    pixels = {"pixel_values": processor(images, return_tensors="pt")["pixel_values"]} if images else {}
    return {"input_ids": x, "attention_mask": torch.ones_like(x), **pixels}


def reference(hf, text: str, images: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs."""
    return reference_vlm(hf[0], processed(hf, text, images), NEW_TOKENS)[:2]


def prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}


def generate(llm, prompts: list[dict]):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]  # fmt: skip


def assert_matches(got, expected):
    (tokens, logprobs), (ref_tokens, ref_logprobs) = got, expected
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "mode, size",
    [("RGB", (1, 1)), ("RGB", (300, 5)), ("RGB", (5, 300)), ("RGB", (57, 91)), ("RGB", (200, 131)),
     ("RGBA", (77, 60)), ("L", (33, 90)), ("LA", (90, 33)), ("P", (64, 64)), ("RGB", (56, 56))],
)  # fmt: skip
def test_pixel_values_equal_transformers_pil_clip_processor(llm, hf, mode, size):
    image = random_image(sum(size), size, mode)
    expected = hf[2](image, return_tensors="pt")["pixel_values"][0]
    got = llm.llm_engine.model_config.multimodal.processor(image)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 20}], ids=["plain", "chunked"])
def test_greedy_and_logprobs_match_transformers_mixed_with_text(checkpoint, hf, images, engine_args):
    """One and two images and text-only prompts in one continuous batch; `chunked`: a 20-token budget splits the
    16-placeholder runs across steps."""
    cases = [(ONE, images[:1]), (TEXT, []), (TWO, images[1:]), (ONE, images[2:])]
    llm = LLM(str(checkpoint), dtype="float32", **engine_args)
    got = generate(llm, [prompt(text, imgs) for text, imgs in cases])
    for g, (text, imgs) in zip(got, cases):
        assert_matches(g, reference(hf, text, imgs))
    assert llm.llm_engine.stats().kv_blocks_used == 0


def test_same_text_different_images_share_only_the_text_before_them(llm, hf, images):
    """After a request, the same text over another image hits the prefix cache on the full block of text before the
    image only, and answers differently, as transformers does; over the same image, it hits the image's blocks too."""
    text = "USER: " + "a b c d e f g h i j k l m n o p q r " + "<image>\nWhat is it? ASSISTANT:"
    first, second, again = (prompt(text, [image]) for image in (images[0], images[1], images[0]))
    offset = llm.llm_engine.tokenize(first).images[0].offset
    assert 16 < offset < 32
    outs = generate(llm, [first])
    cached = llm.generate([second, again], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    assert cached[0].num_cached_tokens == 16  # the text block only
    assert cached[1].num_cached_tokens >= offset + TOKENS_PER_IMAGE  # the same image: its blocks too
    assert cached[0].outputs[0].token_ids != outs[0][0] == cached[1].outputs[0].token_ids
    assert list(cached[0].outputs[0].token_ids) == reference(hf, text, images[1:2])[0]


def test_block_hashes_differ_over_different_images(llm, images):
    from tiffin.engine.core.block_manager import BlockManager

    engine = llm.llm_engine
    seqs = []
    for i, image in enumerate(images[:2]):
        engine.add_request(f"h{i}", prompt(ONE, [image]), SamplingParams(max_tokens=1))
        seqs.append(engine.requests[f"h{i}"].seqs[0])
    manager = BlockManager(64, 16)
    a, b = (manager._hashes(s, s.num_tokens // 16) for s in seqs)
    image = seqs[0].images[0]
    assert a[0] != b[0] and image.offset < 16  # the first block holds the image's first placeholders
    assert not set(a) & set(b)
    for rid in ("h0", "h1"):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def test_same_image_is_encoded_once(checkpoint, images):
    llm = LLM(str(checkpoint), dtype="float32", enable_prefix_caching=False)
    encoder = llm.llm_engine.model_runner.encoder
    texts = [ONE, "USER: <image>\nDescribe it. ASSISTANT:"]
    generate(llm, [prompt(t, images[:1]) for t in texts])  # one batch, two requests, one image
    assert encoder.num_encoded == 1
    generate(llm, [prompt(TWO, [images[0], images[0]])])  # twice in one prompt, cached already
    assert encoder.num_encoded == 1 and encoder.cache.hits >= 2
    generate(llm, [prompt(ONE, images[1:2])])
    assert encoder.num_encoded == 2


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"prompt": ONE}, "1 image placeholder tokens (id 2047) for 0 images"),
        ({"prompt": ONE, "multi_modal_data": {"image": []}}, "for 0 images"),
        ({"prompt": TEXT, "multi_modal_data": {"image": "x.png"}}, "a PIL image is needed"),
        ({"prompt": ONE, "multi_modal_data": {"video": []}}, "takes 'image'"),
        ({"prompt": "<image>" * 5, "multi_modal_data": {"image": [None] * 5}}, "limit_mm_per_prompt=4"),
    ],
)
def test_bad_image_prompts_are_refused_by_name(llm, bad, words):
    with pytest.raises(ParamError) as e:
        llm.llm_engine.add_request("bad", bad, SamplingParams(max_tokens=1))
    assert e.value.param == "multi_modal_data" and words in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_too_many_pixels_refused(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", max_image_pixels=1000)
    with pytest.raises(ParamError, match="max_image_pixels=1000"):
        llm.llm_engine.add_request("big", prompt(ONE, [random_image(0, (50, 21))]), SamplingParams(max_tokens=1))


def test_text_only_model_refuses_images(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32")
    with pytest.raises(ParamError, match="text only"):
        llm.llm_engine.add_request("img", prompt("hi", [random_image(0, (8, 8))]), SamplingParams(max_tokens=1))


CUDA_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def cuda_cases(llm, images):
    """The prompts of the CUDA test and the CPU engine's outputs for them, computed before any emulation starts
    (a CPU engine's packed weights are opaque to it)."""
    cases = [prompt("<image>", images[:1]), prompt(TEXT, [])]
    return cases, [llm.generate(case, CUDA_PARAMS, use_tqdm=False)[0].outputs[0] for case in cases]


def test_cuda_path_with_graphs_equals_cpu(checkpoint, cuda_cases, cuda_emulation, monkeypatch):
    """The CUDA path (emulated on the CPU, Triton under the interpreter) with decode graphs captured: a 16-token
    budget leaves the image prompt's last placeholder alone in a one-token step, which must not replay a decode
    graph (its input embedding is the image's, not the token's)."""
    from tiffin.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    kwargs = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=2, max_model_len=96, num_kv_blocks=32)
    cuda = LLM(str(checkpoint), device="cuda", **kwargs)
    assert cuda.llm_engine.model_runner.decode_graphs is not None
    cases, want = cuda_cases
    replays = cuda_emulation.replays
    got = [cuda.generate(case, CUDA_PARAMS, use_tqdm=False)[0].outputs[0] for case in cases]  # one at a time
    assert cuda_emulation.replays > replays  # the decode steps ran from graphs
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)],
                                   [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)], atol=1e-3)  # fmt: skip


def test_gpu_memory_profile_runs_the_tower_and_counts_the_encoder_cache(checkpoint, cuda_emulation, monkeypatch):
    """On CUDA (emulated) the profiling step also encodes as many images as its tokens hold (32 tokens: 2 images
    of 16), and the KV pool is sized with the encoder cache's bound counted as in use."""
    from tiffin.engine.models.llava import LlavaForConditionalGeneration
    from tiffin.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    encoded, embed = [], LlavaForConditionalGeneration.embed_images
    monkeypatch.setattr(
        LlavaForConditionalGeneration, "embed_images", lambda m, px: encoded.append(len(px)) or embed(m, px)
    )
    # a budget of ~130 MiB of the emulated 16 GiB: the pool is what it leaves, below max_num_seqs * max_model_len
    kwargs = dict(device="cuda", dtype="float32", max_num_batched_tokens=32, max_num_seqs=256, max_model_len=1024,
                  enforce_eager=True, gpu_memory_utilization=0.008)  # fmt: skip
    blocks = {}
    for cache in (0, 64 << 20):
        engine = LLM(str(checkpoint), encoder_cache_bytes=cache, **kwargs).llm_engine
        assert encoded.pop() == 2 and not encoded  # the profile's step: one tower forward of two images
        assert engine.model_runner.encoder.num_encoded == 0 and not engine.model_runner.encoder.cache.entries
        blocks[cache], per_block = engine.block_manager.num_blocks, engine.model_runner.kv_spec.bytes_per_block
        del engine
        gc.collect()  # its pool's emulated device memory freed before the next engine measures what is free
    assert blocks[0] - blocks[64 << 20] == pytest.approx((64 << 20) / per_block, abs=2)
