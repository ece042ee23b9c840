"""GGUF's quantized weights kept quantized: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q2_K to Q6_K, IQ4_NL and IQ4_XS.

On CPU (the native and int8 backends) every kept tensor is decoded once, as it loads, into the block layout of
`tiffin.kernels.block_gemm` (`tiffin.quant.gguf_blocks`: each type's arithmetic as llama.cpp lays it out) and
computed on by the native block GEMMs. A layer stacking tensors of different types (a Q4_K_M file's Q5_0 q and k
beside a Q8_0 v) keeps one block weight per run of alike shards (`StackedBlocks`), each on its own kernel.

On the torch and Triton backends Q4_0, Q4_1 and Q8_0 keep llama.cpp's rows split into their fields: the codes as
the file lays them out, rows `[N, K*bits/8]` (Q4: low nibbles inputs 0..15 of a block, high 16..31), the fp16
scales and minimums beside them `[N, K/32]`, for `gguf_gemm` (the torch path dequantizes whole rows, the Triton
GEMM computes the weight in fp32 exactly as llama.cpp does). The other types keep the block layout there too, for
`dequantized_gemm` (the torch path dequantizes the layer per call, the Triton GEMM decodes it tile by tile), the
weight exact as gguf-py dequantizes it, rounded to the activations' dtype.

Which tensors stay quantized is the GGUF reader's call (tiffin.engine.models.gguf_checkpoint): it writes them
into the config it derives from the file as `quantization_config: {quant_method: gguf, kept: {name: type}}`.
A kept token embedding serves its row lookups, and the output projection when tied, from the same blocks.
"""

import itertools
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from torch import nn

from tiffin.kernels.block_gemm import StackedBlocks, block_gemm, dequantize_blocks, dequantized_gemm
from tiffin.kernels.quant import gguf_dequantize, gguf_gemm
from tiffin.quant.base import (
    INT8_BACKENDS,
    SCALES_DTYPE,
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    keep_blocks,
    param,
    register_quant_config,
    return_freed_memory,
)
from tiffin.quant.gguf_blocks import DECODERS, to_blocks

GROUP_SIZE = 32


@dataclass(frozen=True)
class GGUFQuant:
    """Q4_0, Q4_1 and Q8_0's fields, as `gguf_gemm` reads them."""

    bits: int
    has_min: bool

    @property
    def header_bytes(self) -> int:
        return 4 if self.has_min else 2

    @property
    def block_bytes(self) -> int:
        return self.header_bytes + GROUP_SIZE * self.bits // 8


FIELD_TYPES = {QType.Q4_0: GGUFQuant(4, False), QType.Q4_1: GGUFQuant(4, True), QType.Q8_0: GGUFQuant(8, False)}
KEPT_TYPES = tuple(DECODERS)  # every type with a block decoder stays quantized


