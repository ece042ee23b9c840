"""A prompt's images as the engine carries them: each image's placeholder token expanded to the model's image tokens,
its pixel values, and a content hash that names it in the encoder cache and the prefix cache's block hashes.

Invariants:
- An image's placeholders are one run of image tokens at `offset` (`tokens_per_image` of them, or as many as its
  pixels make where the model's images vary in size); the prompt holds exactly as many `<image>` tokens as images
  were given, in order. A model that tiles an image (Idefics3) makes each tile an image of its own here, its run
  between the model's marker tokens.
- Two images hash alike only if their pixel values (as the tower takes them) are equal, byte for byte."""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.errors import ParamError
from tiffin.engine.multimodal.image import check_pixels, decode_image


@dataclass(frozen=True, eq=False)
class ImageInput:
    offset: int  # the prompt position of its first placeholder
    length: int  # its placeholders: the embeddings' rows
    hash: bytes  # of its pixel values (`image_hash`)
    pixel_values: torch.Tensor  # [3, H, W] (Qwen2-VL: `multimodal.patches`' layout), float32, on the host


@dataclass(frozen=True)
class ImageLimits:
    """The engine's image settings (EngineConfig's fields of the same names)."""

    limit_mm_per_prompt: int
    max_image_pixels: int
    max_image_bytes: int
    allowed_media_domains: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: EngineConfig, multimodal) -> "ImageLimits | None":
        """The limits of an engine serving a model of `multimodal` (its image config; None: text only, no limits)."""
        if multimodal is None:
            return None
        allowed = tuple(filter(None, (config.allowed_media_domains or "").split(",")))
        return cls(config.limit_mm_per_prompt, config.max_image_pixels, config.max_image_bytes, allowed)


def image_hash(pixel_values: torch.Tensor) -> bytes:
    pixels = pixel_values.contiguous()
    return hashlib.sha256(str(tuple(pixels.shape)).encode() + pixels.numpy().tobytes()).digest()


def expand_placeholders(
    token_ids: list[int],
    prompts: list[tuple[list[int], torch.Tensor]],
    image_token_id: int,
    image_tokens: Callable[[torch.Tensor], int],
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """`token_ids` with the i-th image token replaced by `prompts[i]`'s ids (an image's prompt: one image token where
    each of its pixel tensors goes, the model's markers around them), each image token there expanded to
    `image_tokens(its pixel tensor)` of them with its pixel tensor placed there; ParamError unless the prompt holds
    one image token per image."""
    places = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(places) != len(prompts):
        raise ParamError(
            "multi_modal_data",
            f"the prompt has {len(places)} image placeholder tokens (id {image_token_id}) for {len(prompts)} "
            "images: put one placeholder where each image goes",
        )
    expanded, images, last = [], [], 0
    for place, (ids, pixels) in zip(places, prompts):
        expanded += token_ids[last:place]
        runs = iter(pixels)
        for t in ids:
            if t != image_token_id:
                expanded.append(t)
                continue
            tile = next(runs)
            length = image_tokens(tile)
            images.append(ImageInput(len(expanded), length, image_hash(tile), tile))
            expanded += [image_token_id] * length
        last = place + 1
    return expanded + token_ids[last:], tuple(images)


def images_key(images: tuple[ImageInput, ...], start: int, end: int) -> bytes:
    """The hashes of the images whose placeholders overlap prompt positions [start, end): a KV block's key beside
    its tokens, so that blocks over different images never match (the hash chain carries it to later blocks)."""
    return b"".join(image.hash for image in images if image.offset < end and start < image.offset + image.length)


def decode_file(data: bytes, limits: ImageLimits, where: str):
    """The image an uploaded file holds (`decode_image`), refused past `max_image_bytes` before it is opened."""
    if len(data) > limits.max_image_bytes:
        raise ParamError(
            "multi_modal_data",
            f"{where}: the image's {len(data)} bytes exceed max_image_bytes={limits.max_image_bytes}",
        )
    return decode_image(data, limits.max_image_pixels, where)


def prompt_images(
    token_ids: list[int], data, config, limits: ImageLimits, tokenizer
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A prompt's `multi_modal_data` (vLLM's `{"image": a PIL image or a list of them}`; an image file's bytes too,
    decoded within `limits` as an API's images are) preprocessed, the prompt's
    placeholders expanded (`expand_placeholders`); `config`: the model's image config (`LlavaConfig`,
    `Idefics3Config`; None: a text-only model), whose `image_prompt` writes each image's ids with `tokenizer`.
    ParamError naming the setting or the problem."""
    from PIL import Image

    if config is None:
        raise ParamError("multi_modal_data", "this model takes text only; it cannot read images")
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ParamError("multi_modal_data", "multi_modal_data takes 'image': a PIL image or a list of them")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(images) > limits.limit_mm_per_prompt:
        raise ParamError(
            "multi_modal_data", f"{len(images)} images is more than limit_mm_per_prompt={limits.limit_mm_per_prompt}"
        )
    for i, image in enumerate(images):
        where = f"multi_modal_data.image[{i}]"
        if isinstance(image, bytes):
            images[i] = image = decode_file(image, limits, where)
        if not isinstance(image, Image.Image):
            raise ParamError("multi_modal_data", f"{where}: a PIL image is needed, got {type(image).__name__}")
        check_pixels(image.size, limits.max_image_pixels, where)
    prompts = [config.image_prompt(image, tokenizer) for image in images]
    if hasattr(config, "place_images"):  # a dual encoder (CLIP, SigLIP): a text or an image, no placeholders
        return config.place_images(token_ids, prompts, tokenizer)
    # a model whose images vary in size (Qwen2-VL) counts each one's tokens; the others take `tokens_per_image`
    image_tokens = getattr(config, "image_tokens", lambda pixels: config.tokens_per_image)
    return expand_placeholders(token_ids, prompts, config.image_token_id, image_tokens)
