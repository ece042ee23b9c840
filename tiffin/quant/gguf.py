"""GGUF's Q4_0, Q4_1 and Q8_0 weights kept quantized on the INT4/INT8 GEMM.

A GGUF row (one output) is blocks of 32 inputs: an fp16 scale `d` (Q4_1: then an fp16 minimum `m`), then the
codes, Q8_0 as 32 int8, Q4_0 / Q4_1 as 16 bytes whose low nibbles are inputs 0..15 and high nibbles 16..31.
Q4_0 and Q8_0 are symmetric groups of 32 (`w = (q - 8) * d`, `w = q * d`), Q4_1 adds the minimum
(`w = q * d + m`). At load the codes are repacked in GPTQ's row packing (`qweight [K*bits/32, N]`, Q8_0's codes
offset by 128), `scales` and `mins` `[K/32, N]` kept in fp16 as stored; `gguf_gemm` computes the weight in
fp32 exactly as llama.cpp does, so the kept layer equals the dequantized one.
"""

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QType

from tiffin.kernels.quant import gguf_dequantize, gguf_gemm, pack_rows
from tiffin.quant.methods import SCALES_DTYPE, _load_shard, _param, _QuantLinearMethod

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


def unpack_blocks(raw: torch.Tensor, quant: GGUFQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF rows `uint8 [N, row_bytes]` -> codes `uint8 [N, K]` (Q8_0 offset to 0..255), scales and mins
    `fp16 [N, K/32]` (mins None unless Q4_1)."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, quant.block_bytes)
    scales = blocks[..., 0:2].contiguous().view(SCALES_DTYPE).squeeze(-1)
    mins = blocks[..., 2:4].contiguous().view(SCALES_DTYPE).squeeze(-1) if quant.has_min else None
    qs = blocks[..., quant.header_bytes :]
    if quant.bits == 8:
        codes = (qs.contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    else:
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)
    return codes.reshape(n, -1), scales, mins


class GGUFLinearMethod(_QuantLinearMethod):
    pack = 1  # no packed zeros: any output size fits

    def __init__(self, quant: GGUFQuant, kernel_backend: str = "auto"):
        super().__init__(kernel_backend)
        self.quant = quant

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        self._check_sizes(layer, GROUP_SIZE)
        k, n, groups = layer.input_size, layer.output_size, layer.input_size // GROUP_SIZE
        layer.qweight = _param(torch.empty(k * self.quant.bits // 32, n, dtype=torch.int32))
        layer.scales = _param(torch.empty(groups, n, dtype=SCALES_DTYPE))
        layer.mins = _param(torch.empty(groups, n, dtype=SCALES_DTYPE)) if self.quant.has_min else None

    def load(self, layer, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name != "weight" or tensor.dtype != torch.uint8:
            raise ValueError(f"a GGUF-quantized layer takes its raw weight blocks, got {name!r} ({tensor.dtype})")
        codes, scales, mins = unpack_blocks(tensor, self.quant)
        _load_shard(layer, layer.qweight, pack_rows(codes.T.contiguous(), self.quant.bits), shard, 1)
        _load_shard(layer, layer.scales, scales.T, shard, 1)
        if mins is not None:
            _load_shard(layer, layer.mins, mins.T, shard, 1)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, layer.input_size)
        y = gguf_gemm(x2, layer.qweight, layer.scales, layer.mins, self.quant.bits, self.backend(x.device))
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer) -> torch.Tensor:
        """The layer's weight `[out, in]` in float32 (what `apply` multiplies by)."""
        return gguf_dequantize(layer.qweight, layer.scales, layer.mins, self.quant.bits)

    def embedding(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 `[len(ids), in]`: a tied embedding looked up in its quantized form."""
        mins = None if layer.mins is None else layer.mins[:, ids]
        return gguf_dequantize(layer.qweight[:, ids], layer.scales[:, ids], mins, self.quant.bits)
