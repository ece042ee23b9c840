"""The CLIP vision tower in plain torch (transformers' `CLIPVisionModel`): patch convolution, a class embedding,
learned positions, a pre-LayerNorm, then pre-LN encoder layers whose attention sees the whole image (non-causal,
torch's SDPA over a batch of images of one size: no KV cache, no paging). It runs only as far as the layer whose
output a vision-language model reads (`num_layers`), so a tower read at layer -2 never computes the last.

Module names mirror Hugging Face's (`vision_model.embeddings...`, q/k/v stacked into qkv_proj), so checkpoint
names map onto them as they are."""

from dataclasses import dataclass

import torch
from torch import nn

from tiffin.engine.distributed.tensor_parallel import UNSHARDED
from tiffin.engine.models.linear import Linear
from tiffin.quant import UnquantizedLinearMethod

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vision_config` (CLIPVisionConfig's fields)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    num_channels: int = 3

    @classmethod
    def from_hf(cls, raw: dict, kind: str = "clip_vision_model") -> "VisionConfig":
        """`raw` (complete), a tower of model_type `kind`."""
        model_type = raw.get("model_type", kind)
        if model_type != kind:
            raise ValueError(f"vision tower {model_type!r} is not supported; tiffin serves {kind} here")
        act = raw.get("hidden_act", "quick_gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"vision tower hidden_act {act!r} is not supported; tiffin serves {list(ACTIVATIONS)}")
        return cls(
            raw["hidden_size"],
            raw["intermediate_size"],
            raw["num_hidden_layers"],
            raw["num_attention_heads"],
            raw["image_size"],
            raw["patch_size"],
            act,
            raw.get("layer_norm_eps", 1e-5),
            raw.get("num_channels", 3),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Embeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, d, config.patch_size, config.patch_size, bias=False, dtype=dtype
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, d, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.class_embedding.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(patches), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d, self.num_heads = config.hidden_size, config.num_heads
        self.qkv_proj = Linear(d, [d, d, d], True, dtype, UnquantizedLinearMethod(), UNSHARDED)
        self.out_proj = nn.Linear(d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv_proj(x.reshape(b * n, d)).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v)  # non-causal; scale head_dim ** -0.5
        return self.out_proj(o.transpose(1, 2).reshape(b, n, d))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps, dtype=dtype)
        self.self_attn = Attention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(d, eps, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, config.intermediate_size, dtype=dtype)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, d, dtype=dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, num_layers: int):
        super().__init__()
        self.embeddings = Embeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)  # HF's spelling
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(config, dtype) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class CLIPVisionModel(nn.Module):
    """The tower up to the output of encoder layer `feature_layer` (transformers' `hidden_states[feature_layer]`:
    0 is the pre-LayerNorm's output, -1 the last layer's); the layers past it and the post-LayerNorm, which a
    vision-language model never reads, are not built and their checkpoint weights are skipped (`skipped`)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, feature_layer: int = -1):
        super().__init__()
        num_layers = feature_layer % (config.num_layers + 1)
        self.vision_model = VisionTransformer(config, dtype, num_layers)
        self.skipped = ("post_layernorm", *(f"encoder.layers.{i}." for i in range(num_layers, config.num_layers)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> hidden states [images, 1 + patches, hidden] (the class token first)."""
        return self.vision_model(pixel_values)
