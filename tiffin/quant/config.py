"""Which quantization a checkpoint uses, read from `config.json`'s `quantization_config` or, for older
checkpoints, `quantize_config.json` (AutoGPTQ) / `quant_config.json` (AutoAWQ). Anything tiffin cannot run
exactly as published is refused here, before any weight is read, with the variant named."""

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = (
    "AWQ (version gemm, 4-bit, zero point, group size 32/64/128) and GPTQ (4- or 8-bit, group size "
    "32/64/128/-1, desc_act on or off, sym or asym, checkpoint_format gptq or gptq_v2)"
)
AWQ_GROUP_SIZES = (32, 64, 128)
GPTQ_GROUP_SIZES = (32, 64, 128, -1)
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to the stored zeros


@dataclass(frozen=True)
class AWQConfig:
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()
    bits: int = 4

    name = "awq"

    def skips(self, module: str) -> bool:
        """AutoAWQ's rule: a module is left unquantized if any listed name is a substring of its name."""
        return any(key in module for key in self.modules_to_not_convert)


@dataclass(frozen=True)
class GPTQConfig:
    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str

    name = "gptq"

    @property
    def zero_offset(self) -> int:
        return GPTQ_FORMATS[self.checkpoint_format]

    def skips(self, module: str) -> bool:
        return False


QuantConfig = AWQConfig | GPTQConfig


def get_quant_config(model_dir: str | Path, raw_config: dict | None = None) -> QuantConfig | None:
    """The checkpoint's quantization, or None for a plain checkpoint; ValueError for an unsupported one."""
    model_dir = Path(model_dir)
    if raw_config is None:
        raw_config = json.loads((model_dir / "config.json").read_text())
    found = _find(model_dir, raw_config)
    if found is None:
        return None
    source, default_method, qc = found
    method = str(qc.get("quant_method") or default_method).lower()
    if method == "awq":
        return _awq(qc, source)
    if method == "gptq":
        return _gptq(qc, source)
    raise ValueError(f"{source}: quantization method {method!r} is not supported; tiffin serves {SUPPORTED}")


def _find(model_dir: Path, raw: dict) -> tuple[str, str, dict] | None:
    if raw.get("quantization_config") is not None:
        return "config.json quantization_config", "", raw["quantization_config"]
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        path = model_dir / name
        if path.exists():
            return name, method, json.loads(path.read_text())
    return None


def _awq(qc: dict, source: str) -> AWQConfig:
    bits = qc.get("bits", qc.get("w_bit", 4))
    group_size = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    zero_point = qc.get("zero_point", True)
    problems = []
    if version != "gemm":
        problems.append(f"version {version!r}")
    if bits != 4:
        problems.append(f"{bits}-bit weights")
    if not zero_point:
        problems.append("zero_point false")
    if group_size not in AWQ_GROUP_SIZES:
        problems.append(f"group size {group_size}")
    if problems:
        raise ValueError(f"{source}: AWQ with {', '.join(problems)} is not supported; tiffin serves {SUPPORTED}")
    skip = qc.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{source}: modules_to_not_convert must be a list of module names, got {skip!r}")
    return AWQConfig(group_size, tuple(skip))


def _gptq(qc: dict, source: str) -> GPTQConfig:
    bits, group_size = qc.get("bits"), qc.get("group_size", -1)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    problems = []
    if bits not in GPTQ_BITS:
        problems.append(f"{bits}-bit weights")
    if group_size not in GPTQ_GROUP_SIZES:
        problems.append(f"group size {group_size}")
    if fmt not in GPTQ_FORMATS:
        problems.append(f"checkpoint_format {fmt!r}")
    if str(qc.get("pack_dtype", "int32")) != "int32":
        problems.append(f"pack_dtype {qc['pack_dtype']!r}")
    if qc.get("lm_head"):
        problems.append("a quantized lm_head")
    if qc.get("dynamic"):
        problems.append("per-module 'dynamic' overrides")
    if problems:
        raise ValueError(f"{source}: GPTQ with {', '.join(problems)} is not supported; tiffin serves {SUPPORTED}")
    return GPTQConfig(bits, group_size, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)), fmt)
