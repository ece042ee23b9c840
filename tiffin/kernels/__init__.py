"""Compute ops. Each op is one function taking `backend` ("torch" or "triton", from `resolve_backend`); the
dispatch registry (kernels/dispatch.py) runs that backend's implementation. Nothing here knows about the
engine. LoRA ops live in kernels/lora.py, quantized GEMMs in kernels/quant.py."""

import torch

from tiffin.kernels import cpu_native, kv_quant
from tiffin.kernels.attention import AttentionMetadata
from tiffin.kernels.dispatch import implements, kernel, resolve_backend

__all__ = [
    "AttentionMetadata",
    "add_rms_norm",
    "argmax",
    "fused_moe",
    "gelu_and_mul",
    "mla_attention",
    "paged_attention",
    "write_kv",
    "resolve_backend",
    "rms_norm",
    "rotary_write_kv",
    "silu_and_mul",
]


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch", k_scale=None, v_scale=None) -> None:
    """Scatter this step's `key`/`value` `[T, num_kv_heads, head_dim]` into the paged caches; slot -1 is skipped.
    Quantized caches (int8 / fp8 codes, `kv_quant`) take their tokens' scales in `k_scale`/`v_scale`."""
    _check_scales(k_cache, v_cache, k_scale, v_scale)
    kernel("write_kv", backend)(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    scale: float,
    backend: str = "torch",
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    query_rotated: bool = False,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
    softcap: float = 0.0,
):
    """`query [T, num_heads, head_dim]` -> `[T, num_heads, head_dim]`, reading K/V through `md.block_tables`.
    `causal=False` (encoders): each query row sees every key of its request's `seq_len`, not only the earlier.
    Quantized caches are read with their scales `k_scale`/`v_scale` `[num_blocks, block_size, num_kv_heads]`;
    their keys are stored rotated (`kv_quant`) and the queries are rotated alike, unless `query_rotated` says
    they come so (`rotary_write_kv(..., rotate_query=True)`). `fresh_kv`: this step's keys and values as given
    to `write_kv` (unrotated queries only); the torch path attends a prompt without a cached prefix over them,
    in the model's dtype, rather than reading them back (dequantized) from the cache, as vLLM's CPU backend does.
    Triton reads every row from the cache in one launch and ignores it. `window` > 0: each query row sees only its
    last `window` keys (a sliding-window layer); `softcap` > 0: scores become `softcap * tanh(score / softcap)`
    (Gemma 2's attention logit soft-capping); both for causal calls only."""
    _check_scales(k_cache, v_cache, k_scale, v_scale)
    if window < 0 or softcap < 0 or ((window or softcap) and not causal):
        raise ValueError(f"paged_attention: window {window} / softcap {softcap}: >= 0, and only for causal calls")
    args = (query, k_cache, v_cache, md, scale, causal, k_scale, v_scale, query_rotated, fresh_kv, window, softcap)
    return kernel("paged_attention", backend)(*args)


def mla_attention(
    q_nope, q_pe, cache, md: AttentionMetadata, scale: float, w_uk, w_uv, fresh_latent=None, backend: str = "torch"
) -> torch.Tensor:
    """DeepSeek's multi-head latent attention over a latent cache `[num_blocks, block_size, 1, rank + rope]`:
    `q_nope [T, H, nope]`, `q_pe [T, H, rope]` -> `[T, H, v_dim]` (kernels/mla.py: layout, and which rows attend
    absorbed); `w_uk [H, nope, rank]`, `w_uv [H, v_dim, rank]` the up-projections. Triton: decode-only steps
    (triton_mla.py)."""
    return kernel("mla_attention", backend)(q_nope, q_pe, cache, md, scale, w_uk, w_uv, fresh_latent)


def _check_scales(k_cache, v_cache, k_scale, v_scale) -> None:
    """A quantized cache comes with scales of its blocks' shape, a model-dtype one without."""
    if kv_quant.is_quantized(k_cache) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"a {k_cache.dtype} KV cache needs scales exactly when it is quantized (int8, fp8)")
    if k_scale is not None and not (k_scale.shape == v_scale.shape == k_cache.shape[:3] == v_cache.shape[:3]):
        raise ValueError(f"KV scales {tuple(k_scale.shape)} do not fit caches {tuple(k_cache.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    return kernel("rms_norm", backend)(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """`[..., 2*I]` -> `[..., I]`: silu(gate) * up."""
    return kernel("silu_and_mul", backend)(gate_up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum (the greedy pick), on any device: the native CPU kernel where it runs
    (torch's `max` tracks the index through its reduction: several times slower), else `max(-1).indices` (the
    same index as `argmax`, which is slower still on CPU)."""
    if x.dim() == 2 and x.stride(1) == 1 and cpu_native.supports(x):
        return cpu_native.argmax(x)
    return x.max(-1).indices


@implements("rms_norm", "torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back before the weight multiply (as the reference models do); on CPU in one
    native pass where it is built (the same rounding)."""
    if cpu_native.supports(x, weight):
        return cpu_native.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@implements("silu_and_mul", "torch")
def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


from tiffin.kernels import mla  # noqa: E402, F401  (registers mla_attention's torch implementation)
from tiffin.kernels.fused import add_rms_norm, gelu_and_mul, rotary_write_kv  # noqa: E402  (its references import the above)
from tiffin.kernels.fused_moe import fused_moe  # noqa: E402
