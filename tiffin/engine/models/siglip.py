"""The SigLIP vision tower in plain torch, as Idefics3 / SmolVLM run it (transformers' `Idefics3VisionTransformer`):
a patch convolution (with a bias), learned positions looked up by each patch's fractional place in the image
(NaViT's bucketing, so an image of fewer patches than the table reads positions spread over all of it), pre-LN
encoder layers whose attention sees the whole image (`clip.EncoderLayer`: non-causal, torch's SDPA over a batch of
images of one size, no KV cache), then a post-LayerNorm; no class token.

Every image it takes is whole (no padded patches): Idefics3's tiles are all one size, so no patch mask is built.
Module names mirror Hugging Face's (`embeddings.`, `encoder.layers.`, `post_layernorm`; q/k/v stacked into
qkv_proj)."""

import torch
from torch import nn

from tiffin.engine.models.clip import EncoderLayer, VisionConfig


class Embeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d, self.patch_size = config.hidden_size, config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, d, config.patch_size, config.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.per_side**2, d, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        rows, cols = (n // self.patch_size for n in pixel_values.shape[-2:])
        return patches + self.position_embedding(self.position_ids(rows, cols, weight.device))

    def position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The table rows of a `rows` x `cols` grid of patches: each patch's fractional coordinates (float32, as
        transformers computes them, so the buckets agree at their edges) bucketed into `per_side` per axis."""
        n = self.per_side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)

        def buckets(count: int) -> torch.Tensor:
            step = 1.0 / torch.tensor(count, device=device)
            coords = (torch.arange(count, device=device, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
            return torch.bucketize(coords, boundaries, right=True)

        return (buckets(rows)[:, None] * n + buckets(cols)[None, :]).flatten()


class SiglipVisionModel(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.embeddings = Embeddings(config, dtype)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(config, dtype) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> hidden states [images, (H / patch) * (W / patch), hidden], patches row by row."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
