"""compressed-tensors checkpoints (what llm-compressor writes): integer weights of 4 or 8 bits (`pack-quantized`
W4A16 / W8A16, `int-quantized` / `naive-quantized` W8A8) and FP8 weights (`float-quantized`), symmetric or with
zero points, scales per tensor, channel, group or 128 x 128 block, all stored in the block layout
(`tiffin.quant.block_rows`).

Activations: an integer W8A8 checkpoint whose weights have one scale a row (channel or tensor strategy, symmetric)
has its activations quantized to int8 per token, dynamically, as the format means them (a static per-tensor
`input_scale` is not read: per token is finer), from `cpu_native.w8a8_min_rows()` rows on, in `native` and `int8`
alike (`BlockWeights.per_token`: the W8A8 GEMM, AMX-INT8 tiles where the CPU has them); fewer rows, and other
integer W8A8 weights (groups, zero points), take the int8 kernels per block of 32 inputs (15 bits with `native`,
8 with `int8`). On CUDA (`block_gemm.format_gemm`) W8A8
activations are int8 per token at every size, with a zero point a token where the checkpoint's activations are
asymmetric. An FP8 checkpoint's activations stay in the model's dtype on CPUs (weight-only FP8: no FP8 arithmetic)
and GPUs before sm_89 (the Triton GEMM decodes the weight); from sm_89 they are e4m3, per token or, where the
checkpoint's are static, of its `input_scale` (the largest of a fused layer's shards').

Dequantization follows compressed-tensors' `dequantize`: `w = (q - z) * s`. The blocks hold integer weights' scales
in fp16: for symmetric weights with bf16 or fp16 scales (llm-compressor writes them in the model's dtype) they give
that weight bit for bit; a zero point's `-z * s` is held in fp16 (as AWQ's are), and so are fp32 scales (2^-12 of
relative rounding, which the load logs). FP8 weights keep their scales in fp32.
"""

import functools
import logging
import re
from dataclasses import dataclass

import torch

from tiffin.kernels.block_gemm import FP8
from tiffin.quant.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    refuse,
    register_quant_config,
)
from tiffin.quant.block_rows import BlockRowsLinearMethod, Rows, per_block

logger = logging.getLogger(__name__)

FORMATS = {  # compressed-tensors format -> (weight type, bits) it stores
    "pack-quantized": ("int", (4, 8)),
    "int-quantized": ("int", (8,)),
    "naive-quantized": ("int", (8,)),
    "float-quantized": ("float", (8,)),
}
STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class WeightScheme:
    format: str
    type: str
    bits: int
    symmetric: bool
    strategy: str
    block: tuple[int, int] | None
    int8_activations: bool = False  # input_activations int8 (W8A8)
    static_activations: bool = False  # FP8 activations of a checkpoint's `input_scale` (not dynamic)
    activation_zero_points: bool = False  # W8A8 activations asymmetric: a zero point a token

    @property
    def per_token(self) -> bool:
        """Whether the layers run on int8 activations per token (`BlockWeights.per_token`): W8A8 whose weights'
        blocks all hold a row's scale and m = -128 d."""
        return (self.int8_activations and self.type == "int" and self.bits == 8 and self.symmetric
                and self.strategy in ("channel", "tensor"))  # fmt: skip

    @classmethod
    def parse(cls, group: dict, default_format: str | None, source: str) -> "WeightScheme":
        w, acts = group.get("weights") or {}, group.get("input_activations")
        fmt = group.get("format") or default_format
        int8_acts = bool(acts) and acts.get("type", "int") == "int" and acts.get("num_bits") == 8
        static = bool(acts) and acts.get("type") == "float" and acts.get("dynamic") is False
        zero_points = int8_acts and acts.get("symmetric") is False
        scheme = cls(fmt, w.get("type", "int"), w.get("num_bits"), w.get("symmetric", True), w.get("strategy"),
                     tuple(w["block_structure"]) if w.get("block_structure") else None, int8_acts, static,
                     zero_points)  # fmt: skip
        problems = []
        if fmt not in FORMATS:
            problems.append(f"format {fmt!r}")
        elif (scheme.type, scheme.bits) not in [(FORMATS[fmt][0], b) for b in FORMATS[fmt][1]]:
            problems.append(f"{scheme.bits}-bit {scheme.type} weights in format {fmt!r}")
        if scheme.strategy not in STRATEGIES:
            problems.append(f"weight strategy {scheme.strategy!r}")
        if scheme.type == "float" and not scheme.symmetric:
            problems.append("asymmetric FP8 weights")
        if w.get("actorder") == "group":
            problems.append("activation-ordered groups (actorder 'group': a g_idx per layer)")
        if w.get("dynamic"):
            problems.append("dynamic weight scales")
        if group.get("output_activations"):
            problems.append("quantized output activations")
        if acts and (acts.get("num_bits") != 8 or acts.get("type", "int") != scheme.type):
            problems.append(f"{acts.get('num_bits')}-bit {acts.get('type')} activations beside {scheme.type} weights")
        refuse(source, "compressed-tensors", problems)
        return scheme


