"""What llama.cpp's `convert_hf_to_gguf.py` writes differently for the families beyond Llama's block, per GGUF
architecture (`FAMILIES`; the rest is `gguf_checkpoint`'s): the config.json keys its metadata and tensors imply,
the norm weights it stores shifted, the layers it stores fused, and what llama.cpp assumes where a key is absent
(its defaults are the model's behaviour for such a file).

- Granite: its four multipliers, spelled as scales.
- Gemma 2 / Gemma 3: every `*norm.weight` stored as 1 + weight (subtracted here, added back by `GemmaRMSNorm`: exact
  for weights in [0.5, 2], Sterbenz); GeGLU (tanh GELU); queries scaled by head_dim**-0.5, or (hidden /
  heads)**-0.5 at the layer count of the 27B models, as llama.cpp derives it (the file has no key for it); the
  window and the soft-caps from their keys (Gemma 2 without them: 4096, 50, 30); every `sliding_window_pattern`-th
  layer global (Gemma 2: 2, Gemma 3: 6), Gemma 3 without a window all global; local layers' RoPE base
  `rope.freq_base_swa` (absent: Gemma 2's global one, Gemma 3's 10000), unscaled.
- Phi-3: q/k/v in one `attn_qkv`, gate/up in one `ffn_up` (read as Phi-3's own fused `qkv_proj`, `gate_up_proj`);
  LongRoPE's factors as the tensors `rope_factors_{long,short}`, its pretraining length and attention factor as keys.
- DeepSeek-V2/V3 (`deepseek2`, V3 where the router is a sigmoid): `kv_b_proj` split per head into `attn_k_b`
  (transposed: `[heads, kv_lora_rank, nope]`) and `attn_v_b`, put back together here; the router's bias as
  `exp_probs_b`; experts stacked, read fused as transformers holds them (`gate_up_proj`, `down_proj`: DeepSeek's
  `moe.Experts` take them dequantized, as the up-projections the latent attention reads whole); `head_count_kv` 1
  and `key_length` the latent's size (llama.cpp runs MLA as one shared KV head), the real head sizes in the `_mla`
  keys. Softmax routing over expert groups is refused: llama.cpp scores a group by its two best experts, DeepSeek-V2
  by its best.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from gguf import ExpertGatingFuncType, Keys

from tiffin.engine.models.gguf_header import Array

# fused layer modules -> the modules they stack, in order (what a Hugging Face checkpoint stores apart)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GGUFFamily:
    config: Callable[[Any], dict] = lambda checkpoint: {}  # config.json keys beyond the common ones
    norm_offset: float = 0.0  # what the converter added to every norm weight
    fused: tuple[str, ...] = ()  # `FUSED` modules the file stores whole
    config_tensors: tuple[str, ...] = ()  # tensors read into the config, not the model
    modules: tuple[str, ...] = ()  # layer modules beyond gguf_checkpoint's LAYER_MODULES
    optional: tuple[str, ...] = ()  # layer modules a layer may lack beyond gguf_checkpoint's
    dequantized: tuple[str, ...] = ()  # parts of the names of tensors never kept quantized
    shapes: Callable[[Any, Any, tuple], dict] = lambda checkpoint, dims, hidden: {}  # `check_shapes` entries
    regroup: Callable[[Iterator], Iterator] = lambda weights: weights  # (name, tensor) as the model takes them


def granite(c) -> dict:
    multipliers = {
        "embedding_multiplier": Keys.LLM.EMBEDDING_SCALE,
        "residual_multiplier": Keys.LLM.RESIDUAL_SCALE,
        "attention_multiplier": Keys.Attention.SCALE,
        "logits_scaling": Keys.LLM.LOGIT_SCALE,
    }
    return {name: c.positive(key) for name, key in multipliers.items() if c.field(key) is not None}


def gemma(version: int) -> Callable[[Any], dict]:
    """Gemma `version` (2 or 3)'s config, with llama.cpp's defaults for that version."""
    default_window, default_pattern, big_model_layers = (4096, 2, 46) if version == 2 else (0, 6, 62)

    def config(c) -> dict:
        dims = c.dims
        window = c.integer(Keys.Attention.SLIDING_WINDOW, default_window, low=0)
        if isinstance(c.field(Keys.Attention.SLIDING_WINDOW_PATTERN), Array):
            raise c.fail(f"{c.key(Keys.Attention.SLIDING_WINDOW_PATTERN)}: per-layer arrays are not supported")
        pattern = c.integer(Keys.Attention.SLIDING_WINDOW_PATTERN, default_pattern, low=0)
        local = [bool(window) and (pattern == 0 or i % pattern < pattern - 1) for i in range(dims.layers)]
        softcaps = (50.0, 30.0) if version == 2 else (None, None)
        theta = c.positive(Keys.Rope.FREQ_BASE, 10000.0)
        big = dims.layers == big_model_layers
        cap = lambda key, default: default if c.field(key) is None else c.positive(key)  # noqa: E731
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": dims.hidden // dims.heads if big else dims.head_dim,
            "sliding_window": window,
            "layer_types": [LOCAL if is_local else GLOBAL for is_local in local],
            "attn_logit_softcapping": cap(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, softcaps[0]),
            "final_logit_softcapping": cap(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, softcaps[1]),
            "rope_local_base_freq": c.positive(Keys.Rope.FREQ_BASE_SWA, theta if version == 2 else 10000.0),
        }

    return config


def phi3(c) -> dict:
    head_dim = c.dims.head_dim
    config = {"partial_rotary_factor": c.integer(Keys.Rope.DIMENSION_COUNT, head_dim) / head_dim}
    if "rope_factors_long.weight" not in c.tensor_types:
        return config
    factors = {kind: c.small_tensor(f"rope_factors_{kind}.weight", head_dim // 2) for kind in ("long", "short")}
    scaling = {"rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"]}
    if c.field(Keys.Rope.SCALING_ATTN_FACTOR) is not None:
        scaling["attention_factor"] = c.positive(Keys.Rope.SCALING_ATTN_FACTOR)
    original = c.integer(Keys.Rope.SCALING_ORIG_CTX_LEN, c.dims.context)
    return config | {"rope_scaling": scaling, "original_max_position_embeddings": original}


def deepseek2(c, dims=None) -> dict:
    rope, dims = c.required(Keys.Rope.DIMENSION_COUNT), dims or c.dims
    sigmoid = c.integer(Keys.LLM.EXPERT_GATING_FUNC, 1) == ExpertGatingFuncType.SIGMOID
    groups = c.integer(Keys.LLM.EXPERT_GROUP_COUNT, 1)
    if groups > 1 and not sigmoid:
        raise c.fail(f"{c.key(Keys.LLM.EXPERT_GROUP_COUNT)} = {groups} with softmax routing is not supported")
    return {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": dims.heads,
        "kv_lora_rank": c.required(Keys.Attention.KV_LORA_RANK),
        "q_lora_rank": c.integer(Keys.Attention.Q_LORA_RANK),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": c.required(Keys.Attention.KEY_LENGTH_MLA) - rope,
        "v_head_dim": c.required(Keys.Attention.VALUE_LENGTH_MLA),
        "n_shared_experts": c.integer(Keys.LLM.EXPERT_SHARED_COUNT, 0, low=0),
        "routed_scaling_factor": c.positive(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        "norm_topk_prob": c.field(Keys.LLM.EXPERT_WEIGHTS_NORM, False) is True,
        "first_k_dense_replace": c.integer(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0, low=0),
        "topk_method": "noaux_tc" if sigmoid else "greedy",
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "n_group": groups,
        "topk_group": c.integer(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1, high=groups),
    }


def mla_shapes(c, dims, hidden: tuple) -> dict:
    """The shapes of DeepSeek's tensors, from the `_mla` keys (`deepseek2`)."""
    raw, heads = deepseek2(c, dims), dims.heads
    size = lambda name, key: (raw[name], f"{c.key(key)} = {raw[name]}")  # noqa: E731
    rank, v = size("kv_lora_rank", Keys.Attention.KV_LORA_RANK), size("v_head_dim", Keys.Attention.VALUE_LENGTH_MLA)
    nope, rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
    q_rank = size("q_lora_rank", Keys.Attention.Q_LORA_RANK)
    q = (heads * (nope + rope), f"{c.key(Keys.Attention.HEAD_COUNT)} × {c.key(Keys.Attention.KEY_LENGTH_MLA)}")
    shared = (raw["n_shared_experts"] * dims.expert_ffn, f"{c.key(Keys.LLM.EXPERT_SHARED_COUNT)} × expert ffn")
    return {
        "q_proj": (q, hidden),
        "q_a_proj": (q_rank, hidden),
        "q_a_layernorm": (q_rank,),
        "q_b_proj": (q, q_rank),
        "kv_a_proj_with_mqa": ((rank[0] + rope, f"{rank[1]} plus the rotary dims"), hidden),
        "kv_a_layernorm": (rank,),
        "k_b_proj": ((heads, "heads"), rank, (nope, "nope dims")),
        "v_b_proj": ((heads, "heads"), v, rank),
        "o_proj": (hidden, (heads * v[0], f"heads × {v[1]}")),
        "e_score_correction": ((dims.experts, c.key(Keys.LLM.EXPERT_COUNT)),),
        "shared_experts.gate_proj": (shared, hidden),
        "shared_experts.up_proj": (shared, hidden),
        "shared_experts.down_proj": (hidden, shared),
    }


