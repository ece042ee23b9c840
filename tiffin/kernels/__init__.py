"""Compute ops. Each op has a torch implementation (CPU, reference) and, where it pays, a Triton kernel;
`backend` ("torch" or "triton", from `resolve_backend`) picks one. Nothing here knows about the engine."""

import torch

from tiffin.kernels.attention import AttentionMetadata, paged_attention_torch, write_kv_torch
from tiffin.kernels.dispatch import resolve_backend

__all__ = ["AttentionMetadata", "paged_attention", "write_kv", "resolve_backend", "rms_norm", "silu_and_mul"]


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    if backend == "triton":
        from tiffin.kernels.triton_attention import write_kv_triton

        return write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    write_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, md: AttentionMetadata, scale: float, backend: str = "torch"):
    if backend == "triton":
        from tiffin.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, md, scale)
    return paged_attention_torch(query, k_cache, v_cache, md, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back before the weight multiply (as the reference models do)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
