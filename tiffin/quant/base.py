"""What a quantization format plugs into: the `LinearMethod` contract a linear layer delegates its weight to
(plain: `UnquantizedLinearMethod`), the one shard loader every method fills its tensors with, and the
registry of formats that reads a checkpoint's quantization (`get_quant_config`).

Which quantization a checkpoint uses is read from `config.json`'s `quantization_config` or, for older
checkpoints, a format's own side file (`quantize_config.json` for AutoGPTQ, `quant_config.json` for
AutoAWQ). Anything tiffin cannot run exactly as published is refused here, before any weight is read, with
the variant named.
"""

import ctypes
import functools
import json
import logging
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from tiffin.kernels.block_gemm import BLOCK, BlockWeights, StackedBlocks, from_groups, parts

logger = logging.getLogger(__name__)


class LinearMethod(ABC):
    """How one linear layer's weight is stored, loaded and applied. The layer is anything with `input_size`,
    `output_size`, and `output_sizes` / `offsets` of the checkpoint shards stacked along its output (q/k/v
    into qkv_proj); methods never import the engine."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None: ...

    @abstractmethod
    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack once every shard is in (e.g. act-order rows sorted by group)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight `[out, in]`, for a layer that is a token embedding (formats that store
        embeddings: see `QuantizationConfig.embedding_method`)."""
        raise NotImplementedError(f"{type(self).__name__} does not store token embeddings")


class UnquantizedLinearMethod(LinearMethod):
    """Plain weight `[out, in]` in the model dtype."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.weight = param(torch.empty(layer.output_size, layer.input_size, dtype=dtype))
        layer.packed_weight = None

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        load_shard(layer, getattr(layer, name), tensor, shard, dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CPU, a weight whose GEMMs run through oneDNN (`prepacks_for_onednn`) is reordered once into
        oneDNN's blocked layout, which a plain weight is reordered into on every call. A layer that looks rows up
        (an embedding) keeps the plain weight besides. An fp32 weight left to MKL's sgemm is stored column-major,
        so that `x @ W^T` needs no transpose (figures for both: benchmarks/README.md)."""
        w = layer.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return
        if prepacks_for_onednn(w.dtype):
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.data, None)
            if not layer.looks_up_rows:
                w.data = torch.empty(0, dtype=w.dtype)
        elif w.dtype == torch.float32:
            w.data = w.data.t().contiguous().t()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        return torch.nn.functional.linear(x, layer.weight)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, layer.weight)


