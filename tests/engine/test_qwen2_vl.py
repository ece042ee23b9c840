"""Qwen2-VL end to end on a tiny random fp32 checkpoint written by transformers (`tiffin.testing.tiny_qwen2_vl`):
patches equal to transformers' `Qwen2VLImageProcessorPil` on varied images, M-RoPE positions equal to its
`get_rope_index` (whole prompts and chunks of them, and the rope delta of the decode positions), the M-RoPE rotation
equal to its rotary embedding's, greedy tokens and their logprobs equal to transformers' `generate` with one and two
images of different sizes and aspect ratios, mixed with a text-only request in one batch, with image runs split across
prefill chunks, and after a prefix-cache hit on the text before an image."""

import numpy as np
import pytest
import torch
from references import reference_vlm, vision_language_model

from tests.engine.test_llava import assert_matches, generate, random_image
from tiffin import LLM, SamplingParams
from tiffin.engine.errors import ParamError

PIL = pytest.importorskip("PIL.Image")
NEW_TOKENS = 32
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"<|bos|><|im_start|>user\n{IMAGE}What is shown here?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|bos|><|im_start|>user\n{IMAGE}and{IMAGE}Compare the two.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|bos|><|im_start|>user\nSay something about the standard library.<|im_end|>\n<|im_start|>assistant\n"


def load_hf(path) -> tuple:
    """transformers' model (Qwen2-VL's or Qwen2.5-VL's), tokenizer and PIL image processor of the checkpoint at
    `path`."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil.from_pretrained(path)
    return vision_language_model(path), AutoTokenizer.from_pretrained(path), images


@pytest.fixture(scope="module")
def hf(tiny_qwen2_vl):
    return load_hf(tiny_qwen2_vl)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, dtype="float32")


@pytest.fixture(scope="module")
def images():
    """9 x 7 image tokens, 4 x 15 (wide), 8 x 2 (tall), and 2 x 2 (a small image scaled up to min_pixels)."""
    return [random_image(1, (70, 90)), random_image(2, (120, 30)), random_image(3, (20, 64)), random_image(4, (9, 9))]


def processed(hf, text: str, images: list) -> dict:
    """What `Qwen2VLProcessor` makes of `text` and `images` (its video processor needs torchvision, so its steps here:
    each `<|image_pad|>` repeated once per image token, `mm_token_type_ids` 1 there)."""
    model, tokenizer, processor = hf
    ids, pixels = tokenizer(text, add_special_tokens=False)["input_ids"], {}
    if images:
        pixels = dict(processor(images, return_tensors="pt"))
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for t0 in ids for t in ([t0] * next(counts) if t0 == model.config.image_token_id else [t0])]
    x = torch.tensor([ids])
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "mm_token_type_ids": (x == 2046).int(), **pixels}


def reference(hf, text: str, images: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs over the processor's inputs."""
    return reference_vlm(hf[0], processed(hf, text, images), NEW_TOKENS)[:2]


def as_prompt(text: str, images: list) -> dict:
    data = {"multi_modal_data": {"image": images}} if images else {}
    return {"prompt": text, "add_special_tokens": False, **data}


def test_image_token_id_is_the_checkpoints(hf):
    assert hf[0].config.image_token_id == 2046  # `processed` marks it


