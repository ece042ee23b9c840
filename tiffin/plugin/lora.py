"""LoRA adapters in the Bento: vLLM's runtime endpoints (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`),
adapters listed by `GET /v1/models` with the base model as `parent`, and requests routed by `model` name.

Safety, always on: an adapter loads only from a directory inside one of the configured roots (TIFFIN_LORA_ROOTS,
`os.pathsep`-separated). Paths are checked after resolving symlinks, for the directory and the two files read
from it, and `..` is refused outright; the engine checks the same again at every read, and a re-read after an
eviction must find the directory and content it first loaded. It reads safetensors only, checks every shape
against the base model, refuses ranks above max_lora_rank and non-finite weights. Every refusal is a 4xx naming
the problem; nothing is registered unless the adapter loaded, so serving goes on untouched.

Which adapters are loaded, under which names and directories, is the engine's `LoRARegistry`'s to say; this
module only checks paths and maps the routes onto it. Loading reads and checks the adapter in a worker thread:
the engine keeps stepping. A load is idempotent for the same name and directory; a different directory under a
taken name is a 409. Unloading takes the name off (new requests for it get 404) while requests already running
finish with the adapter. One evicted from the engine's host cache (max_cpu_loras) is read again on use.
"""

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

from tiffin.engine.lora.peft import confine, parse_roots
from tiffin.engine.lora.request import LoRARequest
from tiffin.plugin.openai.protocol import APIError

MAX_NAME_LENGTH = 256


class LoRAServing:
    def __init__(self, engine, roots: str, base_model: str, other_models: Sequence[str] = ()):
        """`engine`: an AsyncLLMEngine built with enable_lora; `roots`: directories, `os.pathsep`-separated;
        `other_models`: the names of the models served beside it (an embedding model), which no adapter may take."""
        self.engine, self.base_model, self.other_models = engine, base_model, set(other_models)
        self.roots = parse_roots(roots)
        self._spelled = [Path(root).absolute() for root in roots.split(os.pathsep) if root]  # checked unresolved
        self.registry = engine.lora_registry
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked and taken in one go

    async def load(self, name: str, raw_path: str) -> str:
        self._check_name(name)
        path = self.resolve(raw_path)
        async with self._lock:
            loaded = self.registry.get(name)
            if loaded is not None:
                if Path(loaded.lora_path) == path:
                    return f"Success: LoRA adapter '{name}' is already loaded from {path}."
                raise APIError(
                    409,
                    f"a LoRA adapter named '{name}' is already loaded from {loaded.lora_path}; unload it "
                    f"first to load {path} under that name",
                    param="lora_name",
                )
            try:
                await self.engine.add_lora(LoRARequest(name, self.registry.next_int_id, str(path)))
            except ValueError as e:
                raise APIError(400, f"LoRA adapter '{name}' was not loaded: {e}", param="lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        async with self._lock:
            loaded = self.registry.get(name)
            if loaded is None:
                raise APIError(
                    404,
                    f"The LoRA adapter '{name}' cannot be found.",
                    type="not_found_error",
                    param="lora_name",
                    code="model_not_found",
                )
            await self.engine.remove_lora(loaded.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def resolve(self, raw: str) -> Path:
        """The adapter directory `raw` names (absolute, or relative to a root), resolved and inside a root."""
        if not raw or "\0" in raw:
            raise APIError(400, "lora_path must be a non-empty path", param="lora_path")
        path = Path(raw)
        if ".." in path.parts:
            raise APIError(400, f"lora_path {raw!r} must not contain '..'", param="lora_path")
        if path.is_absolute() and not any(path.is_relative_to(root) for root in self.roots + self._spelled):
            raise APIError(400, f"lora_path {raw!r} is outside the LoRA roots", param="lora_path")
        for candidate in [path] if path.is_absolute() else [root / path for root in self.roots]:
            try:
                return confine(candidate, self.roots)
            except FileNotFoundError:
                continue
            except ValueError as e:
                raise APIError(400, f"lora_path {raw!r}: {e}", param="lora_path") from None
        raise APIError(400, f"lora_path {raw!r} does not exist under the LoRA roots", param="lora_path")

    def _check_name(self, name: str) -> None:
        if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable() or name != name.strip():
            raise APIError(
                400,
                f"lora_name must be 1 to {MAX_NAME_LENGTH} printable characters without "
                f"surrounding spaces, got {name!r}",
                param="lora_name",
            )
        if name == self.base_model:
            raise APIError(400, f"lora_name '{name}' is the base model's name", param="lora_name")
        if name in self.other_models:
            raise APIError(400, f"lora_name '{name}' is the name of another model served here", param="lora_name")
