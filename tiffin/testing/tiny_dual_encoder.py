"""Tiny random CLIP and SigLIP checkpoints written with transformers (`make_tiny_dual_encoder`): towers of
transformers' own test sizes (hidden 32, 2 layers, intermediate 37, 4 heads but the text tower's 2, 30 px images of
2 px patches), random throughout (LayerNorms and biases too, `tiny_llava._init`); a byte-level `CLIPTokenizer` with
no merges (one token per character, `<|startoftext|>` and `<|endoftext|>` the last ids; the SigLIP checkpoint uses
it too: SigLIP's own is sentencepiece's), and the PIL image processor's config. Same arguments give the same
weights."""

import pathlib

from tiffin.testing.tiny_llava import _init

TOWER = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2}
VISION = {**TOWER, "num_attention_heads": 4, "image_size": 30, "patch_size": 2}
TEXT = {**TOWER, "num_attention_heads": 2}  # heads of 16: the smallest the Triton paged attention takes
PROJECTION_DIM = 24  # CLIP's, unlike its towers' widths; SigLIP's text head projects into the vision width


def tiny_tokenizer():
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)}
    vocab |= {"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def make_tiny_dual_encoder(
    path: str | pathlib.Path, kind: str = "clip", seed: int = 0, max_text_tokens: int = 64, legacy_eos: bool = False
) -> pathlib.Path:
    """`kind`: "clip" or "siglip"; `max_text_tokens`: the text tower's positions (SigLIP pads to them);
    `legacy_eos`: CLIP's text config says `eos_token_id` 2, as the hub's first CLIP checkpoints do (transformers
    then pools the largest token id)."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        SiglipConfig,
        SiglipImageProcessorPil,
        SiglipModel,
    )

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": 2 if legacy_eos else tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    text = {**TEXT, **ids, "max_position_embeddings": max_text_tokens}
    if kind == "clip":
        config = CLIPConfig(text_config=text, vision_config=VISION, projection_dim=PROJECTION_DIM, dtype="float32")
        model, processor = CLIPModel(config), CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size=30)
    else:
        config = SiglipConfig(text_config=text, vision_config=VISION, dtype="float32")
        model, processor = SiglipModel(config), SiglipImageProcessorPil(size={"height": 30, "width": 30})
    for name, param in model.named_parameters():
        param.data.copy_(_init(name, param.shape, seed))
    model.eval().save_pretrained(path)
    processor.save_pretrained(path)
    return path