@register_quant_config
@dataclass(frozen=True)
class GGUFConfig(QuantizationConfig):
    kept: dict[str, str]  # Hugging Face tensor name -> GGML type of the tensors that stay quantized

    name = "gguf"
    description = (
        f"GGUF ({', '.join(t.name for t in KEPT_TYPES)} kept quantized; F32, F16 and BF16 dequantized at load)"
    )

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "GGUFConfig":
        """`settings` come from the GGUF reader, which keeps only KEPT_TYPES (and refuses unknown types)."""
        return cls(settings.get("kept") or {})

    def layer_method(self, names: list[str], backend: str) -> LinearMethod:
        """A stacked layer's shards may be of different kept types; the reader keeps all of a layer's or none."""
        types = [self.kept.get(f"{name}.weight") for name in names]
        if None in types:
            return super().layer_method(names, backend)
        return GGUFLinearMethod([QType[t] for t in types], backend)

    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        return self.layer_method([prefix], backend) if f"{prefix}.weight" in self.kept else UnquantizedLinearMethod()

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
    """A layer of GGUF rows, one type per stacked shard (`types`). Each shard's raw rows are held as they load (a copy
    of all but the last) and the layer is stored once the last arrives, so a model never holds more than a layer's
    rows beside its stored weights."""

    def __init__(self, types: list[QType], backend: str):
        self.types, self.backend = list(types), backend
        self.fields = FIELD_TYPES.get(types[0]) if backend not in INT8_BACKENDS and len(set(types)) == 1 else None

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if len(self.types) != len(layer.output_sizes):
            raise ValueError(f"{len(self.types)} GGUF types for a layer of {len(layer.output_sizes)} shards")
        for qtype in set(self.types):
            if layer.input_size % GGML_QUANT_SIZES[qtype][0]:
                raise ValueError(
                    f"GGUF {qtype.name} blocks of {GGML_QUANT_SIZES[qtype][0]} do not divide the layer's input size "
                    f"{layer.input_size}"
                )
        layer.blocks, layer.raw_rows = None, [None] * len(self.types)
        layer.weight_device = torch.empty(0).device  # the model is built under its device
        if self.fields is not None:
            k, n, bits = layer.input_size, layer.output_size, self.fields.bits
            layer.qweight = param(torch.empty(n, k * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8))
            layer.scales = param(torch.empty(n, k // GROUP_SIZE, dtype=SCALES_DTYPE))
            layer.mins = param(torch.empty_like(layer.scales)) if self.fields.has_min else None

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        shard = shard or 0
        qtype = self.types[shard]
        block, size = GGML_QUANT_SIZES[qtype]
        want = (layer.output_sizes[shard], layer.input_size // block * size)
        if name != "weight" or tensor.dtype != torch.uint8 or tuple(tensor.shape) != want:
            raise ValueError(
                f"a GGUF {qtype.name} layer takes its raw weight rows, uint8 {list(want)}; got {name!r} "
                f"({tensor.dtype}, {list(tensor.shape)})"
            )
        layer.raw_rows[shard] = tensor
        if all(rows is not None for rows in layer.raw_rows):
            self._store(layer)
        else:  # a copy waits for the layer's other shards: the reader hands the file's pages back as it goes on
            layer.raw_rows[shard] = tensor.clone()

    def _store(self, layer: nn.Module) -> None:
        """The layer's rows, every shard in, as its weights: fields or blocks (see the module's docstring)."""
        rows, layer.raw_rows = layer.raw_rows, []
        if self.fields is not None:
            raw = torch.cat(rows).to(layer.weight_device)
            for target, field in zip((layer.qweight, layer.scales, layer.mins), block_fields(raw, self.fields)):
                if field is not None:  # copied once, straight into the parameter seen as the field's words
                    target.data.view(field.dtype).view(target.shape[0], -1, field.shape[-1]).copy_(field)
            return
        levels = INT8_BACKENDS.get(self.backend, 1)
        parts = []
        for qtype, run in itertools.groupby(zip(self.types, rows), key=lambda pair: pair[0]):
            shards = [raw for _, raw in run]
            part = to_blocks(shards[0] if len(shards) == 1 else torch.cat(shards), qtype, levels)
            parts.append(part.to(layer.weight_device))
        keep_blocks(layer, parts[0] if len(parts) == 1 else StackedBlocks(parts), ())
        return_freed_memory()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        missing = [i for i, rows in enumerate(layer.raw_rows) if rows is None]
        if missing:
            raise ValueError(f"the checkpoint lacks shard(s) {missing} of a GGUF layer of {len(self.types)}")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, layer.input_size)
        if self.fields is not None:
            y = gguf_gemm(x2, layer.qweight, layer.scales, layer.mins, self.fields.bits, self.backend)
        elif self.backend in INT8_BACKENDS:
            y = block_gemm(x2, layer.blocks)
        else:  # the exact path: the weight as gguf-py dequantizes it, in x's dtype
            y = dequantized_gemm(x2, layer.blocks, self.backend)
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight `[out, in]` in float32, exactly (what the exact path multiplies by)."""
        if self.fields is not None:
            return gguf_dequantize(layer.qweight, layer.scales, layer.mins, self.fields.bits)
        return dequantize_blocks(layer.blocks)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 `[len(ids), in]`, exactly."""
        if self.fields is not None:
            mins = None if layer.mins is None else layer.mins[ids]
            return gguf_dequantize(layer.qweight[ids], layer.scales[ids], mins, self.fields.bits)
        return dequantize_blocks(layer.blocks, ids)
