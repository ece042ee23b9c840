"""Fused ops of the decode layer (issue #25): on a GPU each is one Triton launch where the torch code is a chain
of small kernels, and a small model's decode step is bound by launches. The torch implementations here are the
references the Triton ones are tested against, and what runs on CPU (they issue exactly the ops the layers
issued before the fusion, so the CPU path computes and costs the same).

- `add_rms_norm(x, residual, weight, eps)`: `residual += x`, then RMSNorm of the sum -> (normed, residual).
- `rotary_write_kv(qk, v, ...)`: rotate the query and key heads (neox halves) by the tokens' positions, scatter
  the rotated keys and the values into the paged caches; returns the rotated queries. With q/k norm weights
  (Qwen3) each head is RMS-normalized first, in the same launch.
- `gelu_and_mul(gate_up, ...)`: gelu(gate) * up, exact or tanh-approximated GELU.
"""

import torch

from tiffin.kernels import kv_quant
from tiffin.kernels.dispatch import implements, kernel


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, hidden]` each -> (RMSNorm(x + residual), x + residual); the sum is rounded to x's dtype before the
    norm reads it, as the unfused layer computes it."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {x.dtype} {tuple(x.shape)} and residual {residual.dtype} differ")
    return kernel("add_rms_norm", backend)(x, residual, weight, eps)


def rotary_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    backend: str = "torch",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    rotate_query: bool = False,
) -> torch.Tensor:
    """`qk [T, num_heads + num_kv_heads, head_dim]` (query heads, then key heads), `v [T, num_kv_heads,
    head_dim]`, `cos`/`sin` `[max_positions, head_dim / 2]` fp32 -> the rotated queries `[T, num_heads,
    head_dim]`; the rotated keys and `v` go to the caches at `slot_mapping` (slot -1 skipped). The rotation
    rounds like the unfused one: cos/sin cast to x's dtype, each product and sum rounded to it. A quantized cache
    takes its scales as `write_kv` does. `q_norm_weight`/`k_norm_weight` `[head_dim]` (both or neither): each
    query/key head is first RMS-normalized with its weight and `eps`, rounded as `rms_norm` rounds. `rotate_query`:
    where the cache stores its keys rotated (quantized, power-of-two head dims: `kv_quant`) the queries come back
    rotated alike (`kv_quant.rotate(q).to(q.dtype)`), for `paged_attention(..., query_rotated=True)`."""
    if qk.dim() != 3 or v.shape != (qk.shape[0], qk.shape[1] - num_heads, qk.shape[2]):
        raise ValueError(f"rotary_write_kv: qk {tuple(qk.shape)} and v {tuple(v.shape)} do not fit {num_heads} heads")
    if cos.shape != sin.shape or cos.shape[-1] * 2 != qk.shape[-1] or positions.shape != qk.shape[:1]:
        raise ValueError(f"rotary_write_kv: cos/sin {tuple(cos.shape)} do not fit head_dim {qk.shape[-1]}")
    if (q_norm_weight is None) != (k_norm_weight is None) or not all(
        w is None or w.shape == qk.shape[-1:] for w in (q_norm_weight, k_norm_weight)
    ):
        raise ValueError(f"rotary_write_kv: q/k norm weights must both be [{qk.shape[-1]}] or both None")
    args = (qk, v, k_cache, v_cache, slot_mapping, positions, cos, sin, num_heads, k_scale, v_scale)
    return kernel("rotary_write_kv", backend)(*args, q_norm_weight, k_norm_weight, eps, rotate_query)


def gelu_and_mul(gate_up: torch.Tensor, backend: str = "torch", approximate: str = "none") -> torch.Tensor:
    """`[..., 2*I]` -> `[..., I]`: gelu(gate) * up, `approximate` "none" (erf) or "tanh" as torch's gelu; the
    GELU is rounded to gate's dtype before the multiply, as torch stores it."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
    return kernel("gelu_and_mul", backend)(gate_up, approximate)


@implements("add_rms_norm", "torch")
def add_rms_norm_torch(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return kernel("rms_norm", "torch")(residual, weight, eps), residual


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of `x [..., head_dim]` by `cos`/`sin` `[..., head_dim / 2]` already in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qk_rms_norm(
    qk: torch.Tensor, num_heads: int, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, eps: float, backend: str
) -> torch.Tensor:
    """The unfused q/k norm: `qk`'s query heads and key heads each RMS-normalized by their own weight."""
    q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
    rms_norm = kernel("rms_norm", backend)
    return torch.cat([rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)], dim=1)


@implements("rotary_write_kv", "torch")
def rotary_write_kv_torch(
    qk,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    positions,
    cos,
    sin,
    num_heads,
    k_scale=None,
    v_scale=None,
    q_norm_weight=None,
    k_norm_weight=None,
    eps=0.0,
    rotate_query=False,
) -> torch.Tensor:
    if q_norm_weight is not None:
        qk = qk_rms_norm(qk, num_heads, q_norm_weight, k_norm_weight, eps, "torch")
    rotated = rotate(qk, cos[positions].to(qk.dtype)[:, None], sin[positions].to(qk.dtype)[:, None])
    q, k = rotated.split([num_heads, qk.shape[1] - num_heads], dim=1)
    kernel("write_kv", "torch")(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return kv_quant.rotate(q).to(q.dtype) if rotate_query and k_scale is not None else q


@implements("gelu_and_mul", "torch")
def gelu_and_mul_torch(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate=approximate) * up
