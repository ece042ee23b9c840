"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): the Llama block with multi-head
latent attention (MLA) and DeepSeek's mixture of experts, as transformers computes them.

MLA: a token's keys and values come from one latent vector, `kv_a_proj_with_mqa(x)` = [c (kv_lora_rank), k_pe
(qk_rope_head_dim)], c RMS-normalized, k_pe rotated (one rotary key shared by every head). Head h's key is
[W_UK[h] c, k_pe] and its value W_UV[h] c, the two up-projections stacked in `kv_b_proj`. The KV cache keeps only
[c, k_pe] per token and layer (`ModelConfig.kv_latent_dim`, `KVCacheSpec.parts` 1), paged as every other cache
(block tables, prefix caching, chunked prefill, preemption unchanged); `kernels.mla_attention` attends decode rows
absorbed (W_UK into the queries, W_UV into the output: q_h . k_h = [W_UK[h]^T q_nope_h, q_pe_h] . [c, k_pe]) and
prefill spans over their context's latent expanded into per-head keys and values.

Rotary: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)...; de-interleaving the rotary dims first makes it
the Neox rotation of `layers.RotaryEmbedding` (the dot products are the same, the rounding is not bit-equal to
V2's complex product). YaRN's `mscale_all_dim` scales the softmax scale (squared), its attention factor the
rotary part of queries and keys (squared, on the queries).

Experts (`moe.Experts`), routed by `moe.grouped_topk`: softmax over the router (V2, `greedy` or
`group_limited_greedy`), or sigmoid with `e_score_correction_bias` for the choice (V3, `noaux_tc`); the weights
renormalized where `norm_topk_prob` says (for V2 too, as DeepSeek's code and vLLM do: transformers 5 ignores it
there), then times `routed_scaling_factor`. The `n_shared_experts` shared experts form one ungated MLP every token
goes through; the first `first_k_dense_replace` layers keep a dense MLP. The router runs in fp32, as transformers
keeps it.

Tensor parallelism, as vLLM splits MLA: each rank holds its share of the heads (q_proj or q_b_proj, and kv_b_proj,
column-parallel by head; o_proj row-parallel), while q_a_proj, kv_a_proj_with_mqa and their norms are replicated:
every rank computes the whole latent vector of every token and keeps the whole latent cache, which its heads all
read (`KVCacheSpec.of`: the same bytes per token on every rank). The experts are split by their intermediate
dimension (`moe.Experts`), the shared experts and the dense layers' MLPs as any MLP; the router is replicated. A
MoE layer all-reduces once, the experts' and the shared experts' partial sums added first.

Not served (refused by name): a quantized KV cache (int8/fp8) or int8 host tier, LoRA, quantized checkpoints
(`loader`: quantized experts), `moe_layer_freq` other than 1. On the Triton backend the experts run the fused MoE
kernel and decode-only steps the latent attention's Triton decode (`kernels/triton_mla.py`), neither reading the
host, so decode steps are captured in CUDA graphs (not an fp32 latent of rank > 128: `graphed_decode.graph_refusal`);
steps with a prefill attend by the torch implementation.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.models.config import ModelConfig, read_rope
from tiffin.engine.models.layers import MLP, LinearFactory, RMSNorm, RotaryEmbedding, Rotation, prefixed
from tiffin.engine.models.llama import _LAYER, DecoderLayer, LlamaForCausalLM, MLPFactory, dense_mlp
from tiffin.engine.models.moe import Experts, grouped_topk
from tiffin.kernels.lora import LoRAMetadata

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: transformers' default, whatever rms_norm_eps says
TOPK_METHODS = {"greedy", "group_limited_greedy", "noaux_tc"}


@dataclass(frozen=True)
class DeepseekConfig:
    """What config.json says of a DeepSeek beyond `ModelConfig`'s fields."""

    q_lora_rank: int | None  # None: one q_proj (V2-Lite), else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    scoring: str  # "softmax" (V2) or "sigmoid" (V3, with e_score_correction_bias)
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    shared_experts_size: int  # the shared experts' intermediate size (0: none)

    @classmethod
    def from_hf(cls, raw: dict) -> "DeepseekConfig":
        v3 = raw["architectures"][0] == "DeepseekV3ForCausalLM"
        method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if method not in TOPK_METHODS or (method == "noaux_tc") != v3:
            raise ValueError(f"{raw['architectures'][0]}: topk_method {method!r} is not supported")
        if (raw.get("moe_layer_freq") or 1) != 1:
            raise ValueError(f"moe_layer_freq {raw['moe_layer_freq']} is not supported (1: every layer past the dense)")
        scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        if scoring != ("sigmoid" if v3 else "softmax"):
            raise ValueError(f"{raw['architectures'][0]}: scoring_func {scoring!r} is not supported")
        nope, rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
        grouped = method != "greedy"
        return cls(
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=raw["v_head_dim"],
            rope_interleave=raw.get("rope_interleave", True) if v3 else True,
            softmax_scale=(nope + rope) ** -0.5 * _mscale_all_dim(raw) ** 2,
            scoring=scoring,
            num_groups=(raw.get("n_group") or 1) if grouped else 1,
            topk_groups=(raw.get("topk_group") or 1) if grouped else 1,
            routed_scaling_factor=raw.get("routed_scaling_factor") or 1.0,
            shared_experts_size=(raw.get("n_shared_experts") or 0) * raw["moe_intermediate_size"],
        )


def _mscale_all_dim(raw: dict) -> float:
    """YaRN's factor on the whole softmax scale (squared there), as DeepSeek's reference and transformers apply it."""
    _, scaling = read_rope(raw)
    m = (scaling or {}).get("mscale_all_dim")
    return 0.1 * m * math.log(scaling["factor"]) + 1.0 if m and scaling["factor"] > 1 else 1.0


class LatentAttention(nn.Module):
    """MLA over the latent cache: `k_cache` (which is `v_cache`) `[num_blocks, block_size, 1, kv_lora_rank +
    qk_rope_head_dim]`, set by the ModelRunner."""

    def __init__(
        self, config: ModelConfig, linear: LinearFactory, rotary: RotaryEmbedding, backend: str, tp: TensorParallel
    ):
        super().__init__()
        ds: DeepseekConfig = config.family
        hidden, heads, bias = config.hidden_size, config.num_heads, config.qkv_bias  # qkv_bias: attention_bias
        self.num_heads = tp.split(heads, "num_attention_heads")  # this rank's
        self.nope, self.rope = ds.qk_nope_head_dim, ds.qk_rope_head_dim
        self.rank = ds.kv_lora_rank
        self.v_head_dim, self.num_kv_heads, self.head_dim = ds.v_head_dim, 1, ds.kv_lora_rank + ds.qk_rope_head_dim
        q_size = heads * (self.nope + self.rope)
        if ds.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, [q_size], False, "column")
        else:
            self.q_a_proj = linear("q_a_proj", hidden, [ds.q_lora_rank], bias)
            self.q_a_layernorm = RMSNorm(ds.q_lora_rank, LATENT_NORM_EPS, config.dtype)
            self.q_b_proj = linear("q_b_proj", ds.q_lora_rank, [q_size], False, "column")
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, [self.head_dim], bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, config.dtype)
        self.kv_b_proj = linear("kv_b_proj", self.rank, [heads * (self.nope + self.v_head_dim)], False, "column")
        self.kv_b_proj.looks_up_rows = True  # its plain weight is read, never applied: a CPU prepack keeps it
        self.o_proj = linear("o_proj", heads * self.v_head_dim, [hidden], bias, "row")
        self.rotary, self.backend, self.scale = rotary, backend, ds.softmax_scale
        self.q_pe_scale = rotary.attention_scaling**2  # YaRN's attention factor, of q_pe and k_pe, on q_pe alone
        # the rotary dims' order that turns DeepSeek's interleaved pairs into Neox halves
        order = torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])
        self.deinterleave = order if ds.rope_interleave else None
        self.k_cache = self.v_cache = torch.empty(0)  # set by the ModelRunner
        self.k_scale = self.v_scale = None  # a latent cache is never quantized (`KVCacheSpec.of`)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, attn_metadata: kernels.AttentionMetadata, lora: LoRAMetadata | None
    ) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(len(x), self.num_heads, self.nope + self.rope)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        pe = torch.cat([q[..., self.nope :], k_pe[:, None]], dim=1)  # the query heads' rotary dims and the key's
        if self.deinterleave is not None:
            pe = pe[..., self.deinterleave]
        pe = rotation(pe.contiguous())
        q_pe = pe[:, : self.num_heads] * self.q_pe_scale if self.q_pe_scale != 1.0 else pe[:, : self.num_heads]
        latent = torch.cat([self.kv_a_layernorm(c, self.backend), pe[:, self.num_heads]], dim=-1)[:, None]
        kernels.write_kv(latent, latent, self.k_cache, self.v_cache, attn_metadata.slot_mapping)
        w_uk, w_uv = self.up_projections()
        args = q[..., : self.nope], q_pe, self.k_cache, attn_metadata, self.scale, w_uk, w_uv, latent
        o = kernels.mla_attention(*args, backend=self.backend)
        return self.o_proj(o.flatten(1), lora)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK `[heads, nope, rank]`, W_UV `[heads, v_head_dim, rank]`, this rank's heads): views of `kv_b_proj`'s
        weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]


