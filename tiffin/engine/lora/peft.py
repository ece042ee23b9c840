"""Reading PEFT LoRA directories: path confinement inside `lora_roots`, parsing and checking an adapter against
the base model's layers. Everything it cannot serve exactly is refused by name, but for one case vLLM ignores too:
on a vision-language model LoRA applies to the language model alone, and an adapter's modules in the vision tower
or projector are left out with a warning naming them (an adapter with no other module is refused)."""

import hashlib
import json
import logging
import math
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from tiffin.engine.lora.request import LoRAModel, LoRARequest
from tiffin.engine.models.layers import rename_prefix
from tiffin.engine.models.linear import Linear

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
# adapter_config.json settings that change the forward pass in ways plain LoRA does not: refused when set
UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "lora_bias": "LoRA bias",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "velora_config": "VeLoRA",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
}
logger = logging.getLogger(__name__)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")


def parse_roots(spec: str) -> list[Path]:
    """`os.pathsep`-separated directories, resolved; ValueError unless each is one."""
    roots = [Path(root) for root in spec.split(os.pathsep) if root]
    for root in roots:
        if not root.is_dir():
            raise ValueError(f"LoRA root {str(root)!r} is not a directory")
    if not roots:
        raise ValueError("lora_roots names no directory")
    return [root.resolve() for root in roots]


def confine(path: str | Path, roots: list[Path]) -> Path:
    """`path` resolved, if it is a directory inside `roots` whose adapter files resolve inside them too.
    FileNotFoundError if it does not exist; ValueError naming the problem otherwise."""
    try:
        resolved = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise FileNotFoundError(f"{path} does not exist under the LoRA roots") from None
    inside = lambda p: any(p.is_relative_to(root) for root in roots)
    if not inside(resolved):
        raise ValueError(f"{path} is outside the LoRA roots once symlinks are resolved")
    if not resolved.is_dir():
        raise ValueError(f"{path} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if (resolved / name).exists() and not inside((resolved / name).resolve()):
            raise ValueError(f"{name} in {path} leads outside the LoRA roots through a symlink")
    return resolved


def load_lora_model(
    request: LoRARequest,
    layers: dict[str, Linear],
    stacked_modules: dict[str, tuple[str, int]],
    max_rank: int,
    dtype: torch.dtype,
    roots: list[Path] | None = None,
    prefixes: dict[str, str] | None = None,
    skipped: tuple[str, ...] = (),
) -> LoRAModel:
    """Read and check a PEFT LoRA directory (inside `roots`, if given) against the base model's `layers` (our
    module name -> Linear). `prefixes`: the model's `checkpoint_prefixes` (a checkpoint's module name prefix ->
    ours), which name an adapter's modules as they name weights; `skipped`: prefixes of our module names that
    LoRA leaves alone (a vision tower's), whose modules in the adapter are ignored with a warning. ValueError
    naming the problem for anything else it cannot serve exactly. Touches no engine state."""
    path = Path(request.lora_path).expanduser()
    try:
        resolved = path.resolve(strict=True) if roots is None else confine(path, roots)
    except (OSError, RuntimeError):
        resolved = path  # missing: reported just below
    if not resolved.is_dir():
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {path} is not a directory")
    directory = resolved.stat()
    config_bytes, weights_bytes = _read_files(resolved)
    config = _parse_config(config_bytes, max_rank)
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as e:
        raise ValueError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    pairs = _lora_pairs(tensors)
    names = {module: rename_prefix(module, prefixes or {}) for module in pairs}
    ignored = sorted(module for module, ours in names.items() if ours.startswith(skipped))
    targets = {m: _our_layer(m, names[m], layers, stacked_modules) for m in sorted(pairs) if m not in ignored}
    _refuse_other_tensors(tensors)
    if not pairs:
        raise ValueError(f"{WEIGHTS_FILE} holds no lora_A/lora_B weights")
    if not targets:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r} targets only the vision tower or projector ({ignored[0]}, ...); "
            "LoRA applies to the language model of a vision-language model"
        )
    out: dict[str, list] = {}
    for module, (ours, slices) in targets.items():
        a, b = pairs[module]
        layer = layers[ours]
        r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        widths = [layer.full_output_sizes[i] for i in slices]  # the checkpoint's, also under tensor parallelism
        _check_shapes(module, a, b, r, layer.full_input_size, sum(widths), max_rank)
        scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        a, b = a.to(dtype), (b.double() * scale).to(dtype)
        if not (a.isfinite().all() and b.isfinite().all()):  # NaN weights would make every logit NaN
            raise ValueError(f"{module}: lora weights must be finite, and scaled by {scale:g} fit in {dtype}")
        entry = out.setdefault(ours, [None] * len(layer.output_sizes))
        for i, piece in zip(slices, b.split(widths)):
            if entry[i] is not None:
                raise ValueError(f"{module} sets a slice of {ours} that another tensor of the adapter sets too")
            entry[i] = (a, piece.contiguous())
    if ignored:
        logger.warning(
            "LoRA adapter %r: %d modules in the vision tower or projector ignored (LoRA applies to the language "
            "model of a vision-language model): %s",
            request.lora_name, len(ignored), ", ".join(ignored[:4]) + (", ..." if len(ignored) > 4 else ""),
        )  # fmt: skip
    identity = hashlib.sha256(config_bytes + b"\0" + weights_bytes).digest()
    return LoRAModel(
        request.lora_name, request.lora_int_id, str(path), identity, out, (directory.st_dev, directory.st_ino)
    )


