"""The Llama family in plain torch: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), Phi-3 (LongRoPE),
SmolLM3 (layers without RoPE) and Granite (its multipliers). Each layer's MLP comes from the model class's
`make_mlp` (the gated MLP here; a mixture of experts in `moe.py`), each layer from its `decoder_layer` (OLMo 2's
post-norm one in `olmo2.py`).

The model sees one flattened batch (`input_ids[T]`, `positions[T]`), its attention metadata and, when adapters
are loaded, its LoRA metadata (token -> adapter slot), never requests.

Pipeline parallelism: a stage holds its contiguous slice of the decoder layers (the others are `MissingLayer`s,
keeping the checkpoint's layer numbers), the embedding on the first stage (and on the last when the head is tied to
it), the final norm and head on the last. A stage's forward takes the previous stage's `(hidden, residual)` and,
but on the last stage, returns its own.
"""

import re
from collections.abc import Callable

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.pipeline import UNSTAGED, PipelineParallel
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import (
    MLP,
    EmbeddingFactory,
    LinearFactory,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    prefixed,
)
from tiffin.engine.models.pooler import Pooler, PoolingMetadata
from tiffin.kernels.lora import LoRAMetadata


class Attention(nn.Module):
    """With tensor parallelism, this rank's query heads and the KV heads they read (split, or replicated when
    there are fewer KV heads than ranks)."""

    def __init__(
        self, config: ModelConfig, linear: LinearFactory, rotary: RotaryEmbedding, backend: str, tp: TensorParallel
    ):
        super().__init__()
        self.num_heads = tp.split(config.num_heads, "num_attention_heads")
        self.num_kv_heads, self.head_dim = tp.kv_heads(config.num_kv_heads), config.head_dim
        q_size, kv_size = config.num_heads * self.head_dim, config.num_kv_heads * self.head_dim
        kv_parts = config.num_kv_heads // self.num_kv_heads
        self.qkv_proj = linear(
            "qkv_proj",
            config.hidden_size,
            [q_size, kv_size, kv_size],
            config.qkv_bias,
            "column",
            [tp.size] + [kv_parts] * 2,
        )
        self.o_proj = linear("o_proj", q_size, [config.hidden_size], False, "row")
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype)
        self.qk_norm = config.qk_norm  # applied by `Rotation.rotate_and_write_kv`, fused into it on a GPU
        self.rotary = rotary  # applied through the forward's `Rotation`; the native decode step reads its tables
        self.backend = backend
        # Granite's multiplier replaces 1/sqrt(head_dim); a scaled RoPE's factor, on q and k both, enters squared
        self.scale = (config.attention_multiplier or self.head_dim**-0.5) * rotary.attention_scaling**2
        self.window, self.softcap = 0, 0.0  # every key seen, scores uncapped (Gemma's layers set them)
        self.k_cache = self.v_cache = torch.empty(0)  # set by the ModelRunner
        self.k_scale = self.v_scale = None  # a quantized cache's scales (`kv_quant`), set by the ModelRunner

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        attn_metadata: kernels.AttentionMetadata,
        lora: LoRAMetadata | None,
    ) -> torch.Tensor:
        qk, v = self.project(x, lora)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, fresh_kv = rotation.rotate_and_write_kv(qk, v, self, attn_metadata.slot_mapping, self.backend)
        kv = (self.k_cache, self.v_cache, attn_metadata, self.scale, self.backend, True, self.k_scale, self.v_scale)
        bounds = dict(window=self.window, softcap=self.softcap)
        o = kernels.paged_attention(q, *kv, query_rotated=fresh_kv is None, fresh_kv=fresh_kv, **bounds)
        return self.o_proj(o.flatten(1), lora)

    def project(self, x: torch.Tensor, lora: LoRAMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the queries and keys side by side, the values) of `x`, flat: `[T, (heads + kv_heads) * head_dim]`,
        `[T, kv_heads * head_dim]`."""
        return self.qkv_proj(x, lora).split([self.qkv_proj.offsets[2], self.qkv_proj.output_sizes[2]], dim=-1)


def dense_mlp(config: ModelConfig, layer: int, linear: LinearFactory, backend: str, tp: TensorParallel) -> nn.Module:
    """Layer `layer`'s MLP: the gated one of every Llama layer (`LlamaForCausalLM.make_mlp`)."""
    return MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias, linear, backend)


