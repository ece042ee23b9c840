"""GPTQ (AutoGPTQ / GPTQModel): 4- or 8-bit weights packed along the input rows, zeros packed along the
output; `checkpoint_format: gptq` stores zeros minus one; act-order (`desc_act`) assigns input rows to groups
through `g_idx`, which is turned into a row permutation once the layer is loaded."""

from dataclasses import dataclass

import torch
from torch import nn

from tiffin.kernels.quant import gptq_dequantize, gptq_gemm, pack_rows, unpack_rows
from tiffin.quant.base import (
    SCALES_DTYPE,
    LinearMethod,
    PackedLinearMethod,
    QuantizationConfig,
    param,
    register_quant_config,
    supported,
)

GPTQ_GROUP_SIZES = (32, 64, 128, -1)
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to the stored zeros


@register_quant_config
@dataclass(frozen=True)
class GPTQConfig(QuantizationConfig):
    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str

    name = "gptq"
    description = (
        "GPTQ (4- or 8-bit, group size 32/64/128/-1, desc_act on or off, sym or asym, checkpoint_format gptq or "
        "gptq_v2)"
    )
    side_file = "quantize_config.json"

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "GPTQConfig":
        bits, group_size = settings.get("bits"), settings.get("group_size", -1)
        fmt = str(settings.get("checkpoint_format") or settings.get("format") or "gptq").lower()
        problems = []
        if bits not in GPTQ_BITS:
            problems.append(f"{bits}-bit weights")
        if group_size not in GPTQ_GROUP_SIZES:
            problems.append(f"group size {group_size}")
        if fmt not in GPTQ_FORMATS:
            problems.append(f"checkpoint_format {fmt!r}")
        if str(settings.get("pack_dtype", "int32")) != "int32":
            problems.append(f"pack_dtype {settings['pack_dtype']!r}")
        if settings.get("lm_head"):
            problems.append("a quantized lm_head")
        if settings.get("dynamic"):
            problems.append("per-module 'dynamic' overrides")
        if problems:
            raise ValueError(f"{source}: GPTQ with {', '.join(problems)} is not supported; tiffin serves {supported()}")
        return cls(bits, group_size, bool(settings.get("desc_act", False)), bool(settings.get("sym", True)), fmt)

    @property
    def zero_offset(self) -> int:
        return GPTQ_FORMATS[self.checkpoint_format]

    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        return GPTQLinearMethod(self, backend)


class GPTQLinearMethod(PackedLinearMethod):
    def __init__(self, config: GPTQConfig, backend: str):
        super().__init__(backend)
        self.config = config
        self.pack = 32 // config.bits
        self.tensors = {"qweight": 1, "qzeros": self.pack, "scales": 1, "g_idx": 0}

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        k, n = layer.input_size, layer.output_size
        group_size = k if self.config.group_size == -1 else self.config.group_size
        self.check_sizes(layer, group_size)
        if k % self.pack:
            raise ValueError(f"input size {k} must be a multiple of {self.pack} for {self.config.bits}-bit rows")
        layer.group_size = group_size
        layer.qweight = param(torch.empty(k // self.pack, n, dtype=torch.int32))
        layer.qzeros = param(torch.empty(k // group_size, n // self.pack, dtype=torch.int32))
        layer.scales = param(torch.empty(k // group_size, n, dtype=SCALES_DTYPE))
        layer.perm = None
        if self.config.desc_act:
            # kept on the host: checkpoint tensors arrive there, and the shards of a fused layer are compared
            # with the first one's before the permutation is sent to the weights' device
            layer.g_idx = torch.full((k,), -1, dtype=torch.int32, device="cpu")

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name != "g_idx":
            return super().load(layer, name, tensor, shard)
        if tensor.shape != (layer.input_size,):
            raise ValueError(f"g_idx of shape {tuple(tensor.shape)} does not fit input size {layer.input_size}")
        tensor = tensor.to("cpu", torch.int32)
        if not self.config.desc_act:
            if not torch.equal(tensor, _identity_groups(layer.input_size, layer.group_size)):
                raise ValueError("g_idx assigns input rows to groups out of order but desc_act is false")
        elif bool((layer.g_idx < 0).all()):
            layer.g_idx.copy_(tensor)
        elif not torch.equal(layer.g_idx, tensor):
            # one input permutation per fused layer; shards quantized from the same inputs always agree
            raise ValueError("the shards of a fused layer carry different act-order g_idx")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Act-order: sort input rows by group so that groups are contiguous, as the kernels read them."""
        if not self.config.desc_act:
            return
        g_idx = layer.g_idx.long()
        del layer.g_idx
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], _identity_groups(layer.input_size, layer.group_size).long()):
            raise ValueError(f"g_idx does not put exactly {layer.group_size} input rows in each group")
        if torch.equal(perm, torch.arange(layer.input_size)):
            return
        perm = perm.to(layer.qweight.device)
        layer.qweight.data = pack_rows(unpack_rows(layer.qweight.data, self.config.bits)[perm], self.config.bits)
        layer.perm = param(perm.to(torch.int32))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        x2d = x.reshape(-1, layer.input_size)
        y = gptq_gemm(x2d, layer.qweight, layer.qzeros, layer.scales, c.bits, c.zero_offset, layer.perm, self.backend)
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight `[out, in]` in the scales' dtype, input rows in the checkpoint's order."""
        w = gptq_dequantize(layer.qweight, layer.qzeros, layer.scales, self.config.bits, self.config.zero_offset)
        if layer.perm is not None:
            w = torch.empty_like(w).index_copy_(0, layer.perm.long(), w)
        return w.T


def _identity_groups(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int32) // group_size
