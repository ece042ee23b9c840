"""The model's shape and variant facts, read from a Hugging Face `config.json` (what the checkpoint says)."""

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tiffin.engine.config import DTYPE_NAMES
from tiffin.engine.models.layers import ACTIVATIONS
from tiffin.engine.models.pooler import PoolerConfig
from tiffin.quant import QuantizationConfig

logger = logging.getLogger(__name__)
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_dtype(setting: str, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """`dtype` setting -> the model's dtype. "auto" keeps the checkpoint's, except fp32 on CUDA, which runs in
    bf16 (fp16 before sm_80, which lacks bf16 tensor cores) as vLLM does: fp32 there halves the batch that fits
    and runs off the tensor cores' fast path. CPU keeps fp32 (no bf16 matmul units on many CPUs), and runs a
    16-bit checkpoint in fp32 where oneDNN has no GEMM of its type (AVX2-only CPUs): torch's fallback takes 5-7x
    fp32's time from a few rows on (a 64 x 512 by 512 x 1408 product, AMD EPYC without AVX-512), for twice the
    memory of the weights left unquantized; `dtype` bfloat16 or float16 keeps them 16-bit."""
    if setting != "auto":
        return DTYPES[setting]
    if checkpoint == torch.float32 and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    if device.type == "cpu" and not cpu_gemm_native(checkpoint):
        logger.info("dtype auto: %s weights run in float32 (this CPU has no %s GEMM)", checkpoint, checkpoint)
        return torch.float32
    return checkpoint


def cpu_gemm_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes `dtype` GEMMs in that type on this CPU (AVX-512 BF16 / FP16 or AMX)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype != torch.float16 or torch.ops.mkldnn._is_mkldnn_fp16_supported()


@dataclass
class MoEConfig:
    """A mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): `top_k` of `num_experts` SwiGLU
    experts of `intermediate_size` each, chosen per token by a softmax router; with a Qwen2-MoE shared expert of
    `shared_expert_size` (0: none) beside them. Dense layers keep the model's MLP: those in `dense_layers`
    (`mlp_only_layers`; DeepSeek's first `first_k_dense_replace`), and all but every `sparse_step`-th
    (`decoder_sparse_step`). DeepSeek's routing and shared experts: `deepseek.DeepseekConfig`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # the top-k routing weights rescaled to sum to 1 (`norm_topk_prob`; Mixtral always)
    shared_expert_size: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has the experts, as transformers decides it."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf(cls, raw: dict, always_renormalize: bool) -> "MoEConfig | None":
        """None for a dense model (no experts in config.json)."""
        experts = raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0
        if not experts:
            return None
        return cls(
            num_experts=experts,
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
            renormalize=always_renormalize or bool(raw.get("norm_topk_prob", False)),
            shared_expert_size=raw.get("shared_expert_intermediate_size") or 0,
            sparse_step=raw.get("decoder_sparse_step") or 1,
            dense_layers=tuple(raw.get("mlp_only_layers") or range(raw.get("first_k_dense_replace") or 0)),
        )


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
    hidden_act: str
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    sliding_window: int | None
    quant_config: QuantizationConfig | None
    moe: MoEConfig | None = None  # experts in place of the MLP of (some) layers
    # Granite's multipliers: of the embeddings, of each attention and MLP output before it joins the residual
    # stream, the attention's softmax scale in place of head_dim**-0.5 (None: that), the logits' divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose attention has no rotary embedding (NoPE)
    # multi-head latent attention (DeepSeek): the size of the one vector a token keeps per layer in the KV cache
    # (kv_lora_rank + qk_rope_head_dim), read as keys and values by every head; 0: per-head K and V
    kv_latent_dim: int = 0
    # what a model file reads of config.json beyond these fields (`family_config` of its class: gemma.GemmaConfig)
    family: object | None = None
    windowed: bool = False  # its attention applies `sliding_window` itself (the context is not capped at it)
    # pooling models (task "embed" or "classify"; set by get_model_config) and encoders
    task: str = "generate"
    causal: bool = True
    pooler: PoolerConfig | None = None
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0
    num_labels: int = 0  # a cross-encoder's classifier outputs
    classifier_activation: str = "sigmoid"  # of its scores: "sigmoid", "softmax" or "identity"
    multimodal: Any = None  # a vision-language model's image config (`llava.LlavaConfig`); None: text only

    def max_model_len(self, requested: int | None) -> int:
        """The context an engine serves: `requested`, or the model's limit when None (beyond it: a ValueError)."""
        limit = self.max_position_embeddings - self.position_offset
        if self.pooler is not None and self.pooler.max_seq_length:  # sentence-transformers' limit
            limit = min(limit, self.pooler.max_seq_length)
        if self.sliding_window and not self.windowed:
            # this model's attention is full: beyond the window it would differ from the checkpoint's
            limit = min(limit, self.sliding_window)
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit}")
        return limit if requested is None else requested

    @classmethod
    def from_hf(
        cls,
        raw: dict,
        quant_config: QuantizationConfig | None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        renormalize_topk: bool = False,
    ) -> "ModelConfig":
        """`raw` is config.json; `qkv_bias`, `qk_norm` and `renormalize_topk` (of a mixture of experts) are what
        the architecture implies beyond it."""
        hidden_act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"  # Gemma: hidden_activation
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; tiffin serves {', '.join(ACTIVATIONS)}")
        heads = raw["num_attention_heads"]
        theta, scaling = read_rope(raw)
        return cls(
            architecture=raw["architectures"][0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            # MLA: the rotary part of a head (transformers' head_dim there too); hub DeepSeek configs lack head_dim
            head_dim=raw.get("qk_rope_head_dim") or raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            hidden_act=hidden_act,
            qkv_bias=raw.get("qkv_bias", qkv_bias) or raw.get("attention_bias", False),  # Qwen2-MoE says qkv_bias
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=qk_norm,
            dtype=DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), torch.float32),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            quant_config=quant_config,
            moe=MoEConfig.from_hf(raw, renormalize_topk),
            embedding_multiplier=raw.get("embedding_multiplier", 1.0),
            residual_multiplier=raw.get("residual_multiplier", 1.0),
            attention_multiplier=raw.get("attention_multiplier"),
            logits_scaling=raw.get("logits_scaling", 1.0),
            nope_layers=_nope_layers(raw),
            kv_latent_dim=raw["kv_lora_rank"] + raw["qk_rope_head_dim"] if raw.get("kv_lora_rank") else 0,
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            type_vocab_size=raw.get("type_vocab_size", 0),
            num_labels=len(raw.get("id2label") or {}) or raw.get("num_labels", 0),
            classifier_activation=_classifier_activation(raw),
        )


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def read_rope(raw: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling, whether spelled `rope_theta` + `rope_scaling` (hub checkpoints) or
    `rope_parameters` (transformers 5). Scalings that extend the context (llama3, yarn, longrope) carry the
    pretraining length `original_max_position_embeddings` (a top-level one first, as Phi-3 saves it) and, where
    the config leaves `factor` out, the extension `max_position_embeddings / original` (as transformers)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "su" or (kind == "yarn" and "long_factor" in params):  # Phi-3's early names for LongRoPE
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    if kind != "linear":
        max_positions = raw.get("max_position_embeddings", 2048)
        original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original = original or max_positions
        params["factor"] = params.get("factor") or max_positions / original
    return theta, {**params, "rope_type": kind}


def _nope_layers(raw: dict) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: where `no_rope_layers` (1: RoPE, 0: none, per layer) says 0, or, without
    that list, every `no_rope_layer_interval`-th layer."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval")
        if not interval:
            return ()
        flags = [int((i + 1) % interval != 0) for i in range(raw["num_hidden_layers"])]
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _classifier_activation(raw: dict) -> str:
    """What a cross-encoder's scores go through, as sentence-transformers' CrossEncoder decides: the activation
    its config.json names, else sigmoid for one label, softmax over several."""
    named = ((raw.get("sentence_transformers") or {}).get("activation_fn") or "").rpartition(".")[2].lower()
    if named in ("sigmoid", "identity", "softmax"):
        return named
    return "sigmoid" if len(raw.get("id2label") or {}) <= 1 else "softmax"
