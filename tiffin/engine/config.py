"""Engine settings (what the user chooses) and the model's shape (what the checkpoint says)."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tiffin.engine.engine_config import EngineConfig  # noqa: F401 (re-exported beside ModelConfig)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    sliding_window: int | None
    raw: dict

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        raw = json.loads((Path(path) / "config.json").read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; tiffin serves {', '.join(ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is supported")
        heads = raw["num_attention_heads"]
        theta, scaling = _rope(raw)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), torch.float32),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            raw=raw,
        )


def _rope(raw: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling, whether spelled `rope_theta` + `rope_scaling` (hub checkpoints) or
    `rope_parameters` (transformers 5)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: default, linear, llama3")
    return theta, {**params, "rope_type": kind}
