"""CLIP and SigLIP as embedding models (transformers' `CLIPModel`, `SiglipModel`): a text tower and a vision tower
trained into one embedding space, so that a text's embedding and an image's compare by cosine. Each input is a text
or one image, never both (vLLM's rule for these models):
- a text runs through the text tower in the engine's flattened batch (paged attention over its own KV blocks:
  CLIP's causal, SigLIP's bidirectional), the final LayerNorm and the text projection (CLIP's `text_projection`,
  SigLIP's `text_model.head`), and pools its last row: the prompt is cut after the token transformers pools (CLIP's
  EOS) or padded to the context SigLIP was trained on (`DualEncoderConfig.text_prompt`), so its last row is that one;
- an image is a prompt of one placeholder token whose row the encoder step (`multimodal.encoder`) fills with the
  image's embedding: CLIP's post-LayerNorm class token through `visual_projection`, SigLIP's attention-pooling head.
The engine normalizes the pooled rows (L2, as vLLM does; a request may ask otherwise).

Module names mirror Hugging Face's (`text_model.`, `vision_model.`, the projections; q/k/v stacked into qkv_proj)."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.errors import ParamError
from tiffin.engine.models import clip, siglip
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import EmbeddingFactory, LinearFactory
from tiffin.engine.models.linear import Linear
from tiffin.engine.models.llava import MultiModalEmbeddings
from tiffin.engine.multimodal.fixed_size import FixedSizeProcessor
from tiffin.engine.multimodal.image import ImageProcessor
from tiffin.engine.multimodal.inputs import ImageInput, image_hash
from tiffin.quant import UnquantizedLinearMethod

NAMES = {"clip": "CLIP", "siglip": "SigLIP"}


def complete_config(raw: dict, kind: str) -> dict:
    """config.json with transformers' defaults filled in, its text and vision configs' too."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[kind].from_dict({k: v for k, v in raw.items() if k != "model_type"}).to_dict()


