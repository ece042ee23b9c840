"""Quantized checkpoints: detection (`get_quant_config`), the linear methods that serve them, and
`tiffin quantize` (`tiffin.quant.tools`, needs the `tiffin[quantize]` extra).

A new format is one module here: a `QuantizationConfig` subclass decorated with `@register_quant_config`
(its `name` is the checkpoint's `quant_method`) whose `linear_method(prefix, backend)` returns its
`LinearMethod`; import the module below so that it registers.
"""

from tiffin.quant.awq import AWQConfig, AWQLinearMethod
from tiffin.quant.base import (
    QUANT_CONFIGS,
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    get_quant_config,
    load_shard,
    register_quant_config,
)
from tiffin.quant.compressed_tensors import CompressedTensorsConfig
from tiffin.quant.fp8 import FP8Config
from tiffin.quant.gguf import GGUFConfig, GGUFLinearMethod
from tiffin.quant.gptq import GPTQConfig, GPTQLinearMethod

__all__ = [
    "QUANT_CONFIGS",
    "AWQConfig",
    "AWQLinearMethod",
    "CompressedTensorsConfig",
    "FP8Config",
    "GGUFConfig",
    "GGUFLinearMethod",
    "GPTQConfig",
    "GPTQLinearMethod",
    "LinearMethod",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "get_quant_config",
    "load_shard",
    "register_quant_config",
]
