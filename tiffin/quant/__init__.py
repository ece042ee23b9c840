"""Quantized checkpoints: detection (`get_quant_config`), the linear methods that serve them, and
`tiffin quantize` (`tiffin.quant.tools`, needs the `tiffin[quantize]` extra)."""

from collections.abc import Callable

from tiffin.quant.config import SUPPORTED, AWQConfig, GPTQConfig, QuantConfig, get_quant_config
from tiffin.quant.methods import AWQLinearMethod, GPTQLinearMethod

__all__ = [
    "SUPPORTED",
    "AWQConfig",
    "GPTQConfig",
    "QuantConfig",
    "get_quant_config",
    "linear_method_factory",
    "AWQLinearMethod",
    "GPTQLinearMethod",
]


def linear_method_factory(
    config: QuantConfig, stacked_modules: dict[str, tuple[str, int]], kernel_backend: str = "auto"
) -> Callable[[str], object | None]:
    """`fn(prefix)` -> the method for the projection at `prefix` (None: plain). `stacked_modules` maps
    checkpoint module names to (fused module, shard), so a fused layer is judged by its checkpoint names."""
    shards: dict[str, list[str]] = {}
    for name, (fused, _) in sorted(stacked_modules.items(), key=lambda item: item[1][1]):
        shards.setdefault(fused, []).append(name)

    def linear_method(prefix: str):
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{n}" if parent else n for n in shards.get(leaf, [leaf])]
        skipped = [config.skips(n) for n in names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(
                f"{prefix}: modules_to_not_convert leaves only some of {names} unquantized; the fused "
                f"layer must be all one or the other"
            )
        if isinstance(config, AWQConfig):
            return AWQLinearMethod(config, kernel_backend)
        return GPTQLinearMethod(config, kernel_backend)

    return linear_method
