"""Which model class serves each architecture (config.json's `architectures[0]`), and what the architecture
implies that its config.json leaves unsaid: the only place that names architectures. A Llama variant is one
line in `ARCHITECTURES`; a new family is a model file built from `layers.py` plus its line here."""

from dataclasses import dataclass

from torch import nn

from tiffin.engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Architecture:
    model: type[nn.Module]
    qkv_bias: bool = False  # q/k/v projections carry a bias (o_proj does not)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary
    gguf_name: str | None = None  # llama.cpp's name for it in GGUF files, where tiffin reads those


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, gguf_name="llama"),
    "MistralForCausalLM": Architecture(LlamaForCausalLM),  # llama.cpp writes Mistral as llama
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qkv_bias=True, gguf_name="qwen2"),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qk_norm=True, gguf_name="qwen3"),
    "IQuestCoderForCausalLM": Architecture(LlamaForCausalLM),
}


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; tiffin serves {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def gguf_architecture(gguf_name: str, file: str) -> str:
    """The architecture a GGUF file's `general.architecture` names; ValueError naming those tiffin reads."""
    names = {a.gguf_name: name for name, a in ARCHITECTURES.items() if a.gguf_name}
    if gguf_name not in names:
        raise ValueError(
            f"{file}: GGUF architecture {gguf_name!r} is not supported; tiffin reads {', '.join(names)} (llama.cpp "
            f"writes Mistral as llama)"
        )
    return names[gguf_name]
