"""Multi-LoRA serving: PEFT adapters loaded from local directories, held in a host LRU cache, installed into a
fixed number of device slots, and applied per token as a delta on each base projection's output.

- `LoRARequest` (vLLM's shape) names an adapter per request. `LoRAModel` is a parsed, validated adapter; its
  `identity` is a hash of the files' content, used for device slots, the scheduler's adapter count and the
  prefix-cache key, so a name re-pointed at new weights can never reuse stale KV or slots.
- `LoRARegistry` (owned by the LLMEngine) is the one record of which adapters exist: ids, names, directories,
  and the host cache of parsed ones. The serving layers ask it; nothing else keeps a list.
- The device slots (`tiffin.engine.lora_slots`, owned by the ModelRunner) hold the adapters a step uses.

Removing an adapter only unregisters it: sequences already running hold their `LoRAModel` and finish with it;
its slot is reused once no step needs it.

Every read of an adapter's files, the first and each one after an eviction from the host cache, resolves them
inside `lora_roots` when those are set, and a re-read must find the very directory (device and inode) and
content (`identity`) that were first read: swapping the directory or its files afterwards cannot change what a
name serves.
"""

import hashlib
import json
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

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
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: a unique positive `lora_int_id`, a name, and the PEFT directory to load."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)):
            raise ValueError(f"lora_path must be a path string, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return str(self.lora_path)


@dataclass(eq=False)
class LoRAModel:
    """One adapter, validated against the base model. `layers[name][i]` is `(A [r, in], B [out_i, r])` for slice
    i of our layer `name` (None where the adapter leaves that slice alone), with the scaling folded into B."""

    name: str
    int_id: int
    path: str
    identity: bytes  # sha256 of adapter_config.json and the weights file
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = field(repr=False)
    directory: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the directory read


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
) -> LoRAModel:
    """Read and check a PEFT LoRA directory (inside `roots`, if given) against the base model's `layers` (our
    module name -> Linear). ValueError naming the problem for anything it cannot serve exactly. Touches no
    engine state."""
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
    targets = {module: _our_layer(module, layers, stacked_modules) for module in sorted(pairs)}
    _refuse_other_tensors(tensors)
    if not pairs:
        raise ValueError(f"{WEIGHTS_FILE} holds no lora_A/lora_B weights")
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


def _our_layer(module: str, layers: dict[str, Linear], stacked: dict[str, tuple[str, int]]) -> tuple[str, list[int]]:
    """Our layer and the slices of it that checkpoint module `module` covers."""
    parent, _, leaf = module.rpartition(".")
    if leaf not in TARGETS:
        raise ValueError(f"LoRA on {module} is not supported; adapters may target {', '.join(TARGETS[:7])}")
    if leaf in stacked:
        fused, shard = stacked[leaf]
        ours, slices = f"{parent}.{fused}", [shard]
    else:
        ours, slices = module, None
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


class LoRARegistry:
    """The engine's record of adapters, the only one: those added (`add`; a server's named adapters, kept until
    removed) and a host LRU cache of the `capacity` most recently used parsed ones, which also takes adapters
    that requests name without adding them first (offline use). An adapter evicted from the cache is read
    again when a request names it.

    Engine thread only, except `load` (no mutable state) and the lookups `get`, `added` and `is_cached`, which
    any thread may call: the table of added adapters is replaced on change, never mutated."""

    def __init__(self, load: Callable[[LoRARequest], LoRAModel], capacity: int):
        self.load, self.capacity = load, capacity
        self._added: dict[int, LoRARequest] = {}
        self._cache: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self._first_read: dict[int, tuple] = {}  # lora_int_id -> (directory, identity) until removed
        self.next_int_id = 1  # above every id added so far

    def add(self, lora: LoRARequest | LoRAModel) -> bool:
        """Add and cache an adapter (loading it if given a request). False if it was cached already;
        ValueError if it cannot be served, or its id or name belongs to another adapter."""
        request = _request_of(lora)
        cached = self._cache_adapter(lora)
        if request.lora_int_id not in self._added:
            self._added = {**self._added, request.lora_int_id: request}
            self.next_int_id = max(self.next_int_id, request.lora_int_id + 1)
        return cached

    def resolve(self, lora: LoRARequest | LoRAModel) -> LoRAModel:
        """The adapter for a new request: cached (refreshed in the LRU), else loaded now (or taken as given)."""
        self._cache_adapter(lora)
        self._cache.move_to_end(_request_of(lora).lora_int_id)
        return self._cache[_request_of(lora).lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already using it run to completion. False if it was neither added nor
        cached."""
        known = self._cache.pop(lora_int_id, None) is not None or lora_int_id in self._added
        self._first_read.pop(lora_int_id, None)
        self._added = {i: r for i, r in self._added.items() if i != lora_int_id}
        return known

    def get(self, name: str) -> LoRARequest | None:
        return next((r for r in self._added.values() if r.lora_name == name), None)

    def added(self) -> list[LoRARequest]:
        return list(self._added.values())

    def is_cached(self, lora_int_id: int) -> bool:
        return lora_int_id in self._cache

    def cached_ids(self) -> set[int]:
        return set(self._cache)

    def _cache_adapter(self, lora: LoRARequest | LoRAModel) -> bool:
        """Cache the adapter unless it is; False if it was."""
        request = _request_of(lora)
        self._check_free(request)
        if request.lora_int_id in self._cache:
            return False
        model = self.load(lora) if lora is request else lora
        first = self._first_read.setdefault(model.int_id, (model.directory, model.identity))
        if first != (model.directory, model.identity):
            raise ValueError(
                f"LoRA adapter {model.name!r}: the files at {model.path} changed since it was loaded; unload it "
                f"and load it again to serve them"
            )
        self._cache[request.lora_int_id] = model
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return True

    def _check_free(self, request: LoRARequest) -> None:
        """ValueError if the request's id or name belongs to a different adapter."""
        known = [*self._added.values(), *map(_request_of, self._cache.values())]
        for other in known:
            same_path = not request.path or Path(request.path).expanduser() == Path(other.path).expanduser()
            if other.lora_int_id == request.lora_int_id and (other.lora_name != request.lora_name or not same_path):
                raise ValueError(
                    f"lora_int_id {other.lora_int_id} is already loaded as {other.name!r} from {other.path}"
                )
        for other in known:
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"LoRA name {other.name!r} is already loaded with lora_int_id {other.lora_int_id}")


def _request_of(lora: LoRARequest | LoRAModel) -> LoRARequest:
    return lora if isinstance(lora, LoRARequest) else LoRARequest(lora.name, lora.int_id, lora.path)
