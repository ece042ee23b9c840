"""GPTQ (AutoGPTQ / GPTQModel): 4- or 8-bit weights packed along the input rows, zeros packed along the
output; `checkpoint_format: gptq` stores zeros minus one; act-order (`desc_act`) assigns input rows to groups
through `g_idx`, which is turned into a row permutation once the layer is loaded."""

from dataclasses import dataclass

import torch
from torch import nn

from tiffin.kernels.block_gemm import block_gemm, dequantize_blocks
from tiffin.kernels.quant import gptq_dequantize, gptq_gemm, pack_rows, unpack_cols, unpack_rows
from tiffin.quant.base import (
    INT8_BACKENDS,
    SCALES_DTYPE,
    LinearMethod,
    PackedLinearMethod,
    QuantizationConfig,
    materialize,
    param,
    rank_slice,
    refuse,
    register_quant_config,
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
        refuse(source, "GPTQ", problems)
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
        # an act-order row shard's rows may belong to any group of the whole layer: it keeps every group and pads
        # them (`_pad_groups`), so its rows need not split on group boundaries
        act_order_shard = self.config.desc_act and self.config.group_size != -1 and layer.split == "row"
        self.check_sizes(layer, k if act_order_shard else group_size)
        if k % self.pack:
            raise ValueError(f"input size {k} must be a multiple of {self.pack} for {self.config.bits}-bit rows")
        layer.group_size = group_size
        groups = (layer.full_input_size if act_order_shard else k) // group_size
        layer.qweight = param(torch.empty(k // self.pack, n, dtype=torch.int32))
        layer.qzeros = param(torch.empty(groups, n // self.pack, dtype=torch.int32))
        layer.scales = param(torch.empty(groups, n, dtype=SCALES_DTYPE))
        layer.perm = layer.gather = layer.blocks = None
        if self.config.desc_act:
            # kept on the host: checkpoint tensors arrive there, and the shards of a fused layer are compared
            # with the first one's before the permutation is sent to the weights' device
            layer.g_idx = torch.full((k,), -1, dtype=torch.int32, device="cpu")

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name != "g_idx":
            return super().load(layer, name, tensor, shard)
        tensor, k = materialize(tensor).to("cpu", torch.int32), layer.full_input_size  # the whole layer's: k entries
        if tensor.shape != (k,):
            raise ValueError(f"g_idx of shape {tuple(tensor.shape)} does not fit input size {k}")
        if not self.config.desc_act:
            size = k if self.config.group_size == -1 else self.config.group_size
            if not torch.equal(tensor, _identity_groups(k, size)):
                raise ValueError("g_idx assigns input rows to groups out of order but desc_act is false")
            return
        if layer.split == "row":
            tensor = rank_slice(tensor, 0, layer.input_size, layer.tp.rank, layer.tp.size)
        if bool((layer.g_idx < 0).all()):
            layer.g_idx.copy_(tensor)
        elif not torch.equal(layer.g_idx, tensor):
            # one input permutation per fused layer; shards quantized from the same inputs always agree
            raise ValueError("the shards of a fused layer carry different act-order g_idx")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Act-order: sort input rows by group so that groups are contiguous, as the kernels read them; then, with
        the int8 backend, repack into its block layout."""
        self._sort_groups(layer)
        if self.backend in INT8_BACKENDS:
            c = self.config
            zeros = unpack_cols(layer.qzeros.data, c.bits) + c.zero_offset
            self.repack_for_int8(layer, unpack_rows(layer.qweight.data, c.bits), zeros, c.bits)

    def _sort_groups(self, layer: nn.Module) -> None:
        if not self.config.desc_act:
            return
        g_idx, k, size = layer.g_idx.long(), layer.input_size, layer.group_size  # on the host
        del layer.g_idx
        perm = torch.argsort(g_idx, stable=True)
        device = layer.qweight.device
        if layer.scales.shape[0] * size > k and int(g_idx.min()) >= 0:  # an act-order row shard
            codes = unpack_rows(layer.qweight.data, self.config.bits)[perm.to(device)]
            self._pad_groups(layer, g_idx[perm].to(device), perm.to(device), codes)
            return
        if not torch.equal(g_idx[perm], _identity_groups(k, size).long()):
            raise ValueError(f"g_idx does not put exactly {size} input rows in each group")
        if torch.equal(perm, torch.arange(k)):
            return
        perm = perm.to(device)
        layer.qweight.data = pack_rows(unpack_rows(layer.qweight.data, self.config.bits)[perm], self.config.bits)
        layer.perm = param(perm.to(torch.int32))

    def _pad_groups(self, layer: nn.Module, groups: torch.Tensor, perm: torch.Tensor, codes: torch.Tensor) -> None:
        """An act-order row shard: its rows, sorted by group (`groups`, sorted), hold any number of each group's
        rows. Every group is padded to `group_size` rows that read a zero input (`gather` points them at a
        zero column appended to x), so the kernels see whole groups: exact, at the whole layer's row count."""
        size, num_groups = layer.group_size, layer.scales.shape[0]
        counts = torch.bincount(groups, minlength=num_groups)
        if int(counts.max()) > size or len(counts) > num_groups:
            raise ValueError(f"g_idx puts more than {size} input rows in a group, or names a group past {num_groups}")
        starts = torch.cumsum(counts, 0) - counts
        rows = groups * size + torch.arange(len(groups), device=groups.device) - starts[groups]
        gather = torch.full((num_groups * size,), layer.input_size, dtype=torch.int64, device=perm.device)
        gather[rows] = perm
        padded = torch.zeros(num_groups * size, codes.shape[1], dtype=codes.dtype, device=codes.device)
        padded[rows] = codes
        layer.qweight.data = pack_rows(padded, self.config.bits)
        layer.gather = param(gather)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        x2d = x.reshape(-1, layer.input_size)
        if layer.gather is not None:
            x2d = torch.nn.functional.pad(x2d, (0, 1))[:, layer.gather]
        if layer.blocks is not None:
            y = block_gemm(x2d if layer.perm is None else x2d[:, layer.perm], layer.blocks)
        else:
            y = gptq_gemm(
                x2d, layer.qweight, layer.qzeros, layer.scales, c.bits, c.zero_offset, layer.perm, self.backend
            )
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight `[out, in]` as `apply` multiplies by it (in the scales' dtype, or float32 from the int8
        backend's blocks), input rows in the checkpoint's order."""
        if layer.blocks is not None:
            w = dequantize_blocks(layer.blocks).T
        else:
            w = gptq_dequantize(layer.qweight, layer.qzeros, layer.scales, self.config.bits, self.config.zero_offset)
        if layer.perm is not None:
            w = torch.empty_like(w).index_copy_(0, layer.perm.long(), w)
        return w.T


def _identity_groups(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int32) // group_size