@pytest.mark.parametrize(
    "mode, size",
    [("RGB", (1, 1)), ("RGB", (4000, 300)), ("RGB", (300, 4000)), ("RGB", (5, 300)), ("RGB", (57, 91)),
     ("RGB", (64, 64)), ("RGB", (63, 65)), ("RGB", (96, 64)), ("RGB", (200, 131)), ("RGBA", (77, 60)),
     ("L", (33, 90)), ("LA", (90, 33)), ("P", (64, 64)), ("RGB", (12, 20))],
)  # fmt: skip
def test_patches_equal_transformers_pil_processor(llm, hf, mode, size):
    image = random_image(sum(size), size, mode)
    want = hf[2](image, return_tensors="pt")
    got = llm.llm_engine.model_config.multimodal.processor(image)
    _, rows, cols = want["image_grid_thw"][0].tolist()
    assert got.shape[:4] == (rows // 2, cols // 2, 2, 2)
    flat = got.reshape(-1, got.shape[-1])
    assert flat.dtype == want["pixel_values"].dtype and torch.equal(flat, want["pixel_values"])


def test_extreme_aspect_ratio_is_refused_by_name(llm):
    with pytest.raises(ParamError, match="aspect ratio past 200") as e:
        llm.llm_engine.add_request("thin", as_prompt(ONE, [random_image(0, (1000, 4))]), SamplingParams(max_tokens=1))
    assert e.value.param == "multi_modal_data" and not llm.llm_engine.has_unfinished_requests()


def test_prompt_ids_equal_the_processors(llm, hf, images):
    got = llm.llm_engine.tokenize(as_prompt(TWO, images[:2]))
    assert got.token_ids == processed(hf, TWO, images[:2])["input_ids"][0].tolist()
    assert [i.length for i in got.images] == [63, 60]


def scheduled(token_ids: list[int], images: tuple, chunks: list[int]):
    """Steps that prefill a sequence of `token_ids` and `images` in `chunks` (token counts), each beside a text-only
    sequence of 3 tokens; yields (step, the image sequence's rows of its batch)."""
    from tiffin.engine.core.scheduler import SchedulerOutput
    from tiffin.engine.core.sequence import Sequence

    seq, done = Sequence("r", 0, token_ids, SamplingParams(), 1, images=images), 0
    for n in chunks:
        text = Sequence("t", 0, [5, 6, 7], SamplingParams(), 1)
        step = SchedulerOutput()
        step.add(text, 3)
        step.add(seq, n)
        seq.num_computed_tokens = done
        yield step, slice(3, 3 + n)
        done += n


@pytest.mark.parametrize("chunks", [[None], [40, 50, None], [1, 62, 1, None]], ids=["whole", "chunks", "edges"])
def test_mrope_positions_equal_transformers_rope_index(llm, hf, images, chunks):
    """Whole prompts and chunks of them (cut inside images, at their edges) beside a text-only sequence: the image
    sequence's rows are transformers' positions, the text one's its indices; a step that schedules no image token
    carries one row per token."""
    from tiffin.engine.multimodal.mrope import mrope_positions

    prompt = llm.llm_engine.tokenize(as_prompt(TWO, images[1:3]))
    inputs = processed(hf, TWO, images[1:3])
    want, delta = hf[0].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    n = len(prompt.token_ids)
    chunks = [c or n - sum(filter(None, chunks)) for c in chunks]
    got = []
    for step, rows in scheduled(prompt.token_ids, prompt.images, chunks):
        query_lens = np.array(step.num_scheduled_tokens)
        index = np.concatenate([np.arange(3), np.arange(rows.stop - rows.start) + step.seqs[1].num_computed_tokens])
        positions = mrope_positions(index, step, query_lens)
        three = positions if positions.ndim == 2 else np.repeat(positions[None], 3, 0)
        assert (three[:, :3] == np.arange(3)).all()
        images_here = any(t == 2046 for t in step.seqs[1].scheduled_token_ids(index[3], rows.stop - rows.start))
        assert positions.ndim == 1 + images_here
        got.append(three[:, rows])
    np.testing.assert_array_equal(np.concatenate(got, axis=1), want[:, 0].numpy())
    # a decode step after the prompt: its index shifted by transformers' rope delta
    step = next(scheduled(prompt.token_ids + [9], prompt.images, [n + 1]))[0]
    step.seqs[1].num_computed_tokens, step.num_scheduled_tokens[1] = n, 1
    decode = mrope_positions(np.array([0, 1, 2, n]), step, np.array([3, 1]))
    assert decode.ndim == 1 and decode[3] == n + delta.item()


def test_mrope_rotation_equals_transformers():
    """[3, T] positions through `MRotaryEmbedding` (per-token tables, the native or torch rotation) rotate q as
    transformers' M-RoPE does; [T] positions as the plain rotary embedding."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    from tiffin.engine.models.layers import MRotaryEmbedding, RotaryEmbedding

    section = [4, 6, 6]
    hf_config = Qwen2VLTextConfig(hidden_size=128, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})  # fmt: skip
    positions = torch.randint(0, 200, (3, 11))
    q = torch.randn(11, 4, 32)
    cos, sin = Qwen2VLRotaryEmbedding(hf_config)(q, positions[:, None])
    want = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)[0][0].transpose(0, 1)
    ours = MRotaryEmbedding(32, 256, 10000.0, None, tuple(section))
    torch.testing.assert_close(ours.at(positions)(q.clone()), want, atol=1e-5, rtol=1e-5)
    plain = RotaryEmbedding(32, 256, 10000.0, None)
    assert torch.equal(ours.at(positions[0])(q.clone()), plain.at(positions[0])(q.clone()))


def test_qwen2_5_vl_greedy_and_logprobs_match_transformers(tiny_qwen2_5_vl, images):
    """Qwen2.5-VL (RMSNorms, gated MLP, attention within windows of 2 x 2 tokens in block 0, ragged at the edges of
    9 x 7, 4 x 15 and 8 x 2 grids; the whole image in block 1): one and two images and a text-only prompt in one
    batch, image runs split across 40-token chunks."""
    hf = load_hf(tiny_qwen2_5_vl)
    cases = [(ONE, images[:1]), (TEXT, []), (TWO, images[1:3])]
    llm = LLM(tiny_qwen2_5_vl, dtype="float32", max_num_batched_tokens=40)
    got = generate(llm, [as_prompt(text, imgs) for text, imgs in cases])
    for g, (text, imgs) in zip(got, cases):
        assert_matches(g, reference(hf, text, imgs))


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 40}], ids=["plain", "chunked"])
def test_greedy_and_logprobs_match_transformers_mixed_with_text(tiny_qwen2_vl, hf, images, engine_args):
    """One and two images of different sizes and aspect ratios and a text-only prompt in one continuous batch;
    `chunked`: a 40-token budget splits the image runs (up to 63 tokens) across steps."""
    cases = [(ONE, images[:1]), (TEXT, []), (TWO, images[1:3]), (ONE, images[3:])]
    llm = LLM(tiny_qwen2_vl, dtype="float32", **engine_args)
    got = generate(llm, [as_prompt(text, imgs) for text, imgs in cases])
    for g, (text, imgs) in zip(got, cases):
        assert_matches(g, reference(hf, text, imgs))
    assert llm.llm_engine.stats().kv_blocks_used == 0


def test_prefix_hit_on_the_text_before_an_image(llm, hf, images):
    """The same text before different images: the second request finds the text's full block in the prefix cache,
    not the image's, and still answers as transformers does; the same image again hits its blocks too."""
    text = "<|bos|><|im_start|>user\n" + "a b c d e f g h i j k l m n o p q r " + IMAGE + "What is it?<|im_end|>\n"
    first, second, again = (as_prompt(text, [image]) for image in (images[0], images[1], images[0]))
    offset = llm.llm_engine.tokenize(first).images[0].offset
    assert 16 < offset < 32
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([first], params, use_tqdm=False)
    cached = llm.generate([second, again], params, use_tqdm=False)
    assert cached[0].num_cached_tokens == 16  # the text block only
    assert cached[1].num_cached_tokens >= offset + 63  # the same image: its blocks too
    for out, image in zip((*outs, *cached), (images[0], images[1], images[0])):
        c = out.outputs[0]
        assert_matches((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]),
                       reference(hf, text, [image]))  # fmt: skip


