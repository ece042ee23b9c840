"""Which model class serves each architecture (config.json's `architectures[0]`), and what the architecture
implies that its config.json leaves unsaid. A Llama variant is one line in `ARCHITECTURES`; a new family is a
model file built from `layers.py` plus its line here."""

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.llama import LlamaForCausalLM
from tiffin.quant import get_quant_config


@dataclass(frozen=True)
class Architecture:
    model: type[nn.Module]
    qkv_bias: bool = False  # q/k/v projections carry a bias (o_proj does not)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM),
    "MistralForCausalLM": Architecture(LlamaForCausalLM),
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qk_norm=True),
    "IQuestCoderForCausalLM": Architecture(LlamaForCausalLM),
}


def get_model_config(path: str | Path) -> ModelConfig:
    """The checkpoint's ModelConfig, its quantization included; ValueError, before any weight is read, for an
    architecture, activation or quantization tiffin cannot serve."""
    raw = json.loads((Path(path) / "config.json").read_text())
    arch = get_architecture((raw.get("architectures") or ["?"])[0])
    return ModelConfig.from_hf(raw, get_quant_config(path, raw), arch.qkv_bias, arch.qk_norm)


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; tiffin serves {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
