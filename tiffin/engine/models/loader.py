"""Read a checkpoint, a Hugging Face directory or a GGUF file: its config, then the model built and its weights
streamed into it.

Weights arrive as (Hugging Face name, tensor) pairs from a weight source picked by the files present
(`WEIGHT_SOURCES`); a new checkpoint format is a reader yielding such pairs plus its entry there.
"""

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tiffin.engine.distributed.pipeline import UNSTAGED, PipelineParallel
from tiffin.engine.distributed.tensor_parallel import UNSHARDED, TensorParallel
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.gguf_checkpoint import find_gguf, open_gguf
from tiffin.engine.models.layers import rename_prefix
from tiffin.engine.models.linear import Embedding, Linear
from tiffin.engine.models.pooler import PoolerConfig
from tiffin.engine.models.registry import get_architecture, resolve_task
from tiffin.quant import LinearMethod, QuantizationConfig, UnquantizedLinearMethod, get_quant_config
from tiffin.quant.base import materialize


def get_model_config(
    path: str | Path, task: str = "auto", pooling_type: str | None = None, quantization: str | None = None
) -> ModelConfig:
    """The checkpoint's ModelConfig, its quantization and the `task` it serves included (`resolve_task`), with
    the pooling of a pooling model (`PoolerConfig.read`; `pooling_type` overrides it); ValueError, before any
    weight is read, for an architecture, activation, quantization or task tiffin cannot serve. `path`: a Hugging
    Face directory, or a GGUF file (or a directory holding one), whose metadata implies the config; `quantization`:
    see `get_quant_config`."""
    gguf = find_gguf(path)
    if gguf is None:
        raw = json.loads((Path(path) / "config.json").read_text())
    else:
        checkpoint = open_gguf(gguf)
        raw = checkpoint.config(get_architecture(checkpoint.architecture).model.stacked_modules)
    name = (raw.get("architectures") or ["?"])[0]
    arch = get_architecture(name)
    raw = arch.config_defaults | raw
    quant = get_quant_config(path, raw, quantization)
    multimodal = arch.model.multimodal_config(raw, path) if hasattr(arch.model, "multimodal_config") else None
    text = arch.model.text_config(raw) if multimodal else raw
    config = ModelConfig.from_hf(text, quant, arch.qkv_bias, arch.qk_norm, arch.renormalize_topk)
    config.multimodal = multimodal
    if config.moe is not None and quant is not None and quant.name != "gguf":
        raise ValueError(f"{name} quantized with {quant.name}: quantized experts are not supported yet (GGUF's are)")
    config.task, config.causal = resolve_task(arch, name, task), arch.causal
    if hasattr(arch.model, "family_config"):
        config.family, config.windowed = arch.model.family_config(raw), arch.model.applies_sliding_window
    if arch.positions_after_padding:
        config.position_offset = raw.get("pad_token_id", 1) + 1
    if config.task != "generate" or arch.causal:  # a decoder that generates embeds too
        config.pooler = PoolerConfig.read(Path(path), arch.pooling_type, pooling_type)
    return config


def build_model(
    config: ModelConfig,
    path: str | Path,
    device: torch.device,
    max_positions: int,
    backend: str,
    tp: TensorParallel = UNSHARDED,
    quant_backend: str | None = None,
    pp: PipelineParallel = UNSTAGED,
) -> torch.nn.Module:
    """The model of `config` on `device` with the checkpoint's weights (this rank's shard of them under tensor
    parallelism `tp`, of its stage's layers only under pipeline parallelism `pp`: the others are not read);
    `backend` is the resolved kernel backend every layer runs on, `quant_backend` (default: `backend`) the one of
    quantized layers. On the meta device, the model without its weights."""
    quant_backend = quant_backend or backend
    model_class = get_architecture(config.architecture).model
    if tp.size > 1 and find_gguf(path) is not None:
        raise ValueError("tensor parallelism does not split GGUF checkpoints; serve a safetensors checkpoint")

    def linear(
        prefix: str, input_size: int, output_sizes: list[int], bias: bool, split: str | None = None, parts=None
    ) -> Linear:
        method = get_linear_method(config.quant_config, model_class.stacked_modules, prefix, quant_backend)
        return Linear(input_size, output_sizes, bias, config.dtype, method, tp, split if tp.size > 1 else None, parts)

    def embedding(prefix: str, vocab_size: int, hidden_size: int) -> Embedding:
        quant = config.quant_config
        method = UnquantizedLinearMethod() if quant is None else quant.embedding_method(prefix, quant_backend)
        tp.split(vocab_size, "vocab_size")  # refused by name when the vocabulary does not split
        return Embedding(vocab_size, hidden_size, config.dtype, method, tp)

    staged = {"pp": pp} if pp.size > 1 else {}  # only decoders that generate are staged
    with torch.device(device):
        model = model_class(config, max_positions, backend, linear, embedding, tp, **staged)
    if torch.device(device).type == "meta":
        return model
    prefix = get_architecture(config.architecture).checkpoint_prefix
    skips = getattr(model, "skips_weight", lambda name: False)
    weights = checkpoint_weights(path, lambda key: skips(prefix + key))
    load_weights(model, ((prefix + key, tensor) for key, tensor in weights), path)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):  # a norm storing (1 + weight), say
            module.process_weights_after_loading()
    return model.eval()