def prepacks_for_onednn(dtype: torch.dtype) -> bool:
    """Whether plain CPU linears of `dtype` (bf16 or fp32) run through oneDNN, with weights prepacked at load.
    bf16: where oneDNN supports it. fp32: whichever of oneDNN and MKL's sgemm is faster on this CPU, timed once
    (`_onednn_sgemm_faster`), since the winner differs by CPU maker (MKL takes slower code paths on non-Intel
    CPUs). TIFFIN_CPU_FP32_GEMM=onednn|mkl overrides."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    choice = os.environ.get("TIFFIN_CPU_FP32_GEMM", "auto")
    if choice != "auto":
        return choice == "onednn"
    return torch.backends.mkldnn.is_available() and _onednn_sgemm_faster()


@functools.cache
def _onednn_sgemm_faster(rows: int = 16, size: int = 1024, calls: int = 15) -> bool:
    """Times a decode-sized fp32 GEMM (`rows` x `size` by `size` x `size`) both ways, alternating, and keeps
    oneDNN only when its median is at least 10% lower: ~20 ms once per process."""
    gen = torch.Generator().manual_seed(0)  # not torch's global generator: loading a model leaves it alone
    w = torch.randn(size, size, generator=gen) / size**0.5
    x = torch.randn(rows, size, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    column_major = w.t().contiguous().t()
    runs = {
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "mkl": lambda: torch.nn.functional.linear(x, column_major),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(calls):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: sorted(t)[calls // 2] for name, t in times.items()}
    faster = median["onednn"] < 0.9 * median["mkl"]
    logger.info(
        "fp32 linears on CPU: %s (a %dx%d GEMM took %.0f us on oneDNN, %.0f us on MKL; TIFFIN_CPU_FP32_GEMM picks one)",
        "oneDNN" if faster else "MKL",
        rows,
        size,
        median["onednn"] * 1e6,
        median["mkl"] * 1e6,
    )
    return faster


# AutoAWQ and GPTQModel both write scales in fp16; the weight is dequantized in it, as the tools do, then
# cast to the activations' dtype.
SCALES_DTYPE = torch.float16
# The kernel backends of quantized layers on CPU (`cpu_quant_compute` "native" or "int8"): native kernels against
# the weights in `tiffin.kernels.block_gemm`'s block layout, repacked once at load, on activations quantized to two
# levels of int8 codes (15 bits; bf16 dot products for prompt-sized inputs) or one. Backend -> activation levels.
INT8_BACKENDS = {"native": 2, "int8": 1}


def keep_blocks(
    layer: nn.Module, blocks: BlockWeights | StackedBlocks | None, checkpoint_tensors: tuple[str, ...]
) -> None:
    """Make `blocks` the layer's weight and drop the checkpoint's tensors, which the int8 kernels never read;
    `layer.blocks` stays None where the layer cannot take the block layout (it keeps its exact path)."""
    layer.blocks = blocks
    if blocks is None:
        return
    for i, part in enumerate(parts(blocks)):  # parameters: counted in the model's weight bytes
        suffix = str(i) if i else ""
        for name in ("codes", "scales", "offsets"):
            setattr(layer, f"block_{name}{suffix}", param(getattr(part, name)))
    for name in checkpoint_tensors:
        delattr(layer, name)


class PackedLinearMethod(LinearMethod):
    """Integer weights packed into int32 words along the output (AWQ, GPTQ): every checkpoint tensor is stacked
    along dim 1, so a fused layer is its shards side by side; each shard must be a whole number of words."""

    pack: int  # output columns per int32 word of qzeros
    tensors: dict[str, int]  # checkpoint tensor -> output columns per element along dim 1

    def __init__(self, backend: str):
        self.backend = backend

    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        if name not in self.tensors:
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to a {type(self).__name__.removesuffix('LinearMethod')} "
                f"layer (expected {sorted(self.tensors)}); the checkpoint and its quantization config disagree "
                f"about this layer"
            )
        load_shard(layer, getattr(layer, name), tensor, shard, dim=1, pack=self.tensors[name])

    def repack_for_int8(self, layer: nn.Module, codes: torch.Tensor, zeros: torch.Tensor, bits: int) -> None:
        """With the int8 backend, the weight in the block layout (`from_groups`: codes `[K, N]`, integer zeros and
        the layer's scales `[groups, N]`), where whole blocks fit: K and the group size multiples of 32."""
        k, groups = codes.shape[0], layer.scales.shape[0]
        fits = k % BLOCK == 0 and k // groups % BLOCK == 0
        blocks = from_groups(codes, zeros, layer.scales.data, bits, INT8_BACKENDS[self.backend]) if fits else None
        keep_blocks(layer, blocks, ("qweight", "qzeros", "scales"))

    def check_sizes(self, layer: nn.Module, group_size: int) -> None:
        """Packed shards split on group and word boundaries only: refused here, naming the shape, otherwise."""
        ranks = getattr(layer, "tp", None)
        per_rank = f" per rank (tensor_parallel_size {ranks.size})" if ranks is not None and ranks.size > 1 else ""
        if layer.input_size % group_size:
            raise ValueError(
                f"group size {group_size} does not divide the layer's input size {layer.input_size}{per_rank}"
            )
        if any(size % self.pack for size in layer.output_sizes):
            raise ValueError(
                f"output sizes {layer.output_sizes}{per_rank} must be multiples of {self.pack} for packed zeros"
            )


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc keeps them): a weight converted at load leaves its
    transients' holes between the weights stored before it, ~90 MiB over a 1.5B GGUF's layers, where trimming
    after each layer costs ~1 ms."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def load_shard(layer: nn.Module, target: torch.Tensor, tensor, shard: int | None, dim: int, pack: int = 1) -> None:
    """Copy `tensor` into `target`, or into shard `shard`'s slice of the output dimension `dim` when the layer
    stacks several checkpoint tensors (`pack` outputs per element, as packed integer words hold them).
    `tensor` may be a lazy safetensors slice: of a tensor-parallel layer (`layer.split`) only this rank's part
    is read, along the output `dim` ("column") or the input, the other dim of a 2-D tensor ("row")."""
    target = target.data
    if shard is not None:
        target = target.narrow(dim, layer.offsets[shard] // pack, layer.output_sizes[shard] // pack)
    split = getattr(layer, "split", None)
    if split == "column" or (split == "row" and len(shape_of(tensor)) == 2):
        along = dim if split == "column" else 1 - dim
        tensor = rank_slice(tensor, along, target.shape[along], layer.tp.rank, layer.tp.size)
    tensor = materialize(tensor)
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
    if target.dtype == torch.int32 and tensor.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {tensor.dtype}")
    target.copy_(tensor)


def rank_slice(tensor, dim: int, local: int, rank: int, size: int):
    """Rank `rank`'s `local` entries along `dim` of a checkpoint tensor split across `size` ranks: the whole
    tensor when it is that size already (replicated: per-channel scales of a row shard), else slice
    `rank // replicas` of its `full / local` slices, each held by `replicas` consecutive ranks (MQA/GQA KV
    heads). Reads only that slice of a lazy safetensors slice."""
    full = shape_of(tensor)[dim]
    if full == local or size == 1:
        return tensor
    if full % local or size % (full // local):
        raise ValueError(
            f"a checkpoint tensor of shape {shape_of(tensor)} cannot split into pieces of {local} along dim {dim} "
            f"across {size} tensor-parallel ranks"
        )
    start = rank // (size // (full // local)) * local
    index = [slice(None)] * len(shape_of(tensor))
    index[dim] = slice(start, start + local)
    return tensor[tuple(index)]


def shape_of(tensor) -> tuple[int, ...]:
    """The shape of a tensor or of a lazy safetensors slice."""
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def materialize(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantizationConfig(ABC):
    """One quantization format: parsed from the checkpoint's settings, it picks each layer's `LinearMethod`."""

    name: ClassVar[str]  # `quant_method` in config.json
    description: ClassVar[str]  # the variants served, named in every refusal
    side_file: ClassVar[str | None] = None  # older tools' settings file beside config.json

    @classmethod
    @abstractmethod
    def from_config(cls, settings: dict, source: str) -> "QuantizationConfig":
        """The config for `settings` (read from `source`); ValueError naming any variant tiffin cannot run."""

    @abstractmethod
    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        """How to store the checkpoint's linear layer `prefix` (e.g. `model.layers.0.self_attn.q_proj`), run
        with the resolved kernel `backend`."""

    def layer_method(self, names: list[str], backend: str) -> LinearMethod:
        """How to store a layer stacking the checkpoint's layers `names` (q/k/v_proj into qkv_proj; one name for a
        layer of its own): by default each must be stored alike, since one tensor cannot be part plain, part
        quantized."""
        methods = [self.linear_method(name, backend) for name in names]
        if len({type(method) for method in methods}) > 1:
            raise ValueError(
                f"the quantization config leaves only some of {names} unquantized; the fused layer must be all one "
                f"or the other"
            )
        return methods[0]

    @classmethod
    def at_load(cls) -> "QuantizationConfig":
        """The config that quantizes a plain checkpoint as it loads (`quantization=<name>`), where the format can."""
        raise ValueError(f"quantization={cls.name!r} applies to checkpoints quantized with it; this one is not")

    def embedding_method(self, prefix: str, backend: str) -> LinearMethod:
        """How to store the token embedding or output head `prefix` (`model.embed_tokens`, `lm_head`): plain,
        unless the format keeps them quantized."""
        return UnquantizedLinearMethod()


QUANT_CONFIGS: dict[str, type[QuantizationConfig]] = {}


def register_quant_config(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
    QUANT_CONFIGS[cls.name] = cls
    return cls


def supported() -> str:
    return " and ".join(cls.description for cls in QUANT_CONFIGS.values())


def refuse(source: str, fmt: str, problems: list[str]) -> None:
    """ValueError naming every variant of `fmt` in `problems` that tiffin cannot run, if any."""
    if problems:
        raise ValueError(f"{source}: {fmt} with {', '.join(problems)} is not supported; tiffin serves {supported()}")


def get_quant_config(
    model_dir: str | Path, raw_config: dict | None = None, quantization: str | None = None
) -> QuantizationConfig | None:
    """The checkpoint's quantization, or None for a plain checkpoint; ValueError for an unsupported one.
    `quantization` (vLLM's setting) names the format wanted: the checkpoint's own, or one a plain checkpoint is
    quantized into as it loads (`QuantizationConfig.at_load`)."""
    model_dir = Path(model_dir)
    if raw_config is None:
        raw_config = json.loads((model_dir / "config.json").read_text())
    if quantization is not None and quantization not in QUANT_CONFIGS:
        raise ValueError(f"quantization {quantization!r} is not supported; tiffin serves {supported()}")
    found = _find(model_dir, raw_config)
    if found is None:
        return None if quantization is None else QUANT_CONFIGS[quantization].at_load()
    source, default_method, settings = found
    method = str(settings.get("quant_method") or default_method).lower()
    if method not in QUANT_CONFIGS:
        raise ValueError(f"{source}: quantization method {method!r} is not supported; tiffin serves {supported()}")
    if quantization not in (None, method):
        raise ValueError(f"quantization={quantization!r}, but the checkpoint is quantized with {method!r} ({source})")
    return QUANT_CONFIGS[method].from_config(settings, source)


def _find(model_dir: Path, raw: dict) -> tuple[str, str, dict] | None:
    if raw.get("quantization_config") is not None:
        return "config.json quantization_config", "", raw["quantization_config"]
    for cls in QUANT_CONFIGS.values():
        if cls.side_file and (model_dir / cls.side_file).exists():
            return cls.side_file, cls.name, json.loads((model_dir / cls.side_file).read_text())
    return None
