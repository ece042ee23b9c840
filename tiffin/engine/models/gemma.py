"""Gemma 2 and Gemma 3 (text: `Gemma3ForCausalLM`) in plain torch, from the Llama family's parts (`llama.py`).

What differs from Llama, as transformers computes it:
- RMSNorm scales by (1 + weight): the checkpoint's weight plus one is stored once after loading, so the shared
  norm kernels (and the fused q/k norm of Gemma 3's qk-norm) run it. In fp32 this is transformers' product; in
  16-bit dtypes (1 + weight) is rounded once to the model's dtype where transformers keeps it in fp32.
- four norms a layer: before and after attention, before and after the MLP (a GeGLU: `gelu_pytorch_tanh`);
- embeddings scaled by sqrt(hidden_size), that factor rounded to the model's dtype first;
- queries scaled by `query_pre_attn_scalar ** -0.5`, not head_dim's;
- sliding-window layers (key k seen by the query at p when p - window < k <= p) interleaved with global ones,
  as `layer_types` says (else every `sliding_window_pattern`-th layer global: Gemma 2 alternates, Gemma 3
  has 5 local to 1 global), each kind with its own RoPE in Gemma 3 (local: `rope_local_base_freq`, global:
  `rope_theta` with its scaling);
- Gemma 2's soft-capping of attention scores (`attn_logit_softcapping`) and of the final logits
  (`final_logit_softcapping`): `cap * tanh(x / cap)`.
The attention ops apply windows and caps (`kernels.paged_attention`'s `window`, `softcap`), so the context is
not capped at the window (`ModelConfig.windowed`); the local layers keep a KV cache group of their own, which holds
about a window of each sequence (`core.window_blocks`, `worker.kv_groups`).
"""

from dataclasses import dataclass

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.models.config import ModelConfig, read_rope
from tiffin.engine.models.layers import MLP, EmbeddingFactory, LinearFactory, RMSNorm, RotaryEmbedding, prefixed
from tiffin.engine.models.llama import Attention, LlamaForCausalLM
from tiffin.engine.models.pooler import Pooler, PoolingMetadata
from tiffin.kernels.lora import LoRAMetadata

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer types


