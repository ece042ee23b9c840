"""One place that decides which implementation of an op runs.

Each op has one public function (`kernels.paged_attention`, `kernels.lora.lora_shrink`, `kernels.quant.awq_gemm`,
...): it checks what every implementation needs and runs `kernel(op, backend)`. Implementations register with
`@implements(op, backend)`: the torch one (CPU, the reference, and what runs for a backend without its own) next
to the op; a backend's own in `tiffin/kernels/{backend}_*.py`, imported the first time that backend is asked
for, so importing tiffin never imports Triton.
"""

import importlib
import os
import pkgutil
from collections.abc import Callable

import torch

BACKENDS = ("auto", "torch", "triton")
_IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}
_LOADED = {"torch"}  # backends whose modules are imported


def resolve_backend(kernel_backend: str, device: torch.device) -> str:
    """Pick "torch" or "triton" for `device`; env TIFFIN_KERNEL_BACKEND overrides the argument.

    "triton" on CPU tensors runs only under TRITON_INTERPRET=1 (how the tests exercise the kernels).
    """
    choice = os.environ.get("TIFFIN_KERNEL_BACKEND") or kernel_backend
    if choice not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def implements(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: the decorated function is `op`'s implementation for `backend`."""

    def register(fn: Callable) -> Callable:
        if (op, backend) in _IMPLEMENTATIONS:
            raise ValueError(f"kernels: {op!r} implemented twice for backend {backend!r}")
        _IMPLEMENTATIONS[op, backend] = fn
        return fn

    return register


def kernel(op: str, backend: str) -> Callable:
    """`op`'s implementation for `backend`, torch's where that backend has none."""
    if backend not in _LOADED:
        _load(backend)
    return _IMPLEMENTATIONS.get((op, backend)) or _IMPLEMENTATIONS[op, "torch"]


def _load(backend: str) -> None:
    for module in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if module.name.startswith(f"{backend}_"):
            importlib.import_module(f"{__package__}.{module.name}")
    _LOADED.add(backend)
