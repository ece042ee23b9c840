"""Formats whose layers are stored in the block layout of `tiffin.kernels.block_gemm` from each checkpoint shard's
plain rows: compressed-tensors' integer and FP8 weights, block-FP8 checkpoints, and bf16 weights quantized to FP8
at load. A format says which tensors make a shard and how they turn into rows (`BlockRowsLinearMethod.rows`); the
rest (tensor-parallel slicing, staging the shards of a stacked layer, packing) is here.

A shard's rows are unsigned codes `[n, K]` with a scale `d` and an offset `m` a row and block of 32 inputs (`w = q
* d + m`; FP8 codes: `w = e4m3(q) * d`): every scale granularity a format has (per tensor, channel, group of 32k
inputs, 128 x 128 block) is that, repeated. A layer stores nothing until its last shard is complete, then packs
them all at once; a shard's raw tensors are held only until it is complete.
"""

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from tiffin.kernels.block_gemm import BLOCK, FP8, block_gemm, dequantize_blocks, format_gemm, pack_codes, pack_fp8
from tiffin.quant.base import INT8_BACKENDS, LinearMethod, keep_blocks, materialize, rank_slice, return_freed_memory


@dataclass
class Rows:
    """One shard's weight as block rows: codes `[n, K]` (uint8; FP8: e4m3 bit patterns) and per row and block of 32
    `d`, `m` (None for FP8) float32 `[n, K / 32]`."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int
    kind: int = 0
    per_token: bool = False  # W8A8: activations int8 per token (`BlockWeights.per_token`)
    zero_points: bool = False  # W8A8 activations with a zero point a token (`BlockWeights.input_zero_points`)
    input_scale: torch.Tensor | None = None  # FP8: a static activation scale (`BlockWeights.input_scale`)


class BlockRowsLinearMethod(LinearMethod):
    """A layer whose shards each arrive as the checkpoint tensors `needed` (plus `ignored` ones, read and dropped),
    stored in the block layout once every shard is in."""

    needed: tuple[str, ...]
    ignored: tuple[str, ...] = ()

    def __init__(self, backend: str):
        self.backend = backend

    @abstractmethod
    def rows(self, tensors: dict[str, torch.Tensor], k: int) -> Rows:
        """One whole checkpoint shard's rows (`k` its input size) from its tensors `needed`."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if layer.input_size % BLOCK:
            raise ValueError(f"{type(self).__name__[:-12]} layers need input sizes that are multiples of {BLOCK}, "
                             f"got {layer.input_size}")  # fmt: skip
        layer.blocks, layer.weight_device = None, torch.empty(0).device  # the model is built under its device
        layer.pending = [{} for _ in layer.output_sizes]
        layer.shard_rows = [None] * len(layer.output_sizes)

    def load(self, layer: nn.Module, name: str, tensor, shard: int | None) -> None:
        if name in self.ignored:
            return
        if name not in self.needed:
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to a {type(self).__name__[:-12]} layer (expected "
                f"{sorted(self.needed)}); the checkpoint and its quantization config disagree about this layer"
            )
        shard = shard or 0
        pending = layer.pending[shard]
        pending[name] = materialize(tensor)
        if pending.keys() == set(self.needed):
            layer.shard_rows[shard] = self._local(layer, shard, self.rows(pending, layer.full_input_size))
            layer.pending[shard] = {}
        if all(rows is not None for rows in layer.shard_rows):
            self._store(layer)

    def _local(self, layer: nn.Module, shard: int, rows: Rows) -> Rows:
        """This rank's part of a shard's rows: its outputs (column-parallel) or its inputs (row-parallel)."""
        if layer.split is None:
            return rows
        dim, local = (0, layer.output_sizes[shard]) if layer.split == "column" else (1, layer.input_size)
        tp = layer.tp
        part = lambda t, size: None if t is None else rank_slice(t, dim, size, tp.rank, tp.size).contiguous()
        factors = local if dim == 0 else local // BLOCK
        return dataclasses.replace(
            rows, codes=part(rows.codes, local), d=part(rows.d, factors), m=part(rows.m, factors)
        )

    def _store(self, layer: nn.Module) -> None:
        shards, layer.shard_rows = layer.shard_rows, []
        cat = lambda name: (
            torch.cat([getattr(s, name) for s in shards]) if len(shards) > 1 else getattr(shards[0], name)
        )
        codes, d, first = cat("codes"), cat("d"), shards[0]
        if first.kind == FP8:
            blocks = pack_fp8(codes, d)
            if first.input_scale is not None:  # the shards' input is one: the largest scale covers each
                blocks.input_scale = torch.stack([s.input_scale.float().reshape(()) for s in shards]).amax().view(1)
        else:
            levels = INT8_BACKENDS.get(self.backend, 1)
            blocks = pack_codes(codes, d, cat("m"), first.bits, levels, first.per_token)
            blocks.input_zero_points = first.zero_points
        keep_blocks(layer, blocks.to(layer.weight_device), ())
        return_freed_memory()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.blocks is None:
            missing = [i for i, rows in enumerate(layer.shard_rows) if rows is None]
            raise ValueError(f"the checkpoint lacks tensors of shard(s) {missing} of a quantized layer (each needs "
                             f"{sorted(self.needed)})")  # fmt: skip
        del layer.pending

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, layer.input_size)
        if self.backend in INT8_BACKENDS:
            y = block_gemm(x2, layer.blocks)
        else:  # on GPUs W8A8 and FP8 quantize activations (`format_gemm`), the rest decode the weight to x's dtype
            y = format_gemm(x2, layer.blocks, self.backend)
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight `[out, in]` in float32, as the kernels' exact path multiplies by it."""
        return dequantize_blocks(layer.blocks)


def per_block(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None = None) -> torch.Tensor:
    """A scale of any granularity as float32 per row and block of 32 inputs `[n, k / 32]`: a scalar or `[1]` (per
    tensor), `[n, 1]` (per channel), `[n, groups]` (groups of k / groups inputs, a multiple of 32), or with `block`
    (rows, inputs) one per weight block `[ceil(n / rows), ceil(k / inputs)]`, inputs a multiple of 32."""
    scale = scale.float()
    if block is not None:
        rows, inputs = block
        if inputs % BLOCK or tuple(scale.shape) != (-(-n // rows), -(-k // inputs)):
            raise ValueError(f"block scales of shape {tuple(scale.shape)} do not fit a [{n}, {k}] weight in blocks "
                             f"of {list(block)} (inputs a multiple of {BLOCK})")  # fmt: skip
        return scale.repeat_interleave(rows, 0)[:n].repeat_interleave(inputs // BLOCK, 1)[:, : k // BLOCK].contiguous()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, k // BLOCK).contiguous()
    groups = scale.shape[-1] if scale.dim() == 2 else 0
    if scale.shape[0] != n or not groups or k % groups or (k // groups) % BLOCK:
        raise ValueError(f"scales of shape {tuple(scale.shape)} do not fit a [{n}, {k}] weight: per tensor, per "
                         f"channel or per group of a multiple of {BLOCK} inputs")  # fmt: skip
    return scale.repeat_interleave(k // groups // BLOCK, 1).contiguous()
