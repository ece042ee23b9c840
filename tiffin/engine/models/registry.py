"""Which model class serves each architecture (config.json's `architectures[0]`), and what the architecture
implies that its config.json leaves unsaid: the only place that names architectures. A Llama variant is one
line in `ARCHITECTURES`; a new family is a model file built from `layers.py` plus its line here."""

from dataclasses import dataclass, field

from torch import nn

from tiffin.engine.models.bert import BertForSequenceClassification, BertModel
from tiffin.engine.models.deepseek import DeepseekForCausalLM
from tiffin.engine.models.dual_encoder import CLIPEmbeddingModel, SiglipEmbeddingModel
from tiffin.engine.models.gemma import GemmaForCausalLM
from tiffin.engine.models.idefics3 import Idefics3ForConditionalGeneration
from tiffin.engine.models.llama import LlamaForCausalLM
from tiffin.engine.models.llava import LlavaForConditionalGeneration
from tiffin.engine.models.moe import MoEForCausalLM
from tiffin.engine.models.olmo2 import Olmo2ForCausalLM
from tiffin.engine.models.qwen2_vl import Qwen2VLForConditionalGeneration

TASKS = ("generate", "embed", "classify")


@dataclass(frozen=True)
class Architecture:
    model: type[nn.Module]
    qkv_bias: bool = False  # q/k/v projections carry a bias (o_proj does not)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary
    gguf_name: str | None = None  # llama.cpp's name for it in GGUF files, where tiffin reads those
    task: str = "generate"  # what it serves by default: "generate", "embed" or "classify" (a cross-encoder)
    causal: bool = True  # False: an encoder, attending over the whole prompt (it can only pool)
    pooling_type: str = "last"  # its pooling when it embeds, unless sentence-transformers' files say otherwise
    checkpoint_prefix: str = ""  # what its checkpoint's weight names lack against the model's (a bare decoder)
    positions_after_padding: bool = False  # RoBERTa: absolute position rows start at pad_token_id + 1
    renormalize_topk: bool = False  # a mixture of experts' top-k weights always sum to 1, whatever norm_topk_prob
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaves its q/k rows (its Llama-derived models)
    config_defaults: dict = field(default_factory=dict)  # what it implies where config.json (or GGUF) says nothing


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(LlamaForCausalLM, gguf_name="llama", gguf_permuted_qk=True),
    "MistralForCausalLM": Architecture(LlamaForCausalLM),  # llama.cpp writes Mistral as llama
    "Qwen2ForCausalLM": Architecture(LlamaForCausalLM, qkv_bias=True, gguf_name="qwen2"),
    "Qwen3ForCausalLM": Architecture(LlamaForCausalLM, qk_norm=True, gguf_name="qwen3"),
    "IQuestCoderForCausalLM": Architecture(LlamaForCausalLM),
    "Phi3ForCausalLM": Architecture(LlamaForCausalLM, gguf_name="phi3"),  # q/k/v and gate/up fused; LongRoPE
    "SmolLM3ForCausalLM": Architecture(  # NoPE layers: no_rope_layers, else every 4th (llama.cpp's too)
        LlamaForCausalLM, gguf_name="smollm3", gguf_permuted_qk=True, config_defaults={"no_rope_layer_interval": 4}
    ),
    "GraniteForCausalLM": Architecture(LlamaForCausalLM, gguf_name="granite", gguf_permuted_qk=True),  # multipliers
    "Olmo2ForCausalLM": Architecture(Olmo2ForCausalLM, gguf_name="olmo2"),  # post-norms, q/k norms over all heads
    # vision-language models (images in the prompt, models/llava.py, models/idefics3.py: SmolVLM too, qwen2_vl.py)
    "LlavaForConditionalGeneration": Architecture(LlavaForConditionalGeneration),
    "Idefics3ForConditionalGeneration": Architecture(Idefics3ForConditionalGeneration),
    "Qwen2VLForConditionalGeneration": Architecture(Qwen2VLForConditionalGeneration, qkv_bias=True),
    "Qwen2_5_VLForConditionalGeneration": Architecture(Qwen2VLForConditionalGeneration, qkv_bias=True),
    # GeGLU, (1 + weight) norms, sliding-window layers, soft-capping (models/gemma.py)
    "Gemma2ForCausalLM": Architecture(GemmaForCausalLM, gguf_name="gemma2"),
    "Gemma3ForCausalLM": Architecture(GemmaForCausalLM, qk_norm=True, gguf_name="gemma3"),
    # mixtures of experts (models/moe.py)
    "MixtralForCausalLM": Architecture(MoEForCausalLM, renormalize_topk=True, gguf_permuted_qk=True),  # GGUF: llama
    "Qwen2MoeForCausalLM": Architecture(MoEForCausalLM, qkv_bias=True, gguf_name="qwen2moe"),
    "Qwen3MoeForCausalLM": Architecture(MoEForCausalLM, qk_norm=True, gguf_name="qwen3moe"),
    # multi-head latent attention over a latent KV cache, grouped top-k routing (models/deepseek.py)
    "DeepseekV2ForCausalLM": Architecture(DeepseekForCausalLM, gguf_name="deepseek2"),  # GGUF: V3 too
    "DeepseekV3ForCausalLM": Architecture(DeepseekForCausalLM),
    # decoders without their head, as Qwen3-Embedding / gte-Qwen2 ship: last-token embeddings
    "LlamaModel": Architecture(LlamaForCausalLM, task="embed", checkpoint_prefix="model."),
    "MistralModel": Architecture(LlamaForCausalLM, task="embed", checkpoint_prefix="model."),
    "Qwen2Model": Architecture(LlamaForCausalLM, qkv_bias=True, task="embed", checkpoint_prefix="model."),
    "Qwen3Model": Architecture(LlamaForCausalLM, qk_norm=True, task="embed", checkpoint_prefix="model."),
    "BertModel": Architecture(BertModel, task="embed", causal=False, pooling_type="cls"),
    "BertForSequenceClassification": Architecture(
        BertForSequenceClassification, task="classify", causal=False, pooling_type="cls"
    ),
    "RobertaModel": Architecture(
        BertModel, task="embed", causal=False, pooling_type="cls", positions_after_padding=True
    ),
    "XLMRobertaModel": Architecture(
        BertModel, task="embed", causal=False, pooling_type="cls", positions_after_padding=True
    ),
    # text and image embeddings in one space (models/dual_encoder.py): CLIP's text tower is causal, SigLIP's not
    "CLIPModel": Architecture(CLIPEmbeddingModel, task="embed"),
    "SiglipModel": Architecture(SiglipEmbeddingModel, task="embed", causal=False),
}


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; tiffin serves {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def resolve_task(arch: Architecture, name: str, task: str) -> str:
    """The task an engine serves for the `task` setting ("auto": the architecture's); ValueError when the
    architecture cannot serve it. A decoder may embed (last-token pooling, say), an encoder cannot generate."""
    if task == "auto":
        return arch.task
    if task not in TASKS:
        raise ValueError(f"task must be 'auto' or one of {', '.join(TASKS)}, got {task!r}")
    if task != arch.task and not (arch.causal and task == "embed"):
        raise ValueError(f"{name} serves {arch.task!r}, not {task!r}")
    return task


def gguf_architecture(gguf_name: str, file: str) -> str:
    """The architecture a GGUF file's `general.architecture` names; ValueError naming those tiffin reads."""
    names = {a.gguf_name: name for name, a in ARCHITECTURES.items() if a.gguf_name}
    if gguf_name not in names:
        raise ValueError(
            f"{file}: GGUF architecture {gguf_name!r} is not supported; tiffin reads {', '.join(names)} (llama.cpp "
            f"writes Mistral as llama)"
        )
    return names[gguf_name]
