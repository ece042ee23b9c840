"""A tiny random LLaVA-1.5 checkpoint written with transformers (`make_tiny_llava`): tiffin.tiny's Llama as the
language model (its tokenizer less one token, plus `<image>` as the last id), a small CLIP vision tower and the
projector, random throughout (LayerNorms and biases too) so that images move the outputs well above float32 noise;
a `CLIPImageProcessorPil` config and a LLaVA chat template (`USER: <image>\\n...`). Same arguments give the same
weights."""

import pathlib
import zlib

import torch

from tiffin import tiny

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<image>\n' }}{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'ASSISTANT:' }}{%- endif %}"
)


def make_tiny_llava(
    path: str | pathlib.Path, image_size: int = 56, patch_size: int = 14, seed: int = 0, feature_layer: int = -2
) -> pathlib.Path:
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = tiny.make_config("llama")
    tiny.write_tokenizer(path, text["vocab_size"] - 1, False, text["max_position_embeddings"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == text["vocab_size"] - 1 == len(tokenizer) - 1
    tokenizer.save_pretrained(path)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
    )
    config = LlavaConfig(
        text_config=LlamaConfig(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")}),
        vision_config=vision,
        image_token_index=image_token_id,
        vision_feature_layer=feature_layer,
        projector_hidden_act="gelu",
        dtype="float32",
    )
    model = LlavaForConditionalGeneration(config).eval()
    state = {}
    for name, tensor in tiny.make_weights(text, seed).items():
        state[name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")] = tensor
    for name, param in model.named_parameters():
        if name not in state:
            state[name] = _init(name, param.shape, seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "position_ids" not in m], (missing, unexpected)
    model.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=image_size).save_pretrained(path)
    tiny._write_json(path / "generation_config.json", {"bos_token_id": tiny.BOS_ID, "eos_token_id": tiny.IM_END_ID})
    return path


def _init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    x = torch.randn(shape, generator=gen)
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.1 * x
    if name.endswith("bias"):
        return 0.1 * x
    if len(shape) == 1 or "embedding" in name:  # class and position embeddings
        return x
    fan_in = shape[1:].numel()
    return x / fan_in**0.5
