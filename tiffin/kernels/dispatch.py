"""One place that decides which implementation of an op runs."""

import os

import torch

BACKENDS = ("auto", "torch", "triton")


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