@dataclass(frozen=True)
class GemmaConfig:
    """What config.json says of a Gemma beyond `ModelConfig`'s fields."""

    query_pre_attn_scalar: float
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    windows: tuple[int, ...]  # each layer's sliding window, 0 for a global layer
    rope: dict[str, tuple[float, dict | None]]  # layer type -> (theta, scaling)

    @classmethod
    def from_hf(cls, raw: dict) -> "GemmaConfig":
        if raw.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
        layers = raw["num_hidden_layers"]
        pattern = raw.get("sliding_window_pattern") or (2 if raw.get("model_type") == "gemma2" else 6)
        types = raw.get("layer_types") or [LOCAL if (i + 1) % pattern else GLOBAL for i in range(layers)]
        if len(types) != layers or not set(types) <= {LOCAL, GLOBAL}:
            raise ValueError(f"layer_types must name {LOCAL!r} or {GLOBAL!r} for each of {layers} layers: {types}")
        window = raw.get("sliding_window") or 0
        params = raw.get("rope_parameters") or {}
        if GLOBAL in params:  # transformers 5 writes Gemma 3's RoPE per layer type
            rope = {kind: read_rope({"rope_parameters": params[kind]}) for kind in (LOCAL, GLOBAL)}
        else:  # hub checkpoints: rope_theta (+ rope_scaling) global, rope_local_base_freq local (Gemma 3)
            rope = {GLOBAL: read_rope(raw)}
            rope[LOCAL] = (raw["rope_local_base_freq"], None) if "rope_local_base_freq" in raw else rope[GLOBAL]
        return cls(
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256,
            attn_softcap=raw.get("attn_logit_softcapping") or 0.0,
            final_softcap=raw.get("final_logit_softcapping") or 0.0,
            windows=tuple(window if kind == LOCAL else 0 for kind in types),
            rope=rope,
        )


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), stored as (1 + weight) once the checkpoint's weight is loaded."""

    def process_weights_after_loading(self) -> None:
        self.weight.data += 1


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, gemma: GemmaConfig, index: int, linear, rotary, backend, tp):
        super().__init__(config, linear, rotary, backend, tp)
        if config.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, config.dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, config.dtype)
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.window, self.softcap = gemma.windows[index], gemma.attn_softcap


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, linear: LinearFactory, rotary, backend, tp):
        super().__init__()
        gemma, size, eps, dtype = config.family, config.hidden_size, config.rms_norm_eps, config.dtype
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.self_attn = GemmaAttention(config, gemma, index, prefixed(linear, "self_attn."), rotary, backend, tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.mlp = MLP(size, config.intermediate_size, config.hidden_act, False, prefixed(linear, "mlp."), backend)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.backend = backend

    def forward(self, x, residual, rotation, attn_metadata, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's post-MLP-normed output, the residual stream without it), as Llama's layers: the next
        layer's (or the final) norm adds the two. `residual` None: the first layer, whose `x` is the embedding."""
        if residual is None:
            x, residual = self.input_layernorm(x, self.backend), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual, self.backend)
        x = self.post_attention_layernorm(self.self_attn(x, rotation, attn_metadata, lora), self.backend)
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual, self.backend)
        return self.post_feedforward_layernorm(self.mlp(x, lora), self.backend), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, linear, embedding, max_positions: int, backend: str, tp: TensorParallel):
        super().__init__()
        gemma: GemmaConfig = config.family
        self.embed_tokens = embedding("embed_tokens", config.vocab_size, config.hidden_size)
        self.rotary = {kind: RotaryEmbedding(config.head_dim, max_positions, *gemma.rope[kind]) for kind in gemma.rope}
        for kind, rotary in self.rotary.items():
            self.add_module(f"rotary_{kind}", rotary)  # moved with the model
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config, i, prefixed(linear, f"layers.{i}."), self.rotary[self._kind(gemma, i)], backend, tp
            )
            for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.kinds = [self._kind(gemma, i) for i in range(config.num_layers)]
        # rounded to the dtype, as transformers does, once: a host float that a CUDA graph takes as a constant (a
        # 0-dim host tensor made in each forward is freed once the capture ends)
        self.normalizer = torch.tensor(config.hidden_size**0.5, dtype=config.dtype).item()
        self.backend = backend

    @staticmethod
    def _kind(gemma: GemmaConfig, layer: int) -> str:
        return LOCAL if gemma.windows[layer] else GLOBAL

    def forward(self, input_ids, positions, attn_metadata, lora):
        x = self.embed_tokens(input_ids)
        x = x * self.normalizer
        rotations = {kind: rotary.at(positions) for kind, rotary in self.rotary.items()}
        # local layers read their own KV group's blocks where they keep one (`worker.kv_groups`)
        metadata = {GLOBAL: attn_metadata, LOCAL: attn_metadata.sliding or attn_metadata}
        residual = None
        for layer, kind in zip(self.layers, self.kinds):
            x, residual = layer(x, residual, rotations[kind], metadata[kind], lora)
        return self.norm.add_and_norm(x, residual, self.backend)[0]


class GemmaForCausalLM(nn.Module):
    """Gemma 2 and Gemma 3 (text). Tied embeddings (Gemma's checkpoints have no lm_head) unless config.json
    says otherwise."""

    ignored_weights = LlamaForCausalLM.ignored_weights
    stacked_modules = LlamaForCausalLM.stacked_modules
    applies_sliding_window = True
    family_config = staticmethod(GemmaConfig.from_hf)

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
        inner = prefixed(linear, "model."), prefixed(embedding, "model.")
        self.model = GemmaModel(config, *inner, max_positions, backend, tp)
        generates = config.task == "generate"
        self.lm_head = (
            None
            if config.tie_word_embeddings or not generates
            else embedding("lm_head", config.vocab_size, config.hidden_size)
        )
        self.final_softcap = config.family.final_softcap
        self.pooler = None if config.pooler is None else Pooler(config.pooler.pooling_type)

    def forward(self, input_ids, positions, attn_metadata: kernels.AttentionMetadata, lora: LoRAMetadata | None = None):
        return self.model(input_ids, positions, attn_metadata, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of `hidden`'s rows, soft-capped where Gemma 2 says; with tensor parallelism on rank 0 only."""
        logits = (self.model.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        if logits is None or not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def pool(self, hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
        return self.pooler(hidden, md)

    def layers_kv(self):
        return [layer.self_attn for layer in self.model.layers]