class Router(nn.Module):
    """The router's `weight [E, H]` (and V3's `e_score_correction_bias [E]`), in fp32 as transformers keeps them."""

    def __init__(self, num_experts: int, hidden_size: int, score_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if score_bias else None
        self.e_score_correction_bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearFactory, backend: str, tp: TensorParallel):
        super().__init__()
        moe, ds, hidden = config.moe, config.family, config.hidden_size
        self.ds, self.top_k, self.renormalize, self.tp = ds, moe.top_k, moe.renormalize, tp
        self.gate = Router(moe.num_experts, hidden, ds.scoring == "sigmoid")
        self.experts = Experts(
            moe.num_experts, hidden, moe.intermediate_size, config.hidden_act, config.dtype, backend, tp
        )
        self.shared_experts = None
        if ds.shared_experts_size:
            shared = prefixed(linear, "shared_experts.")
            self.shared_experts = MLP(hidden, ds.shared_experts_size, config.hidden_act, False, shared, backend)
            self.shared_experts.down_proj.reduce_results = False  # one all-reduce of the layer's sum, as vLLM's

    def forward(self, x: torch.Tensor, lora: LoRAMetadata | None = None) -> torch.Tensor:
        ds = self.ds
        weights, experts = grouped_topk(
            self.gate(x),
            self.top_k,
            ds.scoring,
            ds.num_groups,
            ds.topk_groups,
            self.gate.e_score_correction_bias,
            self.renormalize,
            ds.routed_scaling_factor,
        )
        y = self.experts(x, weights.to(x.dtype), experts)
        return self.tp.all_reduce(y if self.shared_experts is None else y + self.shared_experts(x, lora))