@register_quant_config
@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme) in the config's order
    ignore: tuple[str, ...]

    name = "compressed-tensors"
    description = (
        "compressed-tensors (pack-quantized 4/8-bit and int-quantized 8-bit integer weights, symmetric or with zero "
        "points, per channel or group; float-quantized FP8 weights per tensor, channel or block)"
    )

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "CompressedTensorsConfig":
        problems = [key for key in ("sparsity_config", "transform_config", "kv_cache_scheme") if settings.get(key)]
        refuse(source, "compressed-tensors", problems)
        groups = tuple(
            (tuple(group.get("targets") or ["Linear"]), WeightScheme.parse(group, settings.get("format"), source))
            for group in (settings.get("config_groups") or {}).values()
        )
        return cls(groups, tuple(settings.get("ignore") or ()))

    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        if any(_matches(pattern, prefix) for pattern in self.ignore):
            return UnquantizedLinearMethod()
        for targets, scheme in self.groups:
            if any(target == "Linear" or _matches(target, prefix) for target in targets):
                return CompressedTensorsLinearMethod(scheme, backend)
        return UnquantizedLinearMethod()

    def layer_method(self, names: list[str], backend: str) -> LinearMethod:
        methods = [self.linear_method(name, backend) for name in names]
        if len({getattr(method, "scheme", None) for method in methods}) > 1:
            raise ValueError(f"the quantization config stores {names} in different schemes; a fused layer takes one")
        return methods[0]


def _matches(pattern: str, prefix: str) -> bool:
    """compressed-tensors' targets and ignores: `re:<regex>` matched against the module's name, else the name or
    its last part."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return pattern in (prefix, prefix.rsplit(".", 1)[-1])


class CompressedTensorsLinearMethod(BlockRowsLinearMethod):
    def __init__(self, scheme: WeightScheme, backend: str):
        super().__init__(backend)
        self.scheme = scheme
        weight = "weight_packed" if scheme.format == "pack-quantized" else "weight"
        zero = () if scheme.symmetric else ("weight_zero_point",)
        static = ("input_scale",) if scheme.static_activations else ()
        self.needed = (weight, "weight_scale", *zero, *static)
        self.ignored = ("weight_shape", "input_zero_point", *(("input_scale",) if not static else ()))

    def rows(self, tensors: dict[str, torch.Tensor], k: int) -> Rows:
        s = self.scheme
        if s.format == "pack-quantized":  # stored unsigned: the signed code + 2^(bits - 1)
            codes = unpack(tensors["weight_packed"], s.bits, k)
        else:
            codes = tensors["weight"]
        n = codes.shape[0]
        if codes.shape != (n, k):
            raise ValueError(f"a quantized weight of shape {tuple(codes.shape)} does not fit the layer's {k} inputs")
        d = per_block(tensors["weight_scale"], n, k, s.block if s.strategy == "block" else None)
        if s.type == "float":
            return Rows(codes.view(torch.uint8), d, None, 8, FP8, input_scale=tensors.get("input_scale"))
        _check_fp16(tensors["weight_scale"])
        if s.format != "pack-quantized":  # int8 codes, unsigned as the blocks hold them
            codes = (codes.to(torch.int16) + 128).to(torch.uint8)
        middle = 1 << (s.bits - 1)
        if s.per_token:  # m = -128 d of d as the blocks hold it (fp16), exactly: what the W8A8 GEMM assumes
            m = -middle * d.to(torch.float16).float()
            return Rows(codes.to(torch.uint8), d, m, s.bits, per_token=True, zero_points=s.activation_zero_points)
        if s.symmetric:
            zero = torch.full_like(d, middle)
        else:
            zero = tensors["weight_zero_point"]
            if s.format == "pack-quantized":
                zero = unpack(zero.T, s.bits, n).T
            zero = per_block(zero.to(torch.int32) + (0 if s.format == "pack-quantized" else middle), n, k)
        return Rows(codes.to(torch.uint8), d, -zero * d, s.bits)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words `[rows, words]` holding `32 / bits` unsigned values each (the first in the low bits) ->
    `[rows, count]` int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[:, :count]


def _check_fp16(scale: torch.Tensor) -> None:
    """Integer weights' scales are held in fp16: say so (once) where that rounds them."""
    held = scale.to(torch.float16).float()
    if not torch.equal(held, scale.float()):
        small = bool(((held != scale.float()) & (scale.abs() < 2**-14)).any())
        _warn_once(f"{scale.dtype} weight scales are held in fp16, rounded" + (" (some below fp16's normal range "
                   "2^-14, losing more precision)" if small else " to 2^-12 of their size"))  # fmt: skip


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)
