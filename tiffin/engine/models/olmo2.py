"""OLMo 2: the Llama block with its norms after the sublayers (each output normalized before it joins the
residual stream, nothing normalized on the way in) and the queries and keys RMS-normalized over the whole
projection, all heads at once, before RoPE.

Under tensor parallelism a rank holds some heads: it normalizes its slice of the projection by the mean square of
the whole, its sum of squares all-reduced (replicated KV heads count once per replica on both sides of that mean).
"""

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import LinearFactory, RMSNorm, RotaryEmbedding, prefixed
from tiffin.engine.models.llama import Attention, LlamaForCausalLM, MLPFactory
from tiffin.kernels.lora import LoRAMetadata


class ProjectionNorm(RMSNorm):
    """RMSNorm over a projection of `heads` heads (the checkpoint's weight, whole), of which this rank holds
    `local` heads: the `index`-th slice of them."""

    def __init__(self, heads: int, local: int, index: int, head_dim: int, eps: float, dtype, tp: TensorParallel):
        super().__init__(heads * head_dim, eps, dtype)
        self.tp, self.rows = tp, slice(index * local * head_dim, (index + 1) * local * head_dim)

    def forward(self, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x, backend)
        x32 = x.float()
        mean_square = self.tp.all_reduce(x32.square().sum(-1, keepdim=True)) / (x.shape[-1] * self.tp.size)
        return (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype) * self.weight[self.rows]


class Olmo2Attention(Attention):
    def __init__(
        self, config: ModelConfig, linear: LinearFactory, rotary: RotaryEmbedding, backend: str, tp: TensorParallel
    ):
        super().__init__(config, linear, rotary, backend, tp)
        norm = config.head_dim, config.rms_norm_eps, config.dtype, tp
        replicas = tp.size // (config.num_kv_heads // self.num_kv_heads)  # ranks holding the same KV heads
        self.q_norm = ProjectionNorm(config.num_heads, self.num_heads, tp.rank, *norm)
        self.k_norm = ProjectionNorm(config.num_kv_heads, self.num_kv_heads, tp.rank // replicas, *norm)

    def project(self, x: torch.Tensor, lora: LoRAMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x, lora).split(self.qkv_proj.output_sizes, dim=-1)
        return torch.cat([self.q_norm(q, self.backend), self.k_norm(k, self.backend)], dim=-1), v


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        linear: LinearFactory,
        rotary: RotaryEmbedding,
        backend: str,
        tp: TensorParallel,
        make_mlp: MLPFactory,
    ):
        super().__init__()
        if config.qkv_bias:
            raise ValueError("OLMo 2 with attention_bias is not supported")
        self.self_attn = Olmo2Attention(config, prefixed(linear, "self_attn."), rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = make_mlp(config, index, prefixed(linear, "mlp."), backend, tp)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.backend = backend

    def forward(self, x, residual, rotation, attn_metadata: kernels.AttentionMetadata, lora):
        """The Llama layer's contract: (this layer's normalized MLP output, the residual stream without it)."""
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(x, rotation, attn_metadata, lora), self.backend)
        return self.post_feedforward_layernorm(self.mlp(x, lora), self.backend), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
