"""BERT-family encoders in plain torch: `BertModel` (and RoBERTa / XLM-R, whose positions start past the padding
id) for embeddings, `BertForSequenceClassification` for cross-encoder scores. Post-LayerNorm layers, learned
absolute positions, token types, GELU, and attention over the whole prompt: an encoder only pools, so each
sequence runs its prompt whole in one step (the scheduler sees to it) and attends bidirectionally.

Module names mirror Hugging Face's, so checkpoint names map onto them as they are (q/k/v stacked into qkv_proj).
"""

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import EmbeddingFactory, LinearFactory, prefixed
from tiffin.engine.models.pooler import Pooler, PoolingMetadata

# A sentence pair's token types ride in its token ids' bits from here up (`with_token_types`), so that they
# travel with the ids through the scheduler, the batch and the tensor-parallel wire; the embedding splits them.
TOKEN_TYPE_SHIFT = 30
ACTIVATIONS = {
    "gelu": nn.functional.gelu,
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}


def with_token_types(token_ids: list[int], token_type_ids: list[int]) -> list[int]:
    return [t | (k << TOKEN_TYPE_SHIFT) for t, k in zip(token_ids, token_type_ids)]


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig, embedding: EmbeddingFactory):
        super().__init__()
        self.word_embeddings = embedding("word_embeddings", config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=config.dtype)
        self.token_type_embeddings = nn.Embedding(
            max(config.type_vocab_size, 1), config.hidden_size, dtype=config.dtype
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=config.dtype)
        self.position_offset = config.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_ids, token_types = input_ids & ((1 << TOKEN_TYPE_SHIFT) - 1), input_ids >> TOKEN_TYPE_SHIFT
        x = self.word_embeddings(token_ids) + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x + self.token_type_embeddings(token_types))


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearFactory, backend: str, tp: TensorParallel):
        super().__init__()
        self.num_heads = self.num_kv_heads = tp.split(config.num_heads, "num_attention_heads")
        self.head_dim = config.head_dim
        self.qkv_proj = linear("qkv_proj", config.hidden_size, [config.num_heads * self.head_dim] * 3, True, "column")
        self.scale, self.backend = self.head_dim**-0.5, backend
        self.k_cache = self.v_cache = torch.empty(0)  # set by the ModelRunner
        self.k_scale = self.v_scale = None  # a quantized cache's scales (`kv_quant`), set by the ModelRunner

    def forward(self, x: torch.Tensor, attn_metadata: kernels.AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        kernels.write_kv(
            k, v, self.k_cache, self.v_cache, attn_metadata.slot_mapping, self.backend, self.k_scale, self.v_scale
        )
        kv = (self.k_cache, self.v_cache, attn_metadata, self.scale, self.backend, False, self.k_scale, self.v_scale)
        o = kernels.paged_attention(q, *kv, fresh_kv=(k, v))
        return o.flatten(1)


class DenseAndNorm(nn.Module):
    """LayerNorm(dense(x) + residual): how each sublayer of a post-LN layer ends."""

    def __init__(self, config: ModelConfig, linear: LinearFactory, input_size: int):
        super().__init__()
        self.dense = linear("dense", input_size, [config.hidden_size], True, "row")
        self.LayerNorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps, dtype=config.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearFactory, backend: str, tp: TensorParallel):
        super().__init__()
        self.attention = nn.ModuleDict(
            {
                "self": SelfAttention(config, prefixed(linear, "attention.self."), backend, tp),
                "output": DenseAndNorm(config, prefixed(linear, "attention.output."), config.hidden_size),
            }
        )
        size = config.intermediate_size
        self.intermediate = nn.ModuleDict(
            {"dense": linear("intermediate.dense", config.hidden_size, [size], True, "column")}
        )
        self.output = DenseAndNorm(config, prefixed(linear, "output."), size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, attn_metadata: kernels.AttentionMetadata) -> torch.Tensor:
        x = self.attention["output"](self.attention["self"](x, attn_metadata), x)
        return self.output(self.act(self.intermediate["dense"](x)), x)


class BertModel(nn.Module):
    """The encoder; `pool` pools its hidden states as the checkpoint's pooling config says."""

    stacked_modules = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}
    ignored_weights = ("position_ids", "pooler.")  # a buffer; BERT's pre-training pooler, which embeddings skip

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        backend: str,
        linear: LinearFactory,
        embedding: EmbeddingFactory,
        tp: TensorParallel = UNSHARDED,
        with_pooler: bool = False,
    ):
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; tiffin serves {', '.join(ACTIVATIONS)}")
        self.embeddings = Embeddings(config, prefixed(embedding, "embeddings."))
        layers = (
            EncoderLayer(config, prefixed(linear, f"encoder.layer.{i}."), backend, tp) for i in range(config.num_layers)
        )
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(layers)})
        if with_pooler:  # BERT's pooler: tanh(dense(the [CLS] state)), what a classifier head reads
            hidden = config.hidden_size
            self.pooler = nn.ModuleDict({"dense": linear("pooler.dense", hidden, [hidden], True)})
        else:
            self.pooler = Pooler(config.pooler.pooling_type)

    def forward(self, input_ids, positions, attn_metadata, lora=None) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder["layer"]:
            x = layer(x, attn_metadata)
        return x

    def pool(self, hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
        return self.pooler(hidden, md)

    def layers_kv(self) -> list[SelfAttention]:
        return [layer.attention["self"] for layer in self.encoder["layer"]]


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: a sentence pair in, its classifier's scores out (sigmoid, softmax or none, as
    sentence-transformers' CrossEncoder applies them)."""

    stacked_modules = BertModel.stacked_modules
    ignored_weights = ("position_ids",)

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
        self.bert = BertModel(
            config, max_positions, backend, prefixed(linear, "bert."), prefixed(embedding, "bert."), tp, True
        )
        self.classifier = linear("classifier", config.hidden_size, [config.num_labels], True)
        self.activation = config.classifier_activation

    def forward(self, input_ids, positions, attn_metadata, lora=None) -> torch.Tensor:
        return self.bert(input_ids, positions, attn_metadata)

    def pool(self, hidden: torch.Tensor, md: PoolingMetadata) -> torch.Tensor:
        pooled = torch.tanh(self.bert.pooler["dense"](hidden[md.starts]))
        scores = self.classifier(pooled).float()
        if self.activation == "sigmoid":
            return scores.sigmoid()
        return scores.softmax(-1) if self.activation == "softmax" else scores

    def layers_kv(self) -> list[SelfAttention]:
        return self.bert.layers_kv()
