"""A linear layer whose weight may be stored several ways (plain, AWQ, GPTQ, ...).

A `Linear` may stack several checkpoint tensors along its output (q/k/v into qkv_proj, gate/up into
gate_up_proj): shard `i` fills outputs `offsets[i]:offsets[i+1]`. How the weight is stored, loaded and
applied belongs to its `LinearMethod` (tiffin.quant); the model code only builds `Linear`s and calls them.
"""

import torch
from torch import nn

from tiffin.quant import LinearMethod, load_shard


class Linear(nn.Module):
    looks_up_rows = False  # whether its method must keep a weight that rows can be looked up in

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype, method: LinearMethod):
        super().__init__()
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
        self.method = method
        self.method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False) if bias else None
        self.lora = None  # a LoRALayer (tiffin.engine.lora_slots) adds its adapters' delta to the output

    def load(self, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name == "bias":
            return load_shard(self, self.bias, tensor, shard, dim=0)
        self.method.load(self, name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        y = y if self.bias is None else y + self.bias
        return y if self.lora is None else self.lora(x, y)


class Embedding(Linear):
    """A token embedding `[vocab, hidden]` stored as its method stores a linear weight (plain, or GGUF blocks):
    `forward` looks rows up; `logits` is the output projection (the tied head, or an untied lm_head)."""

    looks_up_rows = True

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, method: LinearMethod):
        super().__init__(hidden_size, [vocab_size], False, dtype, method)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embedding(self, ids).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden)
