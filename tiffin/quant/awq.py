"""AWQ (AutoAWQ's GEMM layout): 4-bit weights with zero points, packed 8 per int32 along the output in the
nibble order (0, 2, 4, 6, 1, 3, 5, 7); fp16 scales per group of input rows."""

from dataclasses import dataclass

import torch
from torch import nn

from tiffin.kernels.block_gemm import block_gemm, dequantize_blocks
from tiffin.kernels.quant import awq_dequantize, awq_gemm, unpack_awq
from tiffin.quant.base import (
    INT8_BACKENDS,
    SCALES_DTYPE,
    LinearMethod,
    PackedLinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    param,
    refuse,
    register_quant_config,
)

AWQ_GROUP_SIZES = (32, 64, 128)


@register_quant_config
@dataclass(frozen=True)
class AWQConfig(QuantizationConfig):
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()
    bits: int = 4

    name = "awq"
    description = "AWQ (version gemm, 4-bit, zero point, group size 32/64/128)"
    side_file = "quant_config.json"

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "AWQConfig":
        bits = settings.get("bits", settings.get("w_bit", 4))
        group_size = settings.get("group_size", settings.get("q_group_size"))
        version = str(settings.get("version", "gemm")).lower()
        problems = []
        if version != "gemm":
            problems.append(f"version {version!r}")
        if bits != 4:
            problems.append(f"{bits}-bit weights")
        if not settings.get("zero_point", True):
            problems.append("zero_point false")
        if group_size not in AWQ_GROUP_SIZES:
            problems.append(f"group size {group_size}")
        refuse(source, "AWQ", problems)
        skip = settings.get("modules_to_not_convert") or ()
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"{source}: modules_to_not_convert must be a list of module names, got {skip!r}")
        return cls(group_size, tuple(skip))

    def skips(self, module: str) -> bool:
        """AutoAWQ's rule: a module is left unquantized if any listed name is a substring of its name."""
        return any(key in module for key in self.modules_to_not_convert)

    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        return UnquantizedLinearMethod() if self.skips(prefix) else AWQLinearMethod(self, backend)


class AWQLinearMethod(PackedLinearMethod):
    pack = 8
    tensors = {"qweight": 8, "qzeros": 8, "scales": 1}

    def __init__(self, config: AWQConfig, backend: str):
        super().__init__(backend)
        self.group_size = config.group_size

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        self.check_sizes(layer, self.group_size)
        k, n, groups = layer.input_size, layer.output_size, layer.input_size // self.group_size
        layer.qweight = param(torch.empty(k, n // 8, dtype=torch.int32))
        layer.qzeros = param(torch.empty(groups, n // 8, dtype=torch.int32))
        layer.scales = param(torch.empty(groups, n, dtype=SCALES_DTYPE))
        layer.blocks = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.backend in INT8_BACKENDS:
            self.repack_for_int8(layer, unpack_awq(layer.qweight.data), unpack_awq(layer.qzeros.data), 4)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, layer.input_size)
        if layer.blocks is not None:
            y = block_gemm(x2, layer.blocks)
        else:
            y = awq_gemm(x2, layer.qweight, layer.qzeros, layer.scales, self.backend)
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight `[out, in]` as `apply` multiplies by it: in the scales' dtype, or float32 from the
        int8 backend's blocks."""
        if layer.blocks is not None:
            return dequantize_blocks(layer.blocks)
        return awq_dequantize(layer.qweight, layer.qzeros, layer.scales).T
