"""What names an adapter (`LoRARequest`, vLLM's shape) and what a loaded one is (`LoRAModel`)."""

from dataclasses import dataclass, field
from pathlib import Path

import torch


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
