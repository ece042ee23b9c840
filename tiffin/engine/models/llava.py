"""LLaVA-1.5 (transformers' `LlavaForConditionalGeneration`): a CLIP vision tower (`clip.py`) read at
`vision_feature_layer`, its class token dropped ("default" selection), a two-layer projector into the language
model's embedding space, and the Llama language model (`llama.py`) reading those embeddings in place of the image
placeholder tokens' (`MultiModalEmbeddings`, scattered by the model runner's encoder step, `multimodal.encoder`).

Checkpoint names: the hub's (`language_model.model.`, `language_model.lm_head.`, `vision_tower.vision_model.`,
`multi_modal_projector.`), what transformers 5 saves (the same, the tower without `vision_model.`) and its module
names (`model.language_model.`, `model.vision_tower.`, ...) all map onto this module's (`checkpoint_prefixes`)."""

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from tiffin.engine.distributed.pipeline import UNSTAGED, PipelineParallel
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.models.clip import ACTIVATIONS, CLIPVisionModel, VisionConfig
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import EmbeddingFactory, LinearFactory, rename_prefix
from tiffin.engine.models.llama import LlamaForCausalLM
from tiffin.engine.multimodal.image import ImageProcessor

PROJECTOR_ACTIVATIONS = {**ACTIVATIONS, "gelu": nn.functional.gelu}


@dataclass(frozen=True)
class LlavaConfig:
    """What config.json says of the images beside its `text_config`, and how its images are preprocessed."""

    vision: VisionConfig
    image_token_id: int
    feature_layer: int
    select_strategy: str  # "default": the class token dropped; "full": kept
    projector_act: str
    projector_bias: bool
    processor: ImageProcessor

    @classmethod
    def from_hf(cls, raw: dict, path: str | Path) -> "LlavaConfig":
        layer, strategy = raw.get("vision_feature_layer", -2), raw.get("vision_feature_select_strategy", "default")
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: several feature layers are not supported yet")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported")
        act = raw.get("projector_hidden_act", "gelu")
        if act not in PROJECTOR_ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {act!r} is not supported")
        vision = VisionConfig.from_hf(full_config(raw["vision_config"], "clip_vision_model"))
        return cls(
            vision,
            raw.get("image_token_index", raw.get("image_token_id", 32000)),
            layer,
            strategy,
            act,
            raw.get("multimodal_projector_bias", True),
            ImageProcessor.read(path, vision.image_size),
        )

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + (self.select_strategy == "full")

    def image_prompt(self, image, tokenizer) -> tuple[list[int], torch.Tensor]:
        """The token ids that replace `image`'s `<image>` token (itself: its run expands after) and its pixel values."""
        return [self.image_token_id], self.processor(image)[None]


def full_config(raw: dict, default_type: str) -> dict:
    """A sub-config with transformers' defaults filled in (the hub's config.json files spell only what differs)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[raw.get("model_type", default_type)](**raw).to_dict()


def text_config(raw: dict) -> dict:
    """config.json's `text_config`, complete, as a decoder's config.json (its architecture and dtype the model's)."""
    text = full_config(raw["text_config"], "llama")
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return {**text, "architectures": raw["architectures"], **({"dtype": dtype} if dtype else {})}


class MultiModalEmbeddings(NamedTuple):
    """A step's image embeddings: row i of `embeddings` replaces the input embedding of the batch's token
    `indices[i]`."""

    indices: torch.Tensor
    embeddings: torch.Tensor


class MultiModalProjector(nn.Module):
    def __init__(self, vision_size: int, text_size: int, act: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = nn.Linear(vision_size, text_size, bias, dtype=dtype)
        self.linear_2 = nn.Linear(text_size, text_size, bias, dtype=dtype)
        self.act = PROJECTOR_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionLanguageModel(LlamaForCausalLM):
    """A Llama language model reading image embeddings (`embed_images`, the subclass's) in place of the image
    placeholders' token embeddings.

    Under tensor parallelism the language model is sharded as a text model is; the vision tower and projector
    (`build_vision`, the modules named in `vision_modules`) live on rank 0 alone, which encodes each image once (its
    encoder cache the only one) and sends the step's embeddings with the step (`worker.tp_worker`): every rank puts
    the same rows at the same places. The other ranks neither build the tower nor read its weights. Under pipeline
    parallelism rank 0 is the first stage's: it embeds the images with the tokens, and the later stages, which
    receive the step's embeddings too, take the first stage's hidden states as they do under a text model."""

    vision_modules: tuple[str, ...] = ()

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        backend: str,
        linear: LinearFactory,
        embedding: EmbeddingFactory,
        tp: TensorParallel = UNSHARDED,
        pp: PipelineParallel = UNSTAGED,
    ):
        super().__init__(config, max_positions, backend, linear, embedding, tp, pp)
        self.ignored_weights = (*self.ignored_weights, "position_ids")
        self.vision_prefixes = tuple(f"{name}." for name in self.vision_modules)
        self.holds_vision = tp.rank == 0 and pp.first
        if self.holds_vision:  # the other ranks skip the tower's weights unread (`skips_weight`)
            self.build_vision(config)

    def build_vision(self, config: ModelConfig) -> None:
        """The subclass's vision tower and projector (rank 0's only)."""
        raise NotImplementedError

    def skips_weight(self, name: str) -> bool:
        """Whether checkpoint weight `name` is not this rank's to read: the tower's and projector's but on rank 0,
        another pipeline stage's."""
        name = rename_prefix(name, self.checkpoint_prefixes)
        return not self.holds_vision if name.startswith(self.vision_prefixes) else super().skips_weight(name)

    def forward(
        self, input_ids, positions, attn_metadata, lora=None, intermediate=None, mm: MultiModalEmbeddings | None = None
    ):
        """`mm`: the step's image embeddings, which the first stage's input embeddings take (a later stage's input
        is `intermediate`, the previous stage's)."""
        embeds = None
        if mm is not None and self.model.first:
            embeds = self.model.embed_tokens(input_ids)
            embeds[mm.indices] = mm.embeddings.to(embeds.dtype)
        return self.model(input_ids, positions, attn_metadata, lora, intermediate, inputs_embeds=embeds)


class LlavaForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = {
        "model.language_model.": "model.",
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "model.vision_tower.vision_model.": "vision_tower.vision_model.",
        "model.vision_tower.": "vision_tower.vision_model.",
        "vision_tower.vision_model.": "vision_tower.vision_model.",
        "vision_tower.": "vision_tower.vision_model.",  # transformers 5 saves the tower without its vision_model.
    }

    multimodal_config = staticmethod(LlavaConfig.from_hf)
    text_config = staticmethod(text_config)
    vision_modules = ("vision_tower", "multi_modal_projector")

    def build_vision(self, config: ModelConfig) -> None:
        mm: LlavaConfig = config.multimodal
        self.vision_tower = CLIPVisionModel(mm.vision, config.dtype, mm.feature_layer)
        self.multi_modal_projector = MultiModalProjector(
            mm.vision.hidden_size, config.hidden_size, mm.projector_act, mm.projector_bias, config.dtype
        )
        self.drop_class_token = mm.select_strategy == "default"
        skipped = (f"vision_tower.vision_model.{s}" for s in self.vision_tower.skipped)
        self.ignored_weights = (*self.ignored_weights, *skipped)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, tokens_per_image, hidden]: what replaces each image's placeholders."""
        features = self.vision_tower(pixel_values)
        return self.multi_modal_projector(features[:, 1:] if self.drop_class_token else features)