def test_chat_template_places_the_image(llm, hf, images):
    """A chat with an image part renders as the checkpoint's chat template writes it, placeholders expanded."""
    from tests.engine.test_idefics3 import messages_with

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    rendered = llm.llm_engine.render_chat(messages_with(messages, images[0]))
    assert rendered.token_ids == processed(hf, text, images[:1])["input_ids"][0].tolist()


CUDA_PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def cuda_cases(llm, images):
    """The prompts of the CUDA test (a wide image, a text-only chat) and the CPU engine's outputs for them, computed
    before any emulation starts."""
    cases = [as_prompt(ONE, images[1:2]), as_prompt(TEXT, [])]
    return cases, [llm.generate(case, CUDA_PARAMS, use_tqdm=False)[0].outputs[0] for case in cases]


def test_cuda_path_with_graphs_equals_cpu(tiny_qwen2_vl, cuda_cases, cuda_emulation, monkeypatch):
    """The CUDA path (emulated on the CPU, Triton under the interpreter: M-RoPE's per-token tables through the fused
    rotary kernel), its decode steps replaying graphs at the shifted positions: the tokens are the CPU engine's."""
    from tiffin.engine.worker import model_runner

    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    kwargs = dict(dtype="float32", max_num_batched_tokens=96, max_num_seqs=2, max_model_len=96, num_kv_blocks=32)
    cuda = LLM(tiny_qwen2_vl, device="cuda", **kwargs)
    assert cuda.llm_engine.model_runner.decode_graphs is not None
    cases, want = cuda_cases
    replays = cuda_emulation.replays
    got = [cuda.generate(case, CUDA_PARAMS, use_tqdm=False)[0].outputs[0] for case in cases]
    assert cuda_emulation.replays > replays
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)],
                                   [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)], atol=1e-3)  # fmt: skip


