"""Idefics3 and SmolVLM (transformers' `Idefics3ForConditionalGeneration`): a SigLIP vision tower (`siglip.py`) over
each tile of an image (`multimodal.tiles`: rows x cols tiles and a global image), a pixel shuffle that folds each
`scale_factor` x `scale_factor` square of patches into one token, a bias-free projection into the language model's
embedding space (the connector), and the Llama language model reading those embeddings in place of each tile's run
of `<image>` tokens. Tiles are encoded one by one (no attention across tiles), so each tile is an image of its own to
the engine: its own placeholder run, content hash and encoder-cache entry.

Checkpoint names (`model.text_model.`, `model.vision_model.`, `model.connector.`, `lm_head.`) map onto this module's
(`checkpoint_prefixes`); the hub's SmolVLM checkpoints and what transformers 5 saves spell them alike."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tiffin.engine.models.clip import VisionConfig
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.llava import VisionLanguageModel
from tiffin.engine.models.siglip import SiglipVisionModel
from tiffin.engine.multimodal.tiles import TileProcessor, image_prompt


def complete_config(raw: dict) -> dict:
    """config.json with transformers' defaults filled in, its sub-configs' too (the hub's spell only what differs)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING["idefics3"].from_dict({k: v for k, v in raw.items() if k != "model_type"}).to_dict()


@dataclass(frozen=True)
class Idefics3Config:
    """What config.json says of the images beside its `text_config`, and how its images are preprocessed."""

    vision: VisionConfig
    image_token_id: int
    scale_factor: int
    processor: TileProcessor

    @classmethod
    def from_hf(cls, raw: dict, path: str | Path) -> "Idefics3Config":
        full = complete_config(raw)
        vision = VisionConfig.from_hf(full["vision_config"], "idefics3_vision")
        per_side, scale = vision.image_size // vision.patch_size, full["scale_factor"]
        if per_side % scale:
            raise ValueError(f"scale_factor {scale} does not divide the tower's {per_side} patches per side")
        return cls(vision, full["image_token_id"], scale, TileProcessor.read(path, vision.image_size))

    @property
    def tokens_per_image(self) -> int:
        """Image tokens per tile: the tile's patches, `scale_factor`² of them folded into each."""
        return (self.processor.tile // self.vision.patch_size) ** 2 // self.scale_factor**2

    def image_prompt(self, image, tokenizer) -> tuple[list[int], torch.Tensor]:
        """The token ids that replace `image`'s `<image>` token, one image token where each tile's run goes, and the
        tiles' pixel values, in that order."""
        tiles, rows, cols = self.processor(image)
        return tokenizer.encode(image_prompt(rows, cols), add_special_tokens=False), tiles


def text_config(raw: dict) -> dict:
    """config.json's `text_config`, complete, as a decoder's config.json (the model's architecture, dtype and
    embedding tying: transformers ties by the top-level flag)."""
    full = complete_config(raw)
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return {**full["text_config"], "architectures": raw["architectures"],
            "tie_word_embeddings": full["tie_word_embeddings"], **({"dtype": dtype} if dtype else {})}  # fmt: skip


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[images, side², d] -> [images, (side / scale)², d * scale²]: each `scale` x `scale` square of the grid becomes
    one token, its features ordered as transformers' Idefics3Connector orders them (row of the square outermost, then
    column, then the feature)."""
    n, seq, d = x.shape
    out = int(seq**0.5) // scale
    x = x.view(n, out, scale, out, scale, d)  # grid row = (out row, row in square), column likewise
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, out * out, d * scale * scale)


class Connector(nn.Module):
    def __init__(self, vision_size: int, text_size: int, scale: int, dtype: torch.dtype):
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_size * scale * scale, text_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = {
        "model.text_model.": "model.",
        "model.vision_model.": "vision_model.",
        "model.connector.": "connector.",
    }

    multimodal_config = staticmethod(Idefics3Config.from_hf)
    text_config = staticmethod(text_config)
    vision_modules = ("vision_model", "connector")

    def build_vision(self, config: ModelConfig) -> None:
        mm: Idefics3Config = config.multimodal
        self.vision_model = SiglipVisionModel(mm.vision, config.dtype)
        self.connector = Connector(mm.vision.hidden_size, config.hidden_size, mm.scale_factor, config.dtype)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, tile, tile] -> [tiles, tokens_per_image, hidden]: what replaces each tile's placeholders."""
        return self.connector(self.vision_model(pixel_values))
