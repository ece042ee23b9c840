"""Build a model from a Hugging Face directory and stream its safetensors weights into it."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tiffin.engine.config import ModelConfig
from tiffin.engine.models.linear import Linear, LinearMethod
from tiffin.engine.models.llama import LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(
    config: ModelConfig, path: str | Path, device: torch.device, max_positions: int, backend: str, linear_method=None
) -> torch.nn.Module:
    """`linear_method(prefix) -> LinearMethod | None` picks how each projection is stored (None: plain)."""

    def linear(prefix: str, input_size: int, output_sizes: list[int], bias: bool) -> Linear:
        method = linear_method(prefix) if linear_method else None
        return Linear(input_size, output_sizes, bias, config.dtype, method or LinearMethod())

    with torch.device(device):
        model = MODELS[config.architecture](config, max_positions, backend, linear)
    load_weights(model, path)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
    return model.eval()


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    params = dict(model.named_parameters())
    expected = set(params)
    files = checkpoint_files(path)
    with tqdm(desc="Loading weights", unit="tensor", total=_count_tensors(files)) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    for name in _load_tensor(model, params, key, f.get_tensor(key)):
                        expected.discard(name)
                    bar.update()
    missing = sorted(expected)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for: {', '.join(missing[:8])}")


def _count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    return total


def _load_tensor(model, params: dict, key: str, tensor: torch.Tensor) -> list[str]:
    """Place one checkpoint tensor; returns the parameter names it filled."""
    if "rotary_emb" in key:
        return []
    if key == "lm_head.weight" and model.lm_head is None:  # tied: the embedding is the output projection
        return []
    module_path, _, name = key.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    shard = None
    if leaf in model.stacked_modules:
        leaf, shard = model.stacked_modules[leaf]
        module_path = f"{parent}.{leaf}"
    module = model.get_submodule(module_path)
    if isinstance(module, Linear):
        module.load(name, tensor, shard)
        return [f"{module_path}.{n}" for n, _ in module.named_parameters(recurse=False)]
    param = params[key]
    if param.shape != tensor.shape:
        raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    param.data.copy_(tensor)
    return [key]
