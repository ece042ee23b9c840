"""FP8 weights (e4m3): checkpoints whose `quant_method` is `fp8` (DeepSeek-V3 / Qwen3-FP8: `weight_block_size`
[128, 128] with a `weight_scale_inv` a block; without it, a `weight_scale` a tensor), and bf16 / fp16 / fp32
checkpoints quantized as they load (`quantization="fp8"`: a scale per output channel, `quantize_rows`). Stored in
the block layout's FP8 kind (`tiffin.quant.block_rows`); activations stay in the model's dtype on CPUs and GPUs before
sm_89 (weight-only FP8), and from sm_89 are e4m3 per token, or of the checkpoint's `input_scale` where its
`activation_scheme` is static (as `tiffin.quant.compressed_tensors` explains).
"""

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

E4M3_MAX = 448.0


@register_quant_config
@dataclass(frozen=True)
class FP8Config(QuantizationConfig):
    block: tuple[int, int] | None  # (rows, inputs) a weight scale covers; None: one scale a tensor
    ignore: tuple[str, ...]  # modules left unquantized: any whose name contains one of these
    online: bool = False  # quantize a plain checkpoint's weights as they load, a scale per output channel
    static: bool = False  # activation_scheme "static": an `input_scale` a layer (GPUs from sm_89 read it)

    name = "fp8"
    description = (
        "FP8 (e4m3 checkpoints with 128 x 128 block scales or a scale a tensor, and quantization='fp8' turning a "
        "bf16 / fp16 / fp32 checkpoint's linears into FP8 at load, a scale per output channel)"
    )

    @classmethod
    def from_config(cls, settings: dict, source: str) -> "FP8Config":
        fmt, block = str(settings.get("fmt", "e4m3")).lower(), settings.get("weight_block_size")
        problems = [f"format {fmt!r}"] if fmt != "e4m3" else []
        if block is not None and (len(block) != 2 or block[1] % 32):
            problems.append(f"weight blocks of {block}")
        refuse(source, "FP8", problems)
        ignore = settings.get("modules_to_not_convert") or settings.get("ignored_layers") or ()
        static = str(settings.get("activation_scheme", "dynamic")).lower() == "static"
        return cls(tuple(block) if block else None, tuple(ignore), static=static)

    @classmethod
    def at_load(cls) -> "FP8Config":
        return cls(None, (), online=True)

    def linear_method(self, prefix: str, backend: str) -> LinearMethod:
        if any(name in prefix for name in self.ignore):
            return UnquantizedLinearMethod()
        return FP8LinearMethod(self, backend)


class FP8LinearMethod(BlockRowsLinearMethod):
    def __init__(self, config: FP8Config, backend: str):
        super().__init__(backend)
        self.config = config
        if config.online:
            self.needed = ("weight",)
        else:
            self.needed = ("weight", "weight_scale_inv" if config.block else "weight_scale")
            if config.static:
                self.needed += ("input_scale",)
            else:
                self.ignored = ("input_scale",)

    def rows(self, tensors: dict[str, torch.Tensor], k: int) -> Rows:
        weight = tensors["weight"]
        if self.config.online:
            weight, scale = quantize_rows(weight)
        else:
            scale = tensors["weight_scale_inv" if self.config.block else "weight_scale"]
        if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k:
            raise ValueError(f"an FP8 layer takes a float8_e4m3fn weight of {k} inputs, got {weight.dtype} "
                             f"{list(weight.shape)}")  # fmt: skip
        d = per_block(scale, weight.shape[0], k, self.config.block)
        return Rows(weight.view(torch.uint8), d, None, 8, FP8, input_scale=tensors.get("input_scale"))


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` as e4m3 codes and a float32 scale a row `[N, 1]` (its largest magnitude / 448; 1 for a row of
    zeros): `codes * scale` is `w` rounded to FP8, nearest."""
    w = w.float()
    amax = w.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
