"""CLIP and SigLIP embedding models (`CLIPModel`, `SiglipModel`) on tiny random fp32 checkpoints written by
transformers (`tiffin.testing.tiny_dual_encoder`): text embeddings equal to transformers' `get_text_features` (SigLIP's
texts padded to its context as its processor's `padding="max_length"` pads them), image embeddings to
`get_image_features` on its PIL image processor's pixel values (images of several sizes and modes), both L2-normalized
(raw with `normalize=False`) at 1e-5, in one batch mixed; CLIP's pooled EOS by both of transformers' rules on token
ids that hold more than one EOS; their cosines equal to transformers' `logits_per_image` / `logit_scale`; the same
image encoded once; refusals naming the problem, nothing left running."""

import numpy as np
import pytest
import torch

from tiffin import LLM, PoolingParams, SamplingParams
from tiffin.engine.errors import ParamError

PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
TEXTS = ["a photo of a cat", "Déjà vu, 東京!", "x", "the quick brown fox jumps over the lazy dog"]


def random_image(seed: int, size: tuple[int, int], mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    w, h = size
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode if mode != "P" else "RGB"]
    pixels = rng.integers(0, 64, (h, w, bands)) + (np.arange(w)[None, :, None] * 5 + np.arange(h)[:, None, None]) % 192
    pixels = pixels.astype(np.uint8)
    image = PIL.fromarray(pixels[..., 0] if bands == 1 else pixels, "L" if bands == 1 else mode.replace("P", "RGB"))
    return image.convert("P") if mode == "P" else image


IMAGES = [random_image(1, (50, 40)), random_image(2, (7, 90), "RGBA"), random_image(3, (30, 30), "L"),
          random_image(4, (64, 33), "P"), random_image(5, (1, 1))]  # fmt: skip


