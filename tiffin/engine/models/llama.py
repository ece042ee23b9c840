"""The Llama family in plain torch: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

The model sees one flattened batch (`input_ids[T]`, `positions[T]`) and attention metadata, never requests.
"""

import math

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between the two bands
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (halves, not interleaved pairs), cos/sin precomputed in fp32 per position."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.cat([freqs, freqs], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([freqs, freqs], -1).sin(), persistent=False)
        self._positions = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions is not self._positions:  # every layer of a step shares one positions tensor
            self._positions = positions
            self._cos_sin = self.cos[positions].to(q.dtype)[:, None], self.sin[positions].to(q.dtype)[:, None]
        cos, sin = self._cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, linear, rotary: RotaryEmbedding, backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = linear("qkv_proj", config.hidden_size, [q_size, kv_size, kv_size], config.qkv_bias)
        self.o_proj = linear("o_proj", q_size, [config.hidden_size], False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.k_cache = self.v_cache = torch.empty(0)  # set by the ModelRunner

    def forward(self, x: torch.Tensor, positions: torch.Tensor, md: kernels.AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        kernels.write_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping, self.backend)
        o = kernels.paged_attention(q, self.k_cache, self.v_cache, md, self.scale, self.backend)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, linear):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = linear("gate_up_proj", config.hidden_size, [size, size], config.mlp_bias)
        self.down_proj = linear("down_proj", size, [config.hidden_size], config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, linear, rotary: RotaryEmbedding, backend: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, _prefixed(linear, "self_attn."), rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = MLP(config, _prefixed(linear, "mlp."))

    def forward(self, x, positions, md):
        x = x + self.self_attn(self.input_layernorm(x), positions, md)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self, config: ModelConfig, linear, rotary: RotaryEmbedding, backend: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, _prefixed(linear, f"layers.{i}."), rotary, backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, input_ids, positions, md):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, md)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """`linear(name, input_size, output_sizes, bias)` builds each projection; the quantization method
    behind it is the caller's business."""

    # checkpoint module name -> (our stacked module, shard index)
    stacked_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int, backend: str, linear):
        super().__init__()
        rotary = RotaryEmbedding(config, max_positions)
        self.model = Model(config, _prefixed(linear, "model."), rotary, backend)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype).requires_grad_(False)
        )

    def forward(self, input_ids, positions, md):
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)

    def layers_kv(self):
        return [layer.self_attn for layer in self.model.layers]


def _prefixed(linear, prefix: str):
    return lambda name, *args: linear(prefix + name, *args)
