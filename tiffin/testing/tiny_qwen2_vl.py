"""A tiny random Qwen2-VL checkpoint written with transformers (`make_tiny_qwen2_vl`): tiffin.tiny's Qwen2 as the
language model (its tokenizer less 4 tokens, plus Qwen2-VL's `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`
and `<|video_pad|>`; M-RoPE over head_dim 16, `mrope_section` [2, 3, 3]), a small vision tower (4 px patches, a
temporal patch of 2, 2 x 2 patch merge: one image token per 8 x 8 pixels) random throughout (LayerNorms and biases
too, `tiny_llava._init`); a `Qwen2VLImageProcessorPil` config (256 to 4,096 pixels: 4 to 64 image tokens) and a
Qwen2-VL-style chat template (`<|vision_start|><|image_pad|><|vision_end|>` for each image). Same arguments
give the same weights."""

import pathlib

from tiffin import tiny
from tiffin.testing.tiny_llava import _init

PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 256, 4096
MROPE_SECTION = [2, 3, 3]
ADDED_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def make_tiny_qwen2_vl(path: str | pathlib.Path, seed: int = 0, v2_5: bool = False) -> pathlib.Path:
    """With `v2_5`, Qwen2.5-VL: its tower's RMSNorms and gated MLP, windows of 2 x 2 image tokens in block 0 and
    full attention in block 1."""
    import transformers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = tiny.make_config("qwen2", tie_word_embeddings=False)
    tiny.write_tokenizer(path, text["vocab_size"] - len(ADDED_TOKENS), False, text["max_position_embeddings"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == text["vocab_size"]
    ids = dict(zip(("vision_start", "vision_end", "image", "video"), tokenizer.convert_tokens_to_ids(ADDED_TOKENS)))
    text_config = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "rope_theta")}
    text_config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION}
    vision = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
    if v2_5:
        vision |= dict(hidden_size=32, intermediate_size=48, out_hidden_size=text["hidden_size"], hidden_act="silu",
                       window_size=2 * MERGE * PATCH, fullatt_block_indexes=[1])  # fmt: skip
    else:
        vision |= dict(embed_dim=32, hidden_size=text["hidden_size"], mlp_ratio=2)
    name = "Qwen2_5_VL" if v2_5 else "Qwen2VL"
    config = getattr(transformers, f"{name}Config")(
        text_config=text_config,
        vision_config=vision,
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        dtype="float32",
    )
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    state = {}
    for name, tensor in tiny.make_weights(text, seed).items():
        state[name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")] = tensor
    for name, param in model.named_parameters():
        if name not in state:
            state[name] = _init(name, param.shape, seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    model.save_pretrained(path)
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=PATCH, merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
    )  # fmt: skip
    images.save_pretrained(path)  # no Qwen2VLProcessor: its video processor needs torchvision
    tokenizer.save_pretrained(path)
    tiny._write_json(path / "generation_config.json", {"bos_token_id": tiny.BOS_ID, "eos_token_id": tiny.IM_END_ID})
    return path
