"""GGUF's Q4_0, Q4_1 and Q8_0 weights kept quantized, computed on by the quantized GEMM (`gguf_gemm`).

A GGUF row (one output) is blocks of 32 inputs: an fp16 scale `d` (Q4_1: then an fp16 minimum `m`), then the
codes, Q8_0 as 32 int8, Q4_0 / Q4_1 as 16 bytes whose low nibbles are inputs 0..15 and high nibbles 16..31.
Q4_0 and Q8_0 are symmetric groups of 32 (`w = (q - 8) * d`, `w = q * d`), Q4_1 adds the minimum
(`w = q * d + m`). A layer keeps the codes as the file lays them out, rows `[N, K*bits/8]`, and the scales and
minimums beside them `[N, K/32]` in fp16 as stored: the torch path dequantizes whole rows with byte ops and the
GEMM computes the weight in fp32 exactly as llama.cpp does, so a kept layer equals the dequantized one.

Which tensors stay quantized is the GGUF reader's call (tiffin.engine.models.gguf_checkpoint): it writes them
into the config it derives from the file as `quantization_config: {quant_method: gguf, kept: {name: type}}`.
A kept token embedding serves its row lookups, and the output projection when tied, from the same blocks.
"""

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from tiffin.kernels.block_gemm import block_gemm, dequantize_blocks, from_gguf
from tiffin.kernels.quant import gguf_dequantize, gguf_gemm
from tiffin.quant.base import (
    INT8_BACKENDS,
    SCALES_DTYPE,
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    keep_blocks,
    load_shard,
    param,
    register_quant_config,
)

GROUP_SIZE = 32


@dataclass(frozen=True)
class GGUFQuant:
    bits: int
    has_min: bool

    @property
    def header_bytes(self) -> int:
        return 4 if self.has_min else 2

    @property
    def block_bytes(self) -> int:
        return self.header_bytes + GROUP_SIZE * self.bits // 8


KEPT_TYPES = {QType.Q4_0: GGUFQuant(4, False), QType.Q4_1: GGUFQuant(4, True), QType.Q8_0: GGUFQuant(8, False)}


@register_quant_config
@dataclass(frozen=True)
class GGUFConfig(QuantizationConfig):
    kept: dict[str, str]  # Hugging Face tensor name -> GGML type of the tensors that stay quantized

    name = "gguf"
    description = (
        "GGUF (Q4_0, Q4_1 and Q8_0 kept quantized; F32, F16, BF16, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K dequantized at load)"
    )

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "GGUFConfig":
        """`settings` come from the GGUF reader, which keeps only KEPT_TYPES (and refuses unknown types)."""
        return cls(settings.get("kept") or {})

    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        qtype = self.kept.get(f"{prefix}.weight")
        return UnquantizedLinearMethod() if qtype is None else GGUFLinearMethod(KEPT_TYPES[QType[qtype]], backend)

    embedding_method = linear_method


def block_fields(raw: torch.Tensor, quant: GGUFQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Views of GGUF rows `uint8 [N, row_bytes]` as `[N, blocks, words]`: the codes, the fp16 scales and mins (None
    unless Q4_1), each in the widest integer word its place in a block aligns with: copied out as words, SmolLM2's
    layers load in half the time they take as bytes."""
    if raw.data_ptr() % 4 or raw.storage_offset() % 4:  # a file's tensor data at an offset words do not align with
        raw = raw.clone()
    n = raw.shape[0]
    words = lambda dtype: raw.view(dtype).view(n, -1, quant.block_bytes // dtype.itemsize)
    halves = words(torch.int16)
    wide = torch.int32 if quant.header_bytes % 4 == 0 and quant.block_bytes % 4 == 0 else torch.int16
    codes = words(wide)[..., quant.header_bytes // wide.itemsize :]
    return codes, halves[..., :1], halves[..., 1:2] if quant.has_min else None


class GGUFLinearMethod(LinearMethod):
    def __init__(self, quant: GGUFQuant, backend: str):
        self.quant, self.backend = quant, backend

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if layer.input_size % GROUP_SIZE:
            raise ValueError(f"GGUF blocks of {GROUP_SIZE} do not divide the layer's input size {layer.input_size}")
        k, n, bits = layer.input_size, layer.output_size, self.quant.bits
        layer.qweight = param(torch.empty(n, k * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8))
        layer.scales = param(torch.empty(n, k // GROUP_SIZE, dtype=SCALES_DTYPE))
        layer.mins = param(torch.empty_like(layer.scales)) if self.quant.has_min else None
        layer.blocks = None

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name != "weight" or tensor.dtype != torch.uint8:
            raise ValueError(f"a GGUF-quantized layer takes its raw weight blocks, got {name!r} ({tensor.dtype})")
        for target, field in zip((layer.qweight, layer.scales, layer.mins), block_fields(tensor, self.quant)):
            if field is not None:  # copied once, straight into the parameter seen as the field's words
                words = target.data.view(field.dtype).view(target.shape[0], -1, field.shape[-1])
                load_shard(layer, words, field, shard, dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The int8 backend reads GGUF's blocks as they are, with fp16 offsets: `-8d` (Q4_0), the minimum (Q4_1),
        `-128d` beside codes + 128 (Q8_0)."""
        if self.backend in INT8_BACKENDS:
            levels = INT8_BACKENDS[self.backend]
            blocks = from_gguf(layer.qweight.data, layer.scales.data, layer.mins, self.quant.bits, levels)
            keep_blocks(layer, blocks, ("qweight", "scales", "mins"))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, layer.input_size)
        if layer.blocks is not None:
            y = block_gemm(x2, layer.blocks)
        else:
            y = gguf_gemm(x2, layer.qweight, layer.scales, layer.mins, self.quant.bits, self.backend)
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight `[out, in]` in float32, exactly (what the exact path multiplies by)."""
        if layer.blocks is not None:
            return dequantize_blocks(layer.blocks)
        return gguf_dequantize(layer.qweight, layer.scales, layer.mins, self.quant.bits)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 `[len(ids), in]`, exactly."""
        if layer.blocks is not None:
            return dequantize_blocks(layer.blocks, ids)
        mins = None if layer.mins is None else layer.mins[ids]
        return gguf_dequantize(layer.qweight[ids], layer.scales[ids], mins, self.quant.bits)