def _read_files(path: Path) -> tuple[bytes, bytes]:
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}; a PEFT LoRA adapter directory is expected")
    if not (path / WEIGHTS_FILE).is_file():
        pickled = [p.name for p in path.glob("adapter_model*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        if pickled:
            raise ValueError(
                f"{path} has {pickled[0]} but no {WEIGHTS_FILE}: only safetensors adapters are "
                f"loaded (pickle files can run code)"
            )
        raise ValueError(f"{path} has no {WEIGHTS_FILE}")
    return (path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes()


def _parse_config(data: bytes, max_rank: int) -> dict:
    try:
        config = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{CONFIG_FILE} sets {key}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{CONFIG_FILE}: bias {config['bias']!r} is not supported (only 'none': LoRA bias "
            f"terms would change the base layers)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) and _compiles(k) for k in patterns):
            raise ValueError(
                f"{CONFIG_FILE}: {key} must map module-name patterns (regular expressions) to values, got "
                f"{str(patterns)[:80]}"
            )
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    alphas = [config.get("lora_alpha"), *(config.get("alpha_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise ValueError(f"{CONFIG_FILE}: r and rank_pattern values must be positive integers, got {ranks}")
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in alphas):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha and alpha_pattern values must be numbers, got {alphas}")
    if max(ranks) > max_rank:
        raise ValueError(f"adapter rank {max(ranks)} exceeds max_lora_rank {max_rank}")
    return config


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
        return True
    except re.error:
        return False


def _lora_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    _refuse_other_tensors(tensors, specific_only=True)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            continue
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise ValueError(
                f"{WEIGHTS_FILE}: {key} must be a 2-D floating-point tensor, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        found.setdefault(m["module"], {})[m["kind"]] = tensor
    for module, ab in found.items():
        if len(ab) != 2:
            have = next(iter(ab))
            raise ValueError(f"{WEIGHTS_FILE}: {module} has lora_{have} but no lora_{'B' if have == 'A' else 'A'}")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


_UNSUPPORTED_TENSORS = (
    "LoRA on embeddings is not supported",
    "DoRA is not supported",
    "LoRA bias is not supported",
    "only lora_A / lora_B weights are; modules_to_save and other trained modules are not",
)


def _refuse_other_tensors(tensors: dict[str, torch.Tensor], specific_only: bool = False) -> None:
    """ValueError for a tensor other than lora_A/lora_B weights; with `specific_only`, only for one that shows a
    recognisable unsupported feature (checked first: embedding LoRA also saves the embedding itself)."""
    others = [key for key in tensors if not _KEY.match(key)]
    if others:
        key = min(others, key=lambda k: _UNSUPPORTED_TENSORS.index(_what(k)))
        if not specific_only or _what(key) != _UNSUPPORTED_TENSORS[-1]:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {key!r} is not supported ({_what(key)})")


def _what(key: str) -> str:
    if "lora_embedding" in key:
        return _UNSUPPORTED_TENSORS[0]
    if "lora_magnitude_vector" in key:
        return _UNSUPPORTED_TENSORS[1]
    if re.search(r"\.lora_[AB]\.bias$", key):
        return _UNSUPPORTED_TENSORS[2]
    return _UNSUPPORTED_TENSORS[3]


def _our_layer(
    module: str, name: str, layers: dict[str, Linear], stacked: dict[str, tuple[str, int]]
) -> tuple[str, list[int]]:
    """Our layer and the slices of it that checkpoint module `module` (`name` in the model) covers."""
    parent, _, leaf = name.rpartition(".")
    if ".experts." in module or ".block_sparse_moe." in module:
        raise ValueError(
            f"LoRA on {module}: adapters on a mixture of experts' experts or router are not supported yet "
            f"(on attention and the shared expert they are)"
        )
    if leaf not in TARGETS:
        raise ValueError(f"LoRA on {module} is not supported; adapters may target {', '.join(TARGETS[:7])}")
    if leaf in stacked:
        fused, shard = stacked[leaf]
        ours, slices = f"{parent}.{fused}", [shard]
    else:
        ours, slices = name, None
    if ours not in layers:
        raise ValueError(f"the adapter has weights for {module}, which the base model does not have")
    return ours, slices or list(range(len(layers[ours].output_sizes)))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching a dotted suffix of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_shapes(
    module: str, a: torch.Tensor, b: torch.Tensor, r: int, inputs: int, outputs: int, max_rank: int
) -> None:
    if a.shape[0] != r or b.shape[1] != r:
        raise ValueError(
            f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not have the rank "
            f"{r} that {CONFIG_FILE} gives it"
        )
    if r > max_rank:
        raise ValueError(f"{module}: rank {r} exceeds max_lora_rank {max_rank}")
    if a.shape[1] != inputs or b.shape[0] != outputs:
        raise ValueError(
            f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
            f"layer's {inputs} inputs and {outputs} outputs"
        )