MLPFactory = Callable[[ModelConfig, int, LinearFactory, str, TensorParallel], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        linear: LinearFactory,
        rotary: RotaryEmbedding,
        backend: str,
        tp: TensorParallel,
        make_mlp: MLPFactory = dense_mlp,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, prefixed(linear, "self_attn."), rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = make_mlp(config, index, prefixed(linear, "mlp."), backend, tp)
        self.backend, self.residual_multiplier = backend, config.residual_multiplier

    def forward(self, x, residual, rotation, attn_metadata, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream without it): the next layer (or the final norm) adds the
        two in its norm's kernel. `residual` None: the first layer, whose `x` is the embedding."""
        if residual is None:
            x, residual = self.input_layernorm(x, self.backend), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual, self.backend)
        x = self.scaled(self.self_attn(x, rotation, attn_metadata, lora))
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual, self.backend)
        return self.scaled(self.mlp(x, lora)), residual

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as it joins the residual stream (Granite scales it)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds."""


class Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        linear: LinearFactory,
        embedding: EmbeddingFactory,
        rotary: RotaryEmbedding,
        backend: str,
        tp: TensorParallel,
        make_mlp: MLPFactory = dense_mlp,
        decoder_layer: type[nn.Module] = DecoderLayer,
        pp: PipelineParallel = UNSTAGED,
    ):
        super().__init__()
        self.held = pp.layers(config.num_layers)
        embeds = pp.first or (pp.last and config.tie_word_embeddings and config.task == "generate")
        self.embed_tokens = embedding("embed_tokens", config.vocab_size, config.hidden_size) if embeds else None
        # NoPE layers rotate by the identity: their keys go through the same fused write as the others'
        nope = RotaryEmbedding(config.head_dim, rotary.cos.shape[0], None, None) if config.nope_layers else None
        self.layers = nn.ModuleList(
            decoder_layer(
                config,
                i,
                prefixed(linear, f"layers.{i}."),
                nope if i in config.nope_layers else rotary,
                backend,
                tp,
                make_mlp,
            )
            if i in self.held
            else MissingLayer()
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype) if pp.last else None
        self.rotary, self.nope, self.backend, self.first = rotary, nope, backend, pp.first
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, input_ids, positions, attn_metadata, lora, intermediate=None, inputs_embeds=None):
        """The final hidden states; on a stage before the last, its `(hidden, residual)` for the next, which passes
        them as `intermediate`. `inputs_embeds`: the tokens' input embeddings where a caller computed them (images
        in the prompt)."""
        if self.first:
            x, residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds, None
            x = x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier
        else:
            x, residual = intermediate
        rotations = {r: r.at(positions) for r in (self.rotary, self.nope) if r is not None}
        for layer in self.layers[self.held.start : self.held.stop]:
            x, residual = layer(x, residual, rotations[layer.self_attn.rotary], attn_metadata, lora)
        if self.norm is None:
            return x, residual
        return self.norm.add_and_norm(x, residual, self.backend)[0]


class LlamaForCausalLM(nn.Module):
    ignored_weights = ("rotary_emb",)  # checkpoint weights the model recomputes
    # checkpoint module name -> (our stacked module, shard index)
    stacked_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    make_mlp = staticmethod(dense_mlp)  # (config, layer index, linear, backend, tp) -> that layer's MLP
    decoder_layer = DecoderLayer

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
        super().__init__()
        rotary = self.make_rotary(config, max_positions)
        inner = prefixed(linear, "model."), prefixed(embedding, "model.")
        self.model = Model(config, *inner, rotary, backend, tp, self.make_mlp, self.decoder_layer, pp)
        self.logits_scaling = config.logits_scaling
        # the Llama block exactly as the native CPU decode step runs it (`worker/cpu_decode.py`)
        self.plain_block = (
            self.decoder_layer is DecoderLayer
            and not config.nope_layers
            and (config.embedding_multiplier == config.residual_multiplier == 1.0)
        )
        generates = config.task == "generate"
        self.lm_head = (
            None
            if config.tie_word_embeddings or not generates or not pp.last
            else embedding("lm_head", config.vocab_size, config.hidden_size)
        )
        self.staged = pp.size > 1
        self.pooler = None if config.pooler is None else Pooler(config.pooler.pooling_type)

    @staticmethod
    def make_rotary(config: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The rotary embedding every layer applies (M-RoPE's in `qwen2_vl.py`)."""
        return RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids, positions, attn_metadata, lora=None, intermediate=None):
        return self.model(input_ids, positions, attn_metadata, lora, intermediate)

    def skips_weight(self, name: str) -> bool:
        """Whether checkpoint weight `name` belongs to another pipeline stage."""
        if not self.staged:
            return False
        if layer := _LAYER.search(name):
            return int(layer[1]) not in self.model.held
        if ".embed_tokens." in name:
            return self.model.embed_tokens is None
        return name.startswith(("lm_head.", "model.norm.")) and self.model.norm is None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of `hidden`'s rows; with tensor parallelism on rank 0 only (None on the others)."""
        logits = (self.model.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        return logits if logits is None or self.logits_scaling == 1.0 else logits / self.logits_scaling

    def pool(self, hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
        return self.pooler(hidden, md)

    def layers_kv(self):
        """The attention modules of this stage's layers: its KV pool's."""
        return [self.model.layers[i].self_attn for i in self.model.held]


_LAYER = re.compile(r"\blayers\.(\d+)\.")
