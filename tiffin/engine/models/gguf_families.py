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
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import Keys

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
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": dims.hidden // dims.heads if big else dims.head_dim,
            "sliding_window": window,
            "layer_types": [LOCAL if is_local else GLOBAL for is_local in local],
            "attn_logit_softcapping": c.field(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, softcaps[0]),
            "final_logit_softcapping": c.field(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, softcaps[1]),
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


FAMILIES: dict[str, GGUFFamily] = {
    "granite": GGUFFamily(granite),
    "gemma2": GGUFFamily(gemma(2), norm_offset=1.0),
    "gemma3": GGUFFamily(gemma(3), norm_offset=1.0),
    "phi3": GGUFFamily(phi3, fused=tuple(FUSED), config_tensors=("rope_factors_long", "rope_factors_short")),
}
PLAIN = GGUFFamily()