def deepseek_mlp(config: ModelConfig, layer: int, linear: LinearFactory, backend: str, tp: TensorParallel):
    """Layer `layer`'s MLP: the experts past the first `first_k_dense_replace` layers, else the dense one."""
    if config.moe is not None and config.moe.sparse(layer):
        return DeepseekMoE(config, linear, backend, tp)
    return dense_mlp(config, layer, linear, backend, tp)


class DeepseekDecoderLayer(DecoderLayer):
    """The Llama layer (its forward) with latent attention."""

    def __init__(self, config, index, linear, rotary, backend, tp, make_mlp: MLPFactory):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = LatentAttention(config, prefixed(linear, "self_attn."), rotary, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = make_mlp(config, index, prefixed(linear, "mlp."), backend, tp)
        self.backend, self.residual_multiplier = backend, 1.0


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 and -V3 (their multi-token-prediction layers, past num_hidden_layers, are not read)."""

    stacked_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # DeepSeek's q_proj is its own
    make_mlp = staticmethod(deepseek_mlp)
    decoder_layer = DeepseekDecoderLayer
    family_config = staticmethod(DeepseekConfig.from_hf)
    applies_sliding_window = False
    supports_lora = False

    def __init__(self, config: ModelConfig, max_positions: int, backend: str, linear, embedding, tp=UNSHARDED, **kw):
        super().__init__(config, max_positions, backend, linear, embedding, tp, **kw)
        self.num_layers = config.num_layers

    def skips_weight(self, name: str) -> bool:
        layer = _LAYER.search(name)
        return bool(layer) and int(layer[1]) >= self.num_layers or super().skips_weight(name)
