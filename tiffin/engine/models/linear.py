"""A linear layer whose weight may be stored several ways (plain, AWQ, GPTQ, ...), whole or split across the
ranks of a tensor-parallel group.

A `Linear` may stack several checkpoint tensors along its output (q/k/v into qkv_proj, gate/up into
gate_up_proj): shard `i` fills outputs `offsets[i]:offsets[i+1]`. How the weight is stored, loaded and
applied belongs to its `LinearMethod` (tiffin.quant); the model code only builds `Linear`s and calls them.

Tensor parallelism (vLLM's vocabulary): a column-parallel layer holds this rank's slice of each stacked
shard's outputs (`parts[i]` distinct slices; fewer than ranks replicates them, as MQA/GQA's KV heads); a
row-parallel one holds its slice of the inputs and all-reduces its output before the bias; the vocab-parallel
embedding holds a slice of the vocabulary. `input_size`, `output_sizes` and `offsets` are this rank's; the
`full_*` sizes are the checkpoint's. Each rank loads only its slice (`load_shard`).
"""

import torch
from torch import nn

from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.kernels.lora import LoRAMetadata
from tiffin.quant import LinearMethod, load_shard
from tiffin.quant.base import shape_of


class Linear(nn.Module):
    looks_up_rows = False  # whether its method must keep a weight that rows can be looked up in

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod,
        tp: TensorParallel = UNSHARDED,
        split: str | None = None,
        parts: list[int] | None = None,
    ):
        """`input_size` and `output_sizes` are the checkpoint's; `split` is None (replicated), "column" or "row";
        `parts`: distinct slices of each output shard of a column-parallel layer (default: one per rank)."""
        super().__init__()
        self.tp, self.split = tp, split
        self.full_input_size, self.full_output_sizes = input_size, list(output_sizes)
        if split == "row":
            input_size = tp.split(input_size, "the input size of a row-parallel layer")
        elif split == "column":
            parts = parts or [tp.size] * len(output_sizes)
            if any(size % n for size, n in zip(output_sizes, parts)):
                raise ValueError(f"output sizes {output_sizes} do not split into {parts} parts across {tp.size} ranks")
            output_sizes = [size // n for size, n in zip(output_sizes, parts)]
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
        self.method = method
        self.method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False) if bias else None
        self.adapters = None  # a LoRALayer (tiffin.engine.lora.slots) adds its adapters' delta to the output
        # False: a row-parallel layer without bias returns its rank's partial sum, for its caller to add to others
        # before one all-reduce (vLLM's reduce_results)
        self.reduce_results = True

    def load(self, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Checkpoint tensor `name` of shard `shard`; of all of them at once where the checkpoint stores the stacked
        layer fused (`shard` None: Phi-3's qkv_proj and gate_up_proj), split into its shards here so that each rank
        takes its slice of each."""
        if shard is None and len(self.output_sizes) > 1:
            return self._load_fused(name, tensor)
        if name == "bias":
            return load_shard(self, self.bias, tensor, shard, dim=0)
        self.method.load(self, name, tensor, shard)

    def _load_fused(self, name: str, tensor) -> None:
        if name not in ("weight", "bias") or shape_of(tensor)[0] != sum(self.full_output_sizes):
            raise ValueError(
                f"a fused checkpoint tensor {name!r} of shape {shape_of(tensor)} for outputs {self.full_output_sizes}:"
                f" tiffin splits plain fused weights and biases only"
            )
        start = 0
        for shard, size in enumerate(self.full_output_sizes):
            self.load(name, tensor[start : start + size], shard)
            start += size

    def forward(self, x: torch.Tensor, lora: LoRAMetadata | None = None) -> torch.Tensor:
        """`lora`: the step's token -> adapter slot map, for a layer that holds adapters."""
        y = self.method.apply(self, x)
        if self.adapters is not None:  # before the all-reduce: a row shard's delta is its part of the sum too
            y = self.adapters(x, y, lora)
        if self.split == "row" and self.reduce_results:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class Embedding(Linear):
    """A token embedding `[vocab, hidden]` stored as its method stores a linear weight (plain, or GGUF blocks):
    `forward` looks rows up; `logits` is the output projection (the tied head, or an untied lm_head).
    Vocab-parallel: each rank holds `vocab / N` rows; a lookup sums the ranks' rows (zeros where a token is not
    theirs), the logits are gathered on rank 0 (None elsewhere)."""

    looks_up_rows = True

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        method: LinearMethod,
        tp: TensorParallel = UNSHARDED,
    ):
        super().__init__(hidden_size, [vocab_size], False, dtype, method, tp, "column" if tp.size > 1 else None)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.embedding(self, ids).to(self.dtype)
        local = ids - self.tp.rank * self.output_size
        outside = (local < 0) | (local >= self.output_size)
        x = self.method.embedding(self, local.masked_fill(outside, 0)).to(self.dtype)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.tp.gather(self.method.apply(self, hidden))
