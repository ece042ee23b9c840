"""Quantized KV caches: a byte per value and a scale per token and KV head.

A quantized cache is a codes tensor (`int8`, `float8_e4m3fn` or `float8_e5m2`) of the model cache's shape
`[num_blocks, block_size, num_kv_heads, head_dim]` and a scales tensor `[num_blocks, block_size, num_kv_heads]`
in bf16 (fp32's range in two bytes: a head of 64 values costs 66 bytes against bf16's 128). A value is
`code * scale`; each token's head is scaled by its own largest magnitude (symmetric), so fp8 needs no
calibrated per-tensor scale and int8 no zero point.

Keys are stored rotated: each key head times the normalized Hadamard matrix of its size (`rotate`, where
head_dim is a power of two), and attention rotates the queries alike, which leaves every q.k as it was (the
matrix is orthonormal). A few channels of a key head are often several times larger than the rest; one scale
per head then spends its codes on them, and the rotation spreads them over all channels. SmolLM2-135M, 8k tokens
of prose, int8: perplexity +0.16% without it, +0.03% with it; next token as the unquantized cache's at 98.2% and
99.0% of positions (benchmarks/README.md). Values are stored as they are.

Every kernel that writes or reads a quantized cache matches `rotate`, `quantize` and `dequantize` here, the
reference."""

import functools
import math

import torch

CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_DTYPE = torch.bfloat16
# the largest code magnitude each dtype stores: a head's largest value maps to it
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_SMALLEST_SCALE = torch.finfo(SCALE_DTYPE).tiny  # an all-zero head gets codes 0, not 0 / 0


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in CODE_MAX


def rotates(head_dim: int) -> bool:
    """Whether keys of `head_dim` are stored rotated (a power of two: the Sylvester matrices' sizes)."""
    return head_dim & (head_dim - 1) == 0


def rotate(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """`x` `[..., head_dim]` times the normalized Sylvester Hadamard matrix (entry (i, j): (-1)^popcount(i & j) /
    sqrt(head_dim)), as fp32; `x` as fp32 where head_dim is not a power of two. Queries: one fp32 matmul. Keys
    (`exact`, stored quantized): the +-x sums in fp64, exact wherever a head's values span under 2^22 (any order
    then gives the same sums: the kernels' butterflies too), times fp64 sqrt(1 / head_dim), rounded once to fp32,
    so every writer stores the same codes; 4x the fp32 matmul's cost on CPU, which queries need not pay."""
    n = x.shape[-1]
    if not rotates(n):
        return x.float()
    if exact:
        return ((x.double().reshape(-1, n) @ _signs(n, x.device)) * math.sqrt(1 / n)).float().reshape(x.shape)
    return (x.float().reshape(-1, n) @ _hadamard(n, x.device)).reshape(x.shape)


@functools.cache
def _signs(n: int, device: torch.device) -> torch.Tensor:
    """The unnormalized Sylvester Hadamard matrix of size `n`, fp64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while len(h) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h.to(device)


@functools.cache
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    return (_signs(n, torch.device("cpu")).float() / torch.tensor(float(n)).sqrt()).to(device)  # x @ h rotates rows


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., head_dim]` -> codes `[..., head_dim]` of `dtype` and scales `[...]` (bf16). The codes are
    computed against the rounded scale, so rounding the scale moves the grid, never the values off it."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / CODE_MAX[dtype]).clamp(min=_SMALLEST_SCALE).to(SCALE_DTYPE)
    y = xf / scale.float()[..., None]
    if dtype == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-CODE_MAX[dtype], CODE_MAX[dtype]).to(dtype), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`codes * scales` in `dtype` (computed in fp32)."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


def quantize_kv(kv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of a plain cache, K and V stacked on dim 0 (`[2, ..., head_dim]`), as a quantized cache of `dtype`
    holds them: codes and scales, stacked alike, keys rotated as every writer rotates them."""
    (k_codes, k_scales), (v_codes, v_scales) = quantize(rotate(kv[0], exact=True), dtype), quantize(kv[1], dtype)
    return torch.stack([k_codes, v_codes]), torch.stack([k_scales, v_scales])


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_kv`'s blocks back in a plain cache's `dtype`, keys rotated back (the normalized Hadamard matrix is
    its own inverse; the fp32 matmul: these values are approximations already)."""
    keys = rotate(dequantize(codes[0], scales[0], torch.float32)).to(dtype)
    return torch.stack([keys, dequantize(codes[1], scales[1], dtype)])