# the tensors llama.cpp splits (or transformers fuses): the first of each pair -> the second
PAIRS = {
    "self_attn.k_b_proj.weight": "self_attn.v_b_proj.weight",
    "mlp.experts.gate_proj.weight": "mlp.experts.up_proj.weight",
}


def deepseek2_weights(weights: Iterator) -> Iterator:
    """kv_b_proj from each layer's k_b/v_b, the experts' gate/up fused, the router's bias under transformers' name."""
    held = {}
    for name, tensor in weights:
        name = name.replace("e_score_correction.bias", "e_score_correction_bias")
        if name.endswith("mlp.experts.down_proj.weight"):
            name = name.removesuffix(".weight")
        part = next((p for pair in PAIRS.items() for p in pair if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        held[name] = tensor
        layer = name.removesuffix(part)
        first, second = next((layer + a, layer + b) for a, b in PAIRS.items() if part in (a, b))
        if first in held and second in held:
            a, b = held.pop(first), held.pop(second)
            if "k_b_proj" in first:
                yield layer + "self_attn.kv_b_proj.weight", torch.cat([a.transpose(1, 2), b], dim=1).flatten(0, 1)
            else:
                yield layer + "mlp.experts.gate_up_proj", torch.cat([a, b], dim=1)


EXPERTS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
MLA_MODULES = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
               "self_attn.kv_a_layernorm", "self_attn.k_b_proj", "self_attn.v_b_proj", "mlp.gate.e_score_correction",
               *(f"mlp.shared_experts.{m}" for m in ("gate_proj", "up_proj", "down_proj")))  # fmt: skip

FAMILIES: dict[str, GGUFFamily] = {
    "granite": GGUFFamily(granite),
    "gemma2": GGUFFamily(gemma(2), norm_offset=1.0),
    "gemma3": GGUFFamily(gemma(3), norm_offset=1.0),
    "phi3": GGUFFamily(phi3, fused=tuple(FUSED), config_tensors=("rope_factors_long", "rope_factors_short")),
    "deepseek2": GGUFFamily(
        deepseek2,
        modules=MLA_MODULES,
        optional=(*MLA_MODULES, *(f"self_attn.{m}_proj" for m in "qkv"), "mlp.gate", *EXPERTS),
        dequantized=(".experts.", ".k_b_proj.", ".v_b_proj."),
        shapes=mla_shapes,
        regroup=deepseek2_weights,
    ),
}
PLAIN = GGUFFamily()
