"""Linear layers whose weights may be stored several ways (plain, AWQ, GPTQ, ...).

A `Linear` may stack several checkpoint tensors along its output (q/k/v into qkv_proj, gate/up into
gate_up_proj): shard `i` fills outputs `offsets[i]:offsets[i+1]`. How the weight is stored, loaded and
applied belongs to a `LinearMethod`; the model code only builds `Linear`s and calls them.
"""

import torch
from torch import nn


class LinearMethod:
    """Plain weight `[out, in]` in the model dtype."""

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=dtype), requires_grad=False)

    def load(self, layer: "Linear", name: str, tensor: torch.Tensor, shard: int | None) -> None:
        load_along_output(layer, getattr(layer, name), tensor, shard, dim=0)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Repack once every shard is in (e.g. act-order rows sorted by group); plain weights need nothing."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight)


def load_along_output(
    layer: "Linear", param: torch.Tensor, tensor: torch.Tensor, shard: int | None, dim: int, pack: int = 1
) -> None:
    """Copy `tensor` into `param` at shard `shard`'s slice of output dimension `dim` (packed `pack` outputs
    per element, as INT4 formats store them)."""
    target = param.data
    if shard is not None:
        start = layer.offsets[shard] // pack
        target = target.narrow(dim, start, layer.output_sizes[shard] // pack)
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
    target.copy_(tensor)


class Linear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        method: LinearMethod | None = None,
    ):
        super().__init__()
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
        self.method = method or LinearMethod()
        self.method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False) if bias else None
        self.lora = None  # a LoRALayer (tiffin.engine.lora) adds its adapters' delta to the output

    def load(self, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name == "bias":
            return load_along_output(self, self.bias, tensor, shard, dim=0)
        self.method.load(self, name, tensor, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        y = y if self.bias is None else y + self.bias
        return y if self.lora is None else self.lora(x, y)