def get_linear_method(
    quant_config: QuantizationConfig | None, stacked_modules: dict[str, tuple[str, int]], prefix: str, backend: str
) -> LinearMethod:
    """How the layer at `prefix` stores its weight. A stacked layer is judged by its shards' checkpoint names
    (qkv_proj by q/k/v_proj): `QuantizationConfig.layer_method`."""
    if quant_config is None:
        return UnquantizedLinearMethod()
    try:
        return quant_config.layer_method(checkpoint_names(stacked_modules, prefix), backend)
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from None


def checkpoint_names(stacked_modules: dict[str, tuple[str, int]], prefix: str) -> list[str]:
    """The checkpoint's names for our layer `prefix`: a stacked layer's shards in order, else `prefix` itself."""
    parent, _, leaf = prefix.rpartition(".")
    shards = sorted((i, name) for name, (stacked, i) in stacked_modules.items() if stacked == leaf)
    return [f"{parent}.{name}" if parent else name for _, name in shards] or [prefix]


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    return sorted(path.glob("*.safetensors"))


def safetensors_weights(path: str | Path, skip: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(path)
    with tqdm(desc="Loading weights", unit="tensor", total=_count_tensors(files)) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # lazy: a tensor-parallel layer reads only its rank's slice
                    if not skip(key):
                        yield key, f.get_slice(key)
                    bar.update()


def gguf_weights(path: str | Path, skip: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    checkpoint = open_gguf(find_gguf(path))
    return checkpoint.weights(checkpoint.kept(get_architecture(checkpoint.architecture).model.stacked_modules), skip)


# weight files a checkpoint (a directory, or the one file) may hold -> reader of its (Hugging Face name, tensor)
# pairs, but those whose name `skip` returns True for (read no further); first match wins
WEIGHT_SOURCES = {"*.safetensors": safetensors_weights, "*.gguf": gguf_weights}


def checkpoint_weights(
    path: str | Path, skip: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[str, torch.Tensor]]:
    for pattern, read in WEIGHT_SOURCES.items():
        if Path(path).match(pattern) or any(Path(path).glob(pattern)):
            return read(path, skip)
    raise FileNotFoundError(f"no {' or '.join(WEIGHT_SOURCES)} weights in {path}")


def checkpoint_signature(path: str | Path) -> dict[str, tuple]:
    """Each tensor's (name, shape, dtype or GGUF type) as the checkpoint's headers state them, no weight read: two
    checkpoints with equal signatures load into the same model."""
    gguf = find_gguf(path)
    if gguf is not None:
        checkpoint = open_gguf(gguf)
        return {name: (shape, checkpoint.tensor_types[name].name) for name, shape in checkpoint.tensor_shapes.items()}
    signature = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                signature[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
    if not signature:
        raise FileNotFoundError(f"no {' or '.join(WEIGHT_SOURCES)} weights in {path}")
    return signature


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], path: str | Path) -> None:
    params = dict(model.named_parameters())
    expected = set(params)
    renames = getattr(model, "checkpoint_renames", {})  # checkpoint name part -> the model's
    prefixes = getattr(model, "checkpoint_prefixes", {})  # checkpoint name prefix -> the model's (the first match)
    for key, tensor in weights:
        for old, new in renames.items():
            key = key.replace(old, new)
        expected.difference_update(_load_tensor(model, params, rename_prefix(key, prefixes), tensor))
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
    if any(ignored in key for ignored in model.ignored_weights):
        return []
    if key == "lm_head.weight" and model.lm_head is None:  # tied: the embedding is the output projection
        return []
    experts, found, rest = key.partition(".experts.")
    if found:  # a mixture of experts' stacked experts take theirs, one expert's or all at once (`moe.Experts`)
        return [f"{experts}.experts.{name}" for name in model.get_submodule(experts + ".experts").load(rest, tensor)]
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
    param, tensor = params[key], materialize(tensor)
    if param.shape != tensor.shape:
        raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    param.data.copy_(tensor)
    return [key]