@dataclass(frozen=True)
class DualEncoderConfig:
    """What config.json says beyond the text tower's shape (which `ModelConfig` holds), and how images are
    preprocessed."""

    kind: str  # "clip" or "siglip"
    vision: clip.VisionConfig
    embedding_size: int  # of text and image embeddings alike
    text_act: str
    eos_token_id: int  # CLIP pools its first (of 2, transformers' legacy value: the largest token id)
    pad_token_id: int  # SigLIP's padding
    max_text_tokens: int  # SigLIP pads to it
    processor: ImageProcessor | FixedSizeProcessor
    image_token_id: int = 0  # the one placeholder of an image's prompt (any id: the row is replaced)
    tokens_per_image: int = 1
    max_images_per_prompt: int = 1

    @classmethod
    def from_hf(cls, raw: dict, path: str | Path, kind: str) -> "DualEncoderConfig":
        full = complete_config(raw, kind)
        text = full["text_config"]
        vision = clip.VisionConfig.from_hf(full["vision_config"], f"{kind}_vision_model")
        act = text["hidden_act"]
        if act not in clip.ACTIVATIONS:
            raise ValueError(f"text tower hidden_act {act!r} is not supported; tiffin serves {list(clip.ACTIVATIONS)}")
        if kind == "clip":
            size, processor = full["projection_dim"], ImageProcessor.read(path, vision.image_size)
        else:  # the text head projects into the vision tower's width, where its pooling head ends
            size, processor = (
                text.get("projection_size") or text["hidden_size"],
                FixedSizeProcessor.read(path, vision.image_size),
            )
            if not full["vision_config"].get("vision_use_head", True) or size != vision.hidden_size:
                raise ValueError("a SigLIP model needs its vision pooling head, of the text projection's size")
        return cls(
            kind,
            vision,
            size,
            act,
            text["eos_token_id"],
            text.get("pad_token_id") or 0,
            text["max_position_embeddings"],
            processor,
        )

    def image_prompt(self, image, tokenizer) -> tuple[list[int], torch.Tensor]:
        return [self.image_token_id], self.processor(image)[None]

    def place_images(
        self, token_ids: list[int], prompts: list[tuple[list[int], torch.Tensor]], tokenizer
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A prompt and its images' (`image_prompt`) as this model embeds them: a text alone, or one image alone,
        its prompt the placeholder (the prompt given must hold special tokens only: an empty text). ParamError
        for more images, or an image with text."""
        if not prompts:
            return token_ids, ()
        name = NAMES[self.kind]
        if len(prompts) > 1:
            raise ParamError("multi_modal_data", f"{len(prompts)} images: a {name} model embeds one image per input")
        special = set(tokenizer.all_special_ids)
        if any(t not in special for t in token_ids):
            raise ParamError(
                "multi_modal_data",
                f"a {name} model embeds a text or an image, not both (an image comes with an empty prompt)",
            )
        pixels = prompts[0][1][0]
        return [self.image_token_id], (ImageInput(0, 1, image_hash(pixels), pixels),)

    def text_prompt(self, token_ids: list[int]) -> list[int]:
        """A text's tokens as the tower runs them, its last the one transformers pools: CLIP's cut after its EOS
        token (the first; with transformers' legacy `eos_token_id` 2, the first largest id; none: the first token),
        which the causal mask keeps the same; SigLIP's padded to `max_text_tokens`, as it was trained
        (transformers' processor with `padding="max_length"`)."""
        if self.kind == "siglip":
            return token_ids + [self.pad_token_id] * (self.max_text_tokens - len(token_ids))
        eos = max(token_ids) if self.eos_token_id == 2 else self.eos_token_id
        return token_ids[: token_ids.index(eos) + 1] if eos in token_ids else token_ids[:1]


def text_config(raw: dict) -> dict:
    """The text tower's config as a model's config.json (its architecture and dtype the checkpoint's); its
    activation is the `DualEncoderConfig`'s, not one of the gated MLPs' that `ModelConfig` checks."""
    kind = "siglip" if raw["architectures"][0] == "SiglipModel" else "clip"
    text = {k: v for k, v in complete_config(raw, kind)["text_config"].items() if k != "hidden_act"}
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return {**text, "architectures": raw["architectures"], **({"dtype": dtype} if dtype else {})}


class TextAttention(nn.Module):
    def __init__(self, config: ModelConfig, causal: bool, backend: str):
        super().__init__()
        d = config.hidden_size
        self.num_heads = self.num_kv_heads = config.num_heads
        self.head_dim, self.causal, self.backend = config.head_dim, causal, backend
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(d, [d, d, d], True, config.dtype, UnquantizedLinearMethod(), UNSHARDED)
        self.out_proj = nn.Linear(d, d, dtype=config.dtype)
        self.k_cache = self.v_cache = torch.empty(0)  # set by the ModelRunner
        self.k_scale = self.v_scale = None  # a quantized cache's scales (`kv_quant`), set by the ModelRunner

    def forward(self, x: torch.Tensor, attn_metadata: kernels.AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        kv = (self.k_cache, self.v_cache)
        kernels.write_kv(k, v, *kv, attn_metadata.slot_mapping, self.backend, self.k_scale, self.v_scale)
        o = kernels.paged_attention(
            q, *kv, attn_metadata, self.scale, self.backend, self.causal, self.k_scale, self.v_scale, fresh_kv=(k, v)
        )
        return self.out_proj(o.flatten(1))


class TextLayer(nn.Module):
    """A pre-LN layer, as `clip.EncoderLayer`, over the flattened batch."""

    def __init__(self, config: ModelConfig, act: str, causal: bool, backend: str):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps, dtype=config.dtype)
        self.self_attn = TextAttention(config, causal, backend)
        self.layer_norm2 = nn.LayerNorm(d, eps, dtype=config.dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, config.intermediate_size, dtype=config.dtype)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, d, dtype=config.dtype)
        self.act = clip.ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, attn_metadata: kernels.AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attn_metadata)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class TextTransformer(nn.Module):
    def __init__(self, config: ModelConfig, act: str, causal: bool, backend: str):
        super().__init__()
        d = config.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(config.vocab_size, d, dtype=config.dtype)
        self.embeddings.position_embedding = nn.Embedding(config.max_position_embeddings, d, dtype=config.dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(TextLayer(config, act, causal, backend) for _ in range(config.num_layers))
        self.final_layer_norm = nn.LayerNorm(d, config.layer_norm_eps, dtype=config.dtype)

    def forward(self, input_ids, positions, attn_metadata) -> torch.Tensor:
        x = self.embeddings.token_embedding(input_ids) + self.embeddings.position_embedding(positions)
        for layer in self.encoder.layers:
            x = layer(x, attn_metadata)
        return self.final_layer_norm(x)


class DualEncoderModel(nn.Module):
    """The text tower and the subclass's vision side (`build_vision`, `project_text`, `embed_images`)."""

    stacked_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    ignored_weights = ("position_ids", "logit_scale", "logit_bias")
    text_config = staticmethod(text_config)
    causal_text = True

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        backend: str,
        linear: LinearFactory,
        embedding: EmbeddingFactory,
        tp: TensorParallel = UNSHARDED,
    ):
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{config.architecture}: tensor parallelism is not supported yet; serve it on one device")
        mm: DualEncoderConfig = config.multimodal
        self.text_model = TextTransformer(config, mm.text_act, self.causal_text, backend)
        self.build_vision(config, mm)

    def build_vision(self, config: ModelConfig, mm: DualEncoderConfig) -> None:
        raise NotImplementedError

    def forward(self, input_ids, positions, attn_metadata, lora=None, mm: MultiModalEmbeddings | None = None):
        """Each row's embedding `[T, embedding_size]`: a text token's through the text projection, an image's
        placeholder its image's."""
        x = self.project_text(self.text_model(input_ids, positions, attn_metadata))
        if mm is not None:
            x[mm.indices] = mm.embeddings.to(x.dtype)
        return x

    def pool(self, hidden: torch.Tensor, md) -> torch.Tensor:
        return hidden[md.starts + md.lengths - 1].float()

    def layers_kv(self) -> list[TextAttention]:
        return [layer.self_attn for layer in self.text_model.encoder.layers]


class CLIPVisionTransformer(clip.VisionTransformer):
    """transformers' CLIPVisionTransformer whole: every layer, then the post-LayerNorm of the class token."""

    def __init__(self, config: clip.VisionConfig, dtype: torch.dtype):
        super().__init__(config, dtype, config.num_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(super().forward(pixel_values)[:, 0])


class CLIPEmbeddingModel(DualEncoderModel):
    multimodal_config = staticmethod(lambda raw, path: DualEncoderConfig.from_hf(raw, path, "clip"))

    def build_vision(self, config: ModelConfig, mm: DualEncoderConfig) -> None:
        self.text_projection = nn.Linear(config.hidden_size, mm.embedding_size, bias=False, dtype=config.dtype)
        self.vision_model = CLIPVisionTransformer(mm.vision, config.dtype)
        self.visual_projection = nn.Linear(mm.vision.hidden_size, mm.embedding_size, bias=False, dtype=config.dtype)

    def project_text(self, x: torch.Tensor) -> torch.Tensor:
        return self.text_projection(x)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, 1, embedding_size]."""
        return self.visual_projection(self.vision_model(pixel_values))[:, None]


class SiglipEmbeddings(siglip.Embeddings):
    """SigLIP's own positions: patch i reads row i (images come at the tower's size; Idefics3's bucketing of
    fractional places, which `siglip.Embeddings` applies, can differ from it in float32)."""

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        return torch.arange(rows * cols, device=device)


class AttentionPoolingHead(nn.Module):
    """transformers' SiglipMultiheadAttentionPoolingHead: a learned probe attends over the patches, then a
    residual MLP."""

    def __init__(self, config: clip.VisionConfig, dtype: torch.dtype):
        super().__init__()
        d = config.hidden_size
        self.probe = nn.Parameter(torch.empty(1, 1, d, dtype=dtype))
        self.attention = nn.MultiheadAttention(d, config.num_heads, batch_first=True, dtype=dtype)
        self.layernorm = nn.LayerNorm(d, config.layer_norm_eps, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, config.intermediate_size, dtype=dtype)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, d, dtype=dtype)
        self.act = clip.ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.probe.expand(len(x), -1, -1), x, x, need_weights=False)[0]
        return (h + self.mlp.fc2(self.act(self.mlp.fc1(self.layernorm(h)))))[:, 0]


class SiglipVisionTransformer(siglip.SiglipVisionModel):
    def __init__(self, config: clip.VisionConfig, dtype: torch.dtype):
        super().__init__(config, dtype)
        self.embeddings = SiglipEmbeddings(config, dtype)
        self.head = AttentionPoolingHead(config, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(pixel_values))


class SiglipEmbeddingModel(DualEncoderModel):
    multimodal_config = staticmethod(lambda raw, path: DualEncoderConfig.from_hf(raw, path, "siglip"))
    causal_text = False

    def build_vision(self, config: ModelConfig, mm: DualEncoderConfig) -> None:
        self.text_model.head = nn.Linear(config.hidden_size, mm.embedding_size, dtype=config.dtype)
        self.vision_model = SiglipVisionTransformer(mm.vision, config.dtype)

    def project_text(self, x: torch.Tensor) -> torch.Tensor:
        return self.text_model.head(x)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, 1, embedding_size]."""
        return self.vision_model(pixel_values)[:, None]