def test_gpu_memory_profile_encodes_the_largest_image(tiny_qwen2_vl, cuda_emulation, monkeypatch):
    """On CUDA (emulated; torch kernels, no graphs: the profile is what is tested) the profiling step encodes images
    of the most tokens an image can take (8 x 8 at 4,096 pixels), as many as its tokens hold."""
    from tiffin.engine.models.qwen2_vl import Qwen2VLForConditionalGeneration

    shapes, embed = [], Qwen2VLForConditionalGeneration.embed_images
    monkeypatch.setattr(
        Qwen2VLForConditionalGeneration, "embed_images", lambda m, px: shapes.append(px.shape[:3]) or embed(m, px)
    )
    kwargs = dict(dtype="float32", max_num_batched_tokens=128, max_num_seqs=2, max_model_len=128)
    engine = LLM(tiny_qwen2_vl, device="cuda", kernel_backend="torch", enforce_eager=True,
                 gpu_memory_utilization=0.01, **kwargs).llm_engine  # fmt: skip
    assert shapes == [(2, 8, 8)] and engine.model_runner.encoder.num_encoded == 0


HUB_CONFIG = {  # Qwen/Qwen2-VL-2B-Instruct's config.json: flat, M-RoPE spelled as a rope_scaling type
    "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2_vl", "num_attention_heads": 12, "num_hidden_layers": 28,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}  # fmt: skip


def test_hub_config_and_preprocessor_are_read(tmp_path):
    """The hub's flat config.json and its preprocessor_config.json (`min_pixels` / `max_pixels`): the language model
    a Qwen2 of tied embeddings and theta 1e6, M-RoPE's sections, the tower's shape, the pixel budget."""
    import json

    from tiffin.engine.models.config import ModelConfig
    from tiffin.engine.models.qwen2_vl import Qwen2VLConfig, text_config

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor"}))  # fmt: skip
    mm = Qwen2VLConfig.from_hf(HUB_CONFIG, tmp_path)
    assert mm.mrope_section == (16, 24, 24) and mm.image_token_id == 151655
    assert (mm.vision.depth, mm.vision.embed_dim, mm.vision.out_dim, mm.vision.mlp_dim) == (32, 1280, 1536, 5120)
    assert (mm.processor.min_pixels, mm.processor.max_pixels, mm.tokens_per_image) == (3136, 12845056, 16384)
    text = ModelConfig.from_hf(text_config(HUB_CONFIG), None, True, False)
    assert (text.num_layers, text.head_dim, text.rope_theta, text.rope_scaling) == (28, 128, 1e6, None)
    assert text.tie_word_embeddings and text.dtype == torch.bfloat16


def test_qwen2_5_vl_hub_config_is_read(tmp_path):
    """Qwen/Qwen2.5-VL-3B-Instruct's config.json (flat, its tower's sizes under Qwen2.5-VL's names): windows of
    112 px = 4 x 4 tokens, full attention in every eighth block."""
    from tiffin.engine.models.qwen2_vl import Qwen2VLConfig

    vision = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
              "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
              "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
              "tokens_per_second": 2, "temporal_patch_size": 2}  # fmt: skip
    raw = {**HUB_CONFIG, "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "hidden_size": 2048, "vision_config": vision}  # fmt: skip
    v = Qwen2VLConfig.from_hf(raw, tmp_path).vision
    assert (v.v2_5, v.embed_dim, v.out_dim, v.mlp_dim, v.window, v.full_blocks) == (
        True, 1280, 2048, 3420, 4, (7, 15, 23, 31))  # fmt: skip