@pytest.fixture(scope="module", params=["clip", "siglip"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(kind, tmp_path_factory) -> str:
    from tiffin.testing.tiny_dual_encoder import make_tiny_dual_encoder

    return str(make_tiny_dual_encoder(tmp_path_factory.mktemp(kind), kind))


@pytest.fixture(scope="module")
def hf(checkpoint, kind):
    from transformers import AutoModel, AutoTokenizer, CLIPImageProcessorPil, SiglipImageProcessorPil

    processor = CLIPImageProcessorPil if kind == "clip" else SiglipImageProcessorPil
    model = AutoModel.from_pretrained(checkpoint).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint), processor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32")


def hf_ids(hf, kind: str, text: str) -> torch.Tensor:
    model, tokenizer, _ = hf
    pad = {"padding": "max_length", "max_length": model.config.text_config.max_position_embeddings}
    return tokenizer(text, return_tensors="pt", **(pad if kind == "siglip" else {}))["input_ids"]


@torch.no_grad()
def hf_text(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf[0].get_text_features(input_ids=ids).pooler_output


@torch.no_grad()
def hf_images(hf, images: list) -> torch.Tensor:
    return hf[0].get_image_features(pixel_values=hf[2](images, return_tensors="pt")["pixel_values"]).pooler_output


def image_prompt(image) -> dict:
    return {"prompt": "", "multi_modal_data": {"image": image}}


def embeddings(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def normalized(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def test_pixel_values_equal_transformers_processor(llm, hf):
    processor = llm.llm_engine.model_config.multimodal.processor
    for image in IMAGES:
        want = hf[2](image, return_tensors="pt")["pixel_values"][0]
        assert torch.equal(processor(image), want), image


def test_texts_and_images_in_one_batch_equal_transformers(llm, hf, kind):
    want_text = torch.cat([hf_text(hf, hf_ids(hf, kind, t)) for t in TEXTS])
    want_images = hf_images(hf, IMAGES)
    mixed = [TEXTS[0], image_prompt(IMAGES[0]), *TEXTS[1:], *map(image_prompt, IMAGES[1:])]
    got = embeddings(llm.embed(mixed, use_tqdm=False))
    assert torch.allclose(
        got, normalized(torch.cat([want_text[:1], want_images[:1], want_text[1:], want_images[1:]])), atol=TOL
    )
    raw = embeddings(llm.embed([TEXTS[3], image_prompt(IMAGES[2])], PoolingParams(normalize=False), use_tqdm=False))
    assert torch.allclose(raw, torch.stack([want_text[3], want_images[2]]), atol=TOL)
    # the text tower reads exactly transformers' ids: CLIP's up to its EOS, SigLIP's padded to its context
    ids = llm.embed(TEXTS[1], use_tqdm=False)[0].prompt_token_ids
    assert ids == hf_ids(hf, kind, TEXTS[1])[0].tolist()


def test_text_and_image_compare_by_cosine_as_transformers(llm, hf, kind):
    model, tokenizer, processor = hf
    texts = TEXTS[:2]
    ids = (
        torch.cat([hf_ids(hf, kind, t) for t in texts])
        if kind == "siglip"
        else tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]
    )
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=processor(IMAGES[:2], return_tensors="pt")["pixel_values"])
    cosines = out.logits_per_image - (0 if kind == "clip" else model.logit_bias)
    cosines = cosines / model.logit_scale.exp()
    got_images = embeddings(llm.embed(list(map(image_prompt, IMAGES[:2])), use_tqdm=False))
    got_texts = embeddings(llm.embed(texts, use_tqdm=False))
    assert torch.allclose(got_images @ got_texts.T, cosines, atol=TOL)


def test_an_image_is_encoded_once_per_content(llm):
    encoder = llm.llm_engine.model_runner.encoder
    before = encoder.num_encoded
    fresh = random_image(9, (45, 31))
    twice = embeddings(llm.embed([image_prompt(fresh), image_prompt(fresh.copy())], use_tqdm=False))
    assert encoder.num_encoded - before == 1 and torch.equal(twice[0], twice[1])


@pytest.mark.parametrize("legacy", [False, True])
def test_clip_pools_its_eos_as_transformers_does(tmp_path, legacy):
    """Token ids with two EOS tokens and a larger id before them: the first EOS pooled (the largest id with
    transformers' legacy `eos_token_id` 2), whatever follows it."""
    from transformers import CLIPModel

    from tiffin.testing.tiny_dual_encoder import make_tiny_dual_encoder

    path = make_tiny_dual_encoder(tmp_path, "clip", legacy_eos=legacy)
    model, llm = CLIPModel.from_pretrained(path).eval(), LLM(str(path), dtype="float32")
    eos = model.config.text_config.vocab_size - 1
    prompts = [[eos - 1, 40, 41, eos, 50, eos, 60], [70, 71, 72], [eos - 1, 80, eos]]
    for ids in prompts:
        with torch.no_grad():
            want = model.get_text_features(input_ids=torch.tensor([ids])).pooler_output
        out = llm.embed([ids], PoolingParams(normalize=False), use_tqdm=False)[0]
        assert torch.allclose(torch.tensor([out.outputs.embedding]), want, atol=TOL), ids


def test_refusals_name_the_problem(llm, kind):
    engine = llm.llm_engine
    image = IMAGES[0]
    cases = {
        "not both": {"prompt": "a cat", "multi_modal_data": {"image": image}},
        "one image per input": {"prompt": "", "multi_modal_data": {"image": [image, image]}},
        "limit_mm_per_prompt": {"prompt": "", "multi_modal_data": {"image": [image] * 5}},
        "PIL image": {"prompt": "", "multi_modal_data": {"image": "data:image/png;base64,AAAA"}},
    }
    for problem, prompt in cases.items():
        with pytest.raises(ParamError, match=problem) as e:
            llm.embed([TEXTS[0], prompt], use_tqdm=False)
        assert e.value.param == "multi_modal_data"
    size = engine.model_config.multimodal.embedding_size
    with pytest.raises(ParamError, match=f"at most the model's {size}"):
        llm.embed([TEXTS[0]], PoolingParams(dimensions=size + 1), use_tqdm=False)
    assert len(llm.embed([TEXTS[0]], PoolingParams(dimensions=size), use_tqdm=False)[0].outputs.embedding) == size
    with pytest.raises(ValueError, match="generate"):
        llm.generate(["a cat"], SamplingParams(max_tokens=2), use_tqdm=False)
    context = engine.max_model_len
    with pytest.raises(ParamError, match=f"maximum context length is {context}"):
        llm.embed(["word " * context], use_tqdm=False)
    assert (
        not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    )


@pytest.fixture(scope="module")
def cpu_outputs(llm) -> torch.Tensor:
    """The CPU engine's embeddings of the CUDA test's inputs, computed before any emulation starts."""
    return embeddings(llm.embed([TEXTS[0], image_prompt(IMAGES[0]), TEXTS[1]], use_tqdm=False))


def test_cuda_path_equals_cpu_and_profiles_a_step_of_images(checkpoint, cpu_outputs, cuda_emulation, monkeypatch):
    """The CUDA path (emulated on the CPU, Triton's paged attention under the interpreter: CLIP's causal, SigLIP's
    not) gives the CPU path's embeddings; the memory profile's step runs the tower on max_num_seqs images (each
    sequence holds one), in one forward."""
    from tiffin.engine.models.dual_encoder import DualEncoderModel
    from tiffin.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    encoded, forward = [], DualEncoderModel.forward
    monkeypatch.setattr(
        DualEncoderModel, "forward", lambda m, *a, mm=None, **k: encoded.append(mm) or forward(m, *a, mm=mm, **k)
    )
    kwargs = dict(device="cuda", dtype="float32", max_num_batched_tokens=128, max_num_seqs=3, enforce_eager=True,
                  gpu_memory_utilization=0.008)  # fmt: skip
    cuda = LLM(checkpoint, **kwargs)
    assert [len(mm.indices) for mm in encoded if mm is not None] == [3]  # the profile's step
    got = embeddings(cuda.embed([TEXTS[0], image_prompt(IMAGES[0]), TEXTS[1]], use_tqdm=False))
    assert torch.allclose(got, cpu_outputs, atol=TOL)


def test_an_image_to_a_text_only_embedding_model_is_refused(tmp_path):
    from tiffin.tiny_bert import make_tiny_bert

    bert = LLM(str(make_tiny_bert(tmp_path)), dtype="float32")
    with pytest.raises(ParamError, match="takes text only; it cannot read images") as e:
        bert.embed([image_prompt(IMAGES[0])], use_tqdm=False)
    assert e.value.param == "multi_modal_data"
