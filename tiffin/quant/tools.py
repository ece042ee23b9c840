"""`tiffin quantize`: AutoAWQ (AWQ gemm) or GPTQModel (GPTQ) on a local model with a local calibration text,
writing a checkpoint tiffin serves. Needs the `tiffin[quantize]` extra; nothing here downloads anything.

The calibration text is tokenized once and cut into consecutive windows of exactly `seq_len` tokens, handed
to the tools as token ids: AutoAWQ silently drops any sample longer than its `max_calib_seq_len`, so passing
raw text lines can leave it nothing to calibrate on.
"""

import importlib
import os
import shutil
from pathlib import Path

from tiffin.quant.awq import AWQ_GROUP_SIZES
from tiffin.quant.base import get_quant_config
from tiffin.quant.gptq import GPTQ_BITS, GPTQ_FORMATS, GPTQ_GROUP_SIZES

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


def calibration_samples(tokenizer, text: str, num_samples: int, seq_len: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    samples = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:num_samples]
    if not samples:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one sample of seq_len={seq_len}")
    return samples


def quantize(
    model: str | Path,
    output: str | Path,
    method: str,
    calib: str | Path,
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    modules_to_not_convert: list[str] | None = None,
    num_samples: int = 128,
    seq_len: int = 512,
    device: str | None = None,
) -> Path:
    """Quantize `model` into `output`; returns `output` once tiffin's own detection accepts it."""
    _check_args(method, bits, group_size, checkpoint_format, modules_to_not_convert, num_samples, seq_len)
    from transformers import AutoTokenizer

    model, output = Path(model), Path(output)
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = calibration_samples(tokenizer, Path(calib).read_text(encoding="utf-8"), num_samples, seq_len)
    if method == "awq":
        _autoawq(model, output, tokenizer, samples, group_size, modules_to_not_convert, seq_len)
    else:
        _gptqmodel(model, output, samples, bits, group_size, desc_act, sym, checkpoint_format, device)
    for name in TOKENIZER_FILES:  # AutoAWQ saves weights and config only
        if (model / name).exists() and not (output / name).exists():
            shutil.copy(model / name, output / name)
    if get_quant_config(output) is None:
        raise RuntimeError(f"{output} was written without a quantization config")
    return output


def _check_args(method, bits, group_size, checkpoint_format, modules_to_not_convert, num_samples, seq_len) -> None:
    if method not in ("awq", "gptq"):
        raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")
    if num_samples < 1 or seq_len < 1:
        raise ValueError(f"num_samples and seq_len must be >= 1, got {num_samples} and {seq_len}")
    if method == "awq":
        if bits != 4 or group_size not in AWQ_GROUP_SIZES:
            raise ValueError(f"AWQ takes 4 bits and a group size in {AWQ_GROUP_SIZES}, got {bits}/{group_size}")
        return
    if bits not in GPTQ_BITS or group_size not in GPTQ_GROUP_SIZES or checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"GPTQ takes bits {GPTQ_BITS}, group size {GPTQ_GROUP_SIZES} and format "
            f"{tuple(GPTQ_FORMATS)}, got {bits}/{group_size}/{checkpoint_format!r}"
        )
    if modules_to_not_convert:
        raise ValueError("modules_to_not_convert is an AWQ option")


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"tiffin quantize needs {package}: pip install 'tiffin[quantize]' ({e})") from e


def _autoawq(model: Path, output: Path, tokenizer, samples, group_size, modules_to_not_convert, seq_len) -> None:
    AutoAWQForCausalLM = _require("awq", "autoawq").AutoAWQForCausalLM

    awq_model = AutoAWQForCausalLM.from_pretrained(str(model), device_map="cpu")
    quant_config = {
        "zero_point": True,
        "q_group_size": group_size,
        "w_bit": 4,
        "version": "GEMM",
        "modules_to_not_convert": list(modules_to_not_convert or []) or None,
    }
    awq_model.quantize(
        tokenizer,
        quant_config=quant_config,
        calib_data=samples,
        max_calib_samples=len(samples),
        max_calib_seq_len=seq_len,
    )
    awq_model.save_quantized(str(output))


def _gptqmodel(model: Path, output: Path, samples, bits, group_size, desc_act, sym, checkpoint_format, device) -> None:
    # GPTQModel sizes its CPU worker pool from this; unset, it can stall on a machine with few cores
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
    import torch

    gptqmodel = _require("gptqmodel", "gptqmodel")
    GPTQModel, QuantizeConfig = gptqmodel.GPTQModel, gptqmodel.QuantizeConfig

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # GPTQModel turns on group-aware reordering (GAR) by default, which needs groups and excludes act-order
    gar = None if group_size > 0 and not desc_act else False
    config = QuantizeConfig(
        bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, format=checkpoint_format, act_group_aware=gar
    )
    # fp16 as published GPTQ checkpoints are; GPTQModel would otherwise pick bf16 on CPU
    gptq_model = GPTQModel.load(str(model), config, device=device, dtype=torch.float16)
    gptq_model.quantize([{"input_ids": s, "attention_mask": [1] * len(s)} for s in samples], batch_size=8)
    gptq_model.save(str(output))
