"""Linear methods for AWQ and GPTQ layers: create the packed tensors, load checkpoint shards into them as
stored, repack act-order rows after loading, apply through `awq_gemm` / `gptq_gemm`.

They fill the engine's `LinearMethod` protocol (create_weights / load / process_weights_after_loading /
apply) without importing the engine: a layer is anything with `input_size`, `output_sizes`, `offsets`.
Packed outputs are stacked along dim 1 of every tensor, so a fused layer (qkv, gate_up) is its checkpoint
shards side by side; each shard's width must be a whole number of packed words.

Scales are held in fp16, the dtype both AutoAWQ and GPTQModel write them in; the dequantized weight is
computed in it, as the tools do, then cast to the activations' dtype.
"""

import torch
from torch import nn

from tiffin.kernels.dispatch import resolve_backend
from tiffin.kernels.quant import awq_dequantize, awq_gemm, gptq_dequantize, gptq_gemm, pack_rows, unpack_rows
from tiffin.quant.config import AWQConfig, GPTQConfig

SCALES_DTYPE = torch.float16


class _QuantLinearMethod:
    pack: int  # output columns per int32 word of qzeros
    tensors: dict[str, int]  # checkpoint tensor -> output columns per element along dim 1

    def __init__(self, kernel_backend: str = "auto"):
        self.kernel_backend = kernel_backend
        self._backend: str | None = None

    def load(self, layer, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name not in self.tensors:
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to a {type(self).__name__[:4]} layer "
                f"(expected {sorted(self.tensors)}); the checkpoint and its quantization config "
                f"disagree about this layer"
            )
        _load_shard(layer, getattr(layer, name), tensor, shard, self.tensors[name])

    def process_weights_after_loading(self, layer) -> None:
        pass

    def backend(self, device: torch.device) -> str:
        if self._backend is None:
            self._backend = resolve_backend(self.kernel_backend, device)
        return self._backend

    def _check_sizes(self, layer, group_size: int) -> None:
        if layer.input_size % group_size:
            raise ValueError(f"group size {group_size} does not divide the layer's input size {layer.input_size}")
        if any(size % self.pack for size in layer.output_sizes):
            raise ValueError(f"output sizes {layer.output_sizes} must be multiples of {self.pack} for packed zeros")


class AWQLinearMethod(_QuantLinearMethod):
    pack = 8
    tensors = {"qweight": 8, "qzeros": 8, "scales": 1}

    def __init__(self, config: AWQConfig, kernel_backend: str = "auto"):
        super().__init__(kernel_backend)
        self.group_size = config.group_size

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        self._check_sizes(layer, self.group_size)
        k, n, groups = layer.input_size, layer.output_size, layer.input_size // self.group_size
        layer.qweight = _param(torch.empty(k, n // 8, dtype=torch.int32))
        layer.qzeros = _param(torch.empty(groups, n // 8, dtype=torch.int32))
        layer.scales = _param(torch.empty(groups, n, dtype=SCALES_DTYPE))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        y = awq_gemm(x.reshape(-1, layer.input_size), layer.qweight, layer.qzeros, layer.scales, self.backend(x.device))
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer) -> torch.Tensor:
        """The layer's weight `[out, in]` in the scales' dtype (what `apply` multiplies by)."""
        return awq_dequantize(layer.qweight, layer.qzeros, layer.scales).T


class GPTQLinearMethod(_QuantLinearMethod):
    def __init__(self, config: GPTQConfig, kernel_backend: str = "auto"):
        super().__init__(kernel_backend)
        self.config = config
        self.pack = 32 // config.bits
        self.tensors = {"qweight": 1, "qzeros": self.pack, "scales": 1, "g_idx": 0}

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        k, n = layer.input_size, layer.output_size
        group_size = k if self.config.group_size == -1 else self.config.group_size
        self._check_sizes(layer, group_size)
        if k % self.pack:
            raise ValueError(f"input size {k} must be a multiple of {self.pack} for {self.config.bits}-bit rows")
        layer.group_size = group_size
        layer.qweight = _param(torch.empty(k // self.pack, n, dtype=torch.int32))
        layer.qzeros = _param(torch.empty(k // group_size, n // self.pack, dtype=torch.int32))
        layer.scales = _param(torch.empty(k // group_size, n, dtype=SCALES_DTYPE))
        layer.perm = None
        if self.config.desc_act:
            layer.g_idx = _param(torch.full((k,), -1, dtype=torch.int32))

    def load(self, layer, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name != "g_idx":
            return super().load(layer, name, tensor, shard)
        if tensor.shape != (layer.input_size,):
            raise ValueError(f"g_idx of shape {tuple(tensor.shape)} does not fit input size {layer.input_size}")
        tensor = tensor.to(torch.int32)
        if not self.config.desc_act:
            if not torch.equal(tensor, _identity_groups(layer.input_size, layer.group_size, tensor.device)):
                raise ValueError("g_idx assigns input rows to groups out of order but desc_act is false")
        elif bool((layer.g_idx < 0).all()):
            layer.g_idx.copy_(tensor)
        elif not torch.equal(layer.g_idx, tensor):
            # one input permutation per fused layer; shards quantized from the same inputs always agree
            raise ValueError("the shards of a fused layer carry different act-order g_idx")

    def process_weights_after_loading(self, layer) -> None:
        """Act-order: sort input rows by group so that groups are contiguous, as the kernels read them."""
        if not self.config.desc_act:
            return
        g_idx = layer.g_idx.data.long()
        del layer.g_idx
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], _identity_groups(layer.input_size, layer.group_size, perm.device).long()):
            raise ValueError(f"g_idx does not put exactly {layer.group_size} input rows in each group")
        if torch.equal(perm, torch.arange(layer.input_size, device=perm.device)):
            return
        layer.qweight.data = pack_rows(unpack_rows(layer.qweight.data, self.config.bits)[perm], self.config.bits)
        layer.perm = _param(perm.to(torch.int32))

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        y = gptq_gemm(
            x.reshape(-1, layer.input_size),
            layer.qweight,
            layer.qzeros,
            layer.scales,
            c.bits,
            c.zero_offset,
            layer.perm,
            self.backend(x.device),
        )
        return y.view(*x.shape[:-1], layer.output_size)

    def dequantize(self, layer) -> torch.Tensor:
        """The layer's weight `[out, in]` in the scales' dtype, input rows in the checkpoint's order."""
        w = gptq_dequantize(layer.qweight, layer.qzeros, layer.scales, self.config.bits, self.config.zero_offset)
        if layer.perm is not None:
            w = torch.empty_like(w).index_copy_(0, layer.perm.long(), w)
        return w.T


def _identity_groups(k: int, group_size: int, device) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int32, device=device) // group_size


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _load_shard(layer, param: torch.Tensor, tensor: torch.Tensor, shard: int | None, pack: int) -> None:
    """Copy `tensor` into shard `shard`'s columns of `param` (dim 1, `pack` outputs per element)."""
    target = param.data
    if shard is not None:
        target = target.narrow(1, layer.offsets[shard] // pack, layer.output_sizes[shard] // pack)
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
    if target.dtype == torch.int32 and tensor.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {tensor.dtype}")
    target.copy_(tensor)
