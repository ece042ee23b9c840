"""A tiny random Idefics3 / SmolVLM checkpoint written with transformers (`make_tiny_idefics3`): tiffin.tiny's Llama as
the language model (its tokenizer less 40 tokens, plus Idefics3's added tokens: `<fake_token_around_image>`,
`<image>`, `<global-img>`, `<end_of_utterance>` and the 6 x 6 `<row_r_col_c>` markers), a small SigLIP tower (32 px
tiles of 4 px patches) and the connector (scale factor 2: 16 image tokens per tile), random throughout (LayerNorms
and biases too, `tiny_llava._init`); an `Idefics3Processor` (PIL image processor, 96 px longest edge: up to 3 x 3
tiles and the global image) and a SmolVLM-style chat template (`User:<image>...<end_of_utterance>`). Same arguments
give the same weights."""

import pathlib

from tiffin import tiny
from tiffin.testing.tiny_llava import _init

TILE, PATCH, SCALE, LONGEST_EDGE = 32, 4, 2, 96
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE**2
ADDED_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}{{ message['role'] | capitalize }}"
    "{%- if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{%- else %}{{ ':' if message['content'][0]['type'] == 'image' else ': ' }}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<image>' }}{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<end_of_utterance>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'Assistant:' }}{%- endif %}"
)


def make_tiny_idefics3(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = tiny.make_config("llama")
    tiny.write_tokenizer(path, text["vocab_size"] - len(ADDED_TOKENS), False, text["max_position_embeddings"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == text["vocab_size"]
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
        patch_size=PATCH,
    )  # fmt: skip
    config = Idefics3Config(
        text_config=LlamaConfig(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")}),
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=image_token_id,
        dtype="float32",
    )
    model = Idefics3ForConditionalGeneration(config).eval()
    state = {}
    for name, tensor in tiny.make_weights(text, seed).items():
        state[name if name == "lm_head.weight" else "model.text_model." + name.removeprefix("model.")] = tensor
    for name, param in model.named_parameters():
        if name not in state:
            state[name] = _init(name, param.shape, seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    model.save_pretrained(path)
    images = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE})
    Idefics3Processor(images, tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.save_pretrained(path)
    tiny._write_json(path / "generation_config.json", {"bos_token_id": tiny.BOS_ID, "eos_token_id": tiny.IM_END_ID})
    return path
