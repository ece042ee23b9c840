"""Qwen2-VL (transformers' `Qwen2VLForConditionalGeneration`): images at their own resolution (`multimodal.patches`:
resized to whole tokens of 2 x 2 patches within a pixel budget), a vision tower over each image's patches (a linear
patch embedding of temporal_patch x patch x patch pixels, 2-D rotary positions in the attention, which sees the whole
image, pre-LN blocks), a merger that folds each 2 x 2 square of patches into one token, and the Qwen2 language model
reading those embeddings in place of the image's `<|image_pad|>` run, rotated by M-RoPE (`layers.MRotaryEmbedding`,
positions from `multimodal.mrope`).

Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) is the same model but for its tower: RMSNorms, a gated MLP, and
attention within windows of `window_size` pixels except in `fullatt_block_indexes`.

Images of one size run through the tower as one batch (attention never crosses images). Checkpoint names: the hub's
(`model.`, `visual.`, `lm_head.`), which transformers 5 also saves, and its module names (`model.language_model.`,
`model.visual.`) map onto this module's (`checkpoint_prefixes`)."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tiffin.engine.distributed.tensor_parallel import UNSHARDED
from tiffin.engine.errors import ParamError
from tiffin.engine.models.clip import ACTIVATIONS
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import MRotaryEmbedding, RMSNorm
from tiffin.engine.models.linear import Linear
from tiffin.engine.models.llava import VisionLanguageModel
from tiffin.engine.multimodal.patches import PatchProcessor
from tiffin.quant import UnquantizedLinearMethod

ACTIVATIONS = {**ACTIVATIONS, "silu": nn.functional.silu}  # CLIP's and Qwen2.5-VL's


def complete_config(raw: dict) -> dict:
    """config.json with transformers' defaults filled in, its sub-configs' too (the hub's flat configs included)."""
    from transformers import CONFIG_MAPPING

    kind = raw.get("model_type", "qwen2_vl")
    return CONFIG_MAPPING[kind].from_dict({k: v for k, v in raw.items() if k != "model_type"}).to_dict()


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vision_config` (Qwen2VLVisionConfig's or Qwen2_5_VLVisionConfig's fields)."""

    depth: int
    embed_dim: int
    out_dim: int  # the language model's hidden size
    mlp_dim: int
    num_heads: int
    in_channels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    hidden_act: str
    rope_theta: float
    v2_5: bool = False  # Qwen2.5-VL: RMSNorms, a gated MLP, windowed attention but in `full_blocks`
    window: int = 0  # image tokens per side of an attention window (0: every block sees the whole image)
    full_blocks: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, raw: dict) -> "VisionConfig":
        act = raw["hidden_act"]
        if act not in ACTIVATIONS:
            raise ValueError(f"vision tower hidden_act {act!r} is not supported; tiffin serves {list(ACTIVATIONS)}")
        v2_5 = raw["model_type"] == "qwen2_5_vl_vision"
        sizes = (
            (raw["hidden_size"], raw["out_hidden_size"], raw["intermediate_size"])
            if v2_5
            else (raw["embed_dim"], raw["hidden_size"], int(raw["embed_dim"] * raw["mlp_ratio"]))
        )
        m, p = raw["spatial_merge_size"], raw["patch_size"]
        return cls(
            raw["depth"],
            *sizes,
            raw["num_heads"],
            raw["in_channels"],
            p,
            m,
            raw["temporal_patch_size"],
            act,
            (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            v2_5,
            raw["window_size"] // m // p if v2_5 else 0,
            tuple(raw["fullatt_block_indexes"]) if v2_5 else (),
        )


@dataclass(frozen=True)
class Qwen2VLConfig:
    """What config.json says of the images beside its `text_config`, and how its images are preprocessed."""

    vision: VisionConfig
    image_token_id: int
    mrope_section: tuple[int, ...]
    processor: PatchProcessor

    @classmethod
    def from_hf(cls, raw: dict, path: str | Path) -> "Qwen2VLConfig":
        full = complete_config(raw)
        vision, processor = VisionConfig.from_hf(full["vision_config"]), PatchProcessor.read(path)
        tower = (vision.patch_size, vision.merge_size, vision.temporal_patch_size)
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != tower:
            raise ValueError(f"{path}: the image processor's patch, merge and temporal patch sizes differ from the "
                             f"vision tower's {tower}")  # fmt: skip
        rope = full["text_config"].get("rope_parameters") or {}
        return cls(vision, full["image_token_id"], tuple(rope.get("mrope_section", (16, 24, 24))), processor)

    @property
    def tokens_per_image(self) -> int:
        """The most image tokens an image can take (the memory profile's)."""
        return self.image_tokens(self.profile_pixels())

    def profile_pixels(self) -> torch.Tensor:
        return self.processor.largest()

    @staticmethod
    def image_tokens(pixels: torch.Tensor) -> int:
        return pixels.shape[0] * pixels.shape[1]

    def image_prompt(self, image, tokenizer) -> tuple[list[int], torch.Tensor]:
        """The token ids that replace `image`'s `<|image_pad|>` token (itself: its run expands after) and its patches;
        ParamError for an image of an aspect ratio the processor refuses."""
        try:
            return [self.image_token_id], self.processor(image)[None]
        except ValueError as e:
            raise ParamError("multi_modal_data", str(e)) from None


def text_config(raw: dict) -> dict:
    """config.json's `text_config`, complete, as a decoder's config.json (the model's architecture, dtype and
    embedding tying: transformers ties by the top-level flag)."""
    full = complete_config(raw)
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return {**full["text_config"], "architectures": raw["architectures"],
            "tie_word_embeddings": full["tie_word_embeddings"], **({"dtype": dtype} if dtype else {})}  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d, self.num_heads = config.embed_dim, config.num_heads
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype)
        self.proj = nn.Linear(d, d, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: "Windows | None"):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(v.dtype) for t in (q, k))  # in fp32, as HF
        if windows is None:
            o = nn.functional.scaled_dot_product_attention(q, k, v)  # non-causal, within each image
        else:
            o = windows.attend(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, d))


class Windows:
    """Qwen2.5-VL's attention windows over an image of `rows` x `cols` tokens: squares of `side` tokens (smaller at
    the bottom and right edges), each token's merge x merge patches with it. Each window runs as one padded batch
    row of SDPA, its padding masked out of the keys (transformers packs them unpadded: the same keys per query)."""

    def __init__(self, rows: int, cols: int, merge: int, side: int, device: torch.device):
        n_r, n_c, unit = -(-rows // side), -(-cols // side), merge * merge
        step = torch.arange(side, device=device)
        r = torch.arange(n_r, device=device).view(n_r, 1, 1, 1) * side + step.view(side, 1)  # [n_r, 1, side, 1]
        c = torch.arange(n_c, device=device).view(1, n_c, 1, 1) * side + step  # [1, n_c, 1, side]
        keep = ((r < rows) & (c < cols))[..., None].expand(-1, -1, -1, -1, unit)  # [n_r, n_c, side, side, unit]
        patch = (r * cols + c)[..., None] * unit + torch.arange(unit, device=device)
        self.keep = keep.reshape(n_r * n_c, -1)
        self.index = torch.where(self.keep, patch.reshape(n_r * n_c, -1), 0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """SDPA of [images, heads, patches, head_dim] q, k, v within each window."""
        q, k, v = (t[:, :, self.index].transpose(1, 2) for t in (q, k, v))  # [images, windows, heads, size, d]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.keep[:, None, None, :])
        o = o.transpose(1, 2).flatten(2, 3)[:, :, self.keep.flatten()]  # [images, heads, patches], window order
        out = torch.empty_like(o)
        out[:, :, self.index[self.keep]] = o
        return out


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), or Qwen2.5-VL's gated down(act(gate(x)) * up(x)) (gate and up stacked, as the loader stacks
    every `gate_proj` / `up_proj`), with biases."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d, hidden = config.embed_dim, config.mlp_dim
        self.gated, self.act = config.v2_5, ACTIVATIONS[config.hidden_act]
        if self.gated:
            self.gate_up_proj = Linear(d, [hidden, hidden], True, dtype, UnquantizedLinearMethod(), UNSHARDED)
            self.down_proj = nn.Linear(hidden, d, dtype=dtype)
        else:
            self.fc1, self.fc2 = nn.Linear(d, hidden, dtype=dtype), nn.Linear(hidden, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fc2(self.act(self.fc1(x)))
        gate, up = self.gate_up_proj(x.flatten(0, -2)).view(*x.shape[:-1], -1).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def vision_norm(config: VisionConfig, dtype: torch.dtype) -> nn.Module:
    """LayerNorm, or Qwen2.5-VL's RMSNorm."""
    d = config.embed_dim
    return RMSNorm(d, 1e-6, dtype) if config.v2_5 else nn.LayerNorm(d, 1e-6, dtype=dtype)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1, self.norm2 = vision_norm(config, dtype), vision_norm(config, dtype)
        self.attn = VisionAttention(config, dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: Windows | None):
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d = config.embed_dim * config.merge_size**2
        self.ln_q = vision_norm(config, dtype)
        self.mlp = nn.Sequential(nn.Linear(d, d, dtype=dtype), nn.GELU(), nn.Linear(d, config.out_dim, dtype=dtype))

    def forward(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """[images, patches, embed_dim], each token's merge x merge patches consecutive -> [images, tokens, out]."""
        return self.mlp(self.ln_q(x).reshape(len(x), tokens, -1))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Module()
        p, t = config.patch_size, config.temporal_patch_size
        self.patch_embed.proj = nn.Conv3d(config.in_channels, config.embed_dim, (t, p, p), (t, p, p), bias=False,
                                          dtype=dtype)  # fmt: skip
        self.blocks = nn.ModuleList(VisionBlock(config, dtype) for _ in range(config.depth))
        self.merger = PatchMerger(config, dtype)
        spatial = config.embed_dim // config.num_heads // 2  # half a head rotates by rows, half by columns
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, rows, cols, merge, merge, patch pixels] (`multimodal.patches`) -> [images, rows * cols, out]."""
        n, rows, cols, m = pixel_values.shape[:4]
        weight = self.patch_embed.proj.weight
        x = nn.functional.linear(pixel_values.reshape(n, rows * cols * m * m, -1).to(weight.dtype), weight.flatten(1))
        cos, sin = self.rotary(rows, cols, m)
        c = self.config
        windows = Windows(rows, cols, m, c.window, x.device) if c.window else None
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in c.full_blocks else windows)
        return self.merger(x, rows * cols)

    def rotary(self, rows: int, cols: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] of the patches in their order: each head's first and third quarters
        rotate by the patch's row, its second and fourth by its column."""
        r = torch.arange(rows * m, device=self.inv_freq.device).view(rows, 1, m, 1).expand(rows, cols, m, m)
        c = torch.arange(cols * m, device=self.inv_freq.device).view(1, cols, 1, m).expand(rows, cols, m, m)
        freqs = torch.cat([r.reshape(-1, 1) * self.inv_freq, c.reshape(-1, 1) * self.inv_freq], dim=-1)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}
    multimodal_config = staticmethod(Qwen2VLConfig.from_hf)
    text_config = staticmethod(text_config)
    vision_modules = ("visual",)
    uses_mrope = True  # the model runner's positions: `multimodal.mrope`

    def build_vision(self, config: ModelConfig) -> None:
        self.visual = VisionTransformer(config.multimodal.vision, config.dtype)

    @staticmethod
    def make_rotary(config: ModelConfig, max_positions: int) -> MRotaryEmbedding:
        section = config.multimodal.mrope_section
        return MRotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, section)

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, rows, cols, merge, merge, patch pixels] -> [images, rows * cols, hidden]."""
        return self.visual(pixel_values)
