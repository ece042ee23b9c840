"""compressed-tensors checkpoints of a tiny Llama, written by the package itself: each linear's scales and zero
points from its `calculate_qparams` over the weight's min / max at the scheme's granularity, the tensors from the
format's own compressor, the config from its `QuantizationConfig`; static activation scales (FP8's `input_scale`)
from each linear's largest input magnitude over a calibration batch run by transformers (llm-compressor's minmax).
The reference is the compressor's `decompress` of what was written (compressed-tensors' dequantization) with the
scales in float32, so that the dequantized weights are exact (in the checkpoint's bf16 they would be rounded), put
into a plain checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

# name -> (preset, format, overrides of the preset's weight args)
SCHEMES = {
    "w4a16-g64": ("W4A16", "pack-quantized", {"group_size": 64}),
    "w4a16-asym-channel": ("W4A16_ASYM", "pack-quantized", {"strategy": "channel", "group_size": None}),
    "w8a16-g32": ("W8A16", "pack-quantized", {"group_size": 32}),
    "w8a8-int": ("W8A8", "int-quantized", {}),
    "fp8-tensor": ("FP8", "float-quantized", {}),
    "fp8-channel": ("FP8_DYNAMIC", "float-quantized", {}),
    "fp8-block": ("FP8_BLOCK", "float-quantized", {"block_structure": [64, 64]}),
}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of `weight [out, in]` at the granularity of `args`, from its min and max there."""
    w = weight.float()
    if args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        groups = w.view(w.shape[0], -1, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    else:  # block
        rows, cols = args.block_structure
        blocks = w.view(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero = calculate_qparams(lo, hi, args)
    return scale.to(weight.dtype), zero


def _calibrated_amax(base: Path, tokens: int = 64) -> dict[str, torch.Tensor]:
    """Each quantized linear's largest input magnitude over `tokens` random tokens, by module name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    amax, hooks = {}, []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED:
            record = lambda mod, args, name=name: amax.__setitem__(name, args[0].abs().amax())
            hooks.append(module.register_forward_pre_hook(record))
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids)
    for hook in hooks:
        hook.remove()
    return amax


def write_compressed(base: Path, out: Path, name: str) -> Path:
    """`base` (a plain tiny checkpoint) quantized in scheme `name` into `out`, its dequantized twin in
    `out / "reference"`."""
    preset, fmt, overrides = SCHEMES[name]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=overrides)
    compressor = BaseCompressor.load_from_registry(fmt)
    state = load_file(base / "model.safetensors")
    written, reference = {}, dict(state)
    acts = scheme.input_activations
    static = _calibrated_amax(base) if acts is not None and acts.dynamic is False else {}
    for key, weight in state.items():
        module = key.removesuffix(".weight")
        if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in QUANTIZED:
            written[key] = weight
            continue
        scale, zero = _qparams(weight, scheme.weights)
        local = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        compressed = compressor.compress(local, scheme)
        written.update({f"{module}.{k}": v.contiguous() for k, v in compressed.items()})
        if module in static:  # e4m3's largest value at the calibration's largest input
            written[f"{module}.input_scale"] = (static[module] / 448).reshape(1).to(weight.dtype)
        exact = {**compressed, "weight_scale": compressed["weight_scale"].float()}
        reference[key] = compressor.decompress(exact, scheme)["weight"].float()
    for target in (out, out / "reference"):
        shutil.copytree(base, target, dirs_exist_ok=True)
    save_file(written, out / "model.safetensors")
    save_file(reference, out / "reference" / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    quant = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt,
                               quantization_status="compressed")  # fmt: skip
    config["quantization_config"] = json.loads(quant.model_dump_json(exclude_none=True))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
