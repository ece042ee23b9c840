"""Triton KV-cache write (the GPU path of `write_kv`): a model-dtype cache copies each token's row, a quantized one
(`kv_quant`: int8 or fp8 codes, a bf16 scale per token and KV head) quantizes per token and KV head, keys rotated
first where head_dim is a power of two (triton_common has the code arithmetic the attention kernel and the fused
rotary write share). Padding tokens (slot -1) write nothing."""

import torch
import triton
import triton.language as tl

from tiffin.kernels import kv_quant
from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.triton_attention import HEAD_DIMS, pad_head_dim
from tiffin.kernels.triton_common import hadamard_halves, kv_quantize, kv_scale

WRITE_BLOCK = 1024  # elements of one token's [num_kv_heads * head_dim] row copied per program


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key,
    stride_value,
    row_size,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    dst = slot * row_size + offs
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + token * stride_key + offs, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + token * stride_value + offs, mask=mask), mask=mask)


@triton.jit
def _write_kv_quantized_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    head_dim,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    CODES: tl.constexpr,
    BLOCK: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """Program (token, KV head): the head's key and value quantized (`kv_quant`), codes and scales stored at its
    slot; `ROTATE` (head_dim a power of two, BLOCK) the key times the Hadamard matrix first, by its halves.
    Caches and scales contiguous: `[slots, num_kv_heads, head_dim]` and `[slots, num_kv_heads]`."""
    token, kv_head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    d = tl.arange(0, BLOCK)
    mask = d < head_dim
    row = slot * tl.num_programs(1) + kv_head
    src = key_ptr + token * stride_key_token + kv_head * stride_key_head
    if ROTATE:
        h = tl.arange(0, BLOCK // 2)
        k1, k2 = hadamard_halves(tl.load(src + h), tl.load(src + BLOCK // 2 + h), BLOCK // 2)
        scale, scale_bits = kv_scale(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)), CODES)
        tl.store(k_cache_ptr + row * head_dim + h, kv_quantize(k1, scale, CODES))
        tl.store(k_cache_ptr + row * head_dim + BLOCK // 2 + h, kv_quantize(k2, scale, CODES))
    else:
        k = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        scale, scale_bits = kv_scale(tl.max(tl.abs(k), 0), CODES)
        tl.store(k_cache_ptr + row * head_dim + d, kv_quantize(k, scale, CODES), mask=mask)
    tl.store(k_scale_ptr + row, scale_bits)
    v = tl.load(value_ptr + token * stride_value_token + kv_head * stride_value_head + d, mask=mask, other=0.0)
    v = v.to(tl.float32)
    scale, scale_bits = kv_scale(tl.max(tl.abs(v), 0), CODES)
    tl.store(v_cache_ptr + row * head_dim + d, kv_quantize(v, scale, CODES), mask=mask)
    tl.store(v_scale_ptr + row, scale_bits)


@implements("write_kv", "triton")
def write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if key.shape[0]:
        write_kv_launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)(key.device)


def write_kv_launch(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> tc.Launch:
    """A model-dtype cache copies each token's row in `WRITE_BLOCK` chunks; a quantized one (scales given) runs
    a program per token and KV head, which reduces the head to its scale."""
    num_tokens = key.shape[0]
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} / value {tuple(value.shape)} do not fit caches "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"write_kv: slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != v_cache.dtype:
        raise ValueError("write_kv: k_cache and v_cache must be contiguous and of one dtype")
    if k_scale is not None:
        return _write_kv_quantized_launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    row_size = key.shape[1] * key.shape[2]
    # Rows are usually strided views of a fused qkv output; reshape copies only if a row is not contiguous.
    key = key.to(k_cache.dtype).reshape(num_tokens, row_size)
    value = value.to(v_cache.dtype).reshape(num_tokens, row_size)
    return tc.Launch(
        _write_kv_kernel,
        (num_tokens, triton.cdiv(row_size, WRITE_BLOCK)),
        (key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), row_size),
        dict(BLOCK=WRITE_BLOCK),
    )


def _write_kv_quantized_launch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> tc.Launch:
    tc.check_kv_scales("write_kv", k_cache, k_scale, v_scale)
    if key.dtype not in tc.DTYPES or value.dtype != key.dtype:
        raise ValueError(f"write_kv: key/value dtypes must be one of {tc.DTYPES}, got {key.dtype}/{value.dtype}")
    num_tokens, num_kv_heads, head_dim = key.shape
    rotate = kv_quant.rotates(head_dim)  # keys stored rotated (kv_quant): by the kernel
    key, value = key if rotate else key.float(), value.float()  # quantized from fp32
    # heads of strided views of a fused qkv output are read in place; a copy only where head_dim is strided
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    return tc.Launch(
        _write_kv_quantized_kernel,
        (num_tokens, num_kv_heads),
        (
            key,
            value,
            tc.kv_code_view(k_cache),
            tc.kv_code_view(v_cache),
            k_scale.view(torch.int16),
            v_scale.view(torch.int16),
            slot_mapping,
            head_dim,
            *key.stride()[:2],
            *value.stride()[:2],
        ),
        dict(CODES=tc.kv_codes(k_cache), BLOCK=pad_head_dim(head_dim), ROTATE=rotate, num_warps=1),
    )


@register("write_kv")
def _compile_cases(arch: int):
    """The KV write per query dtype: model-dtype, and per padded head dim and code format where it quantizes (a
    head dim not a power of two stored unrotated)."""
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        key = torch.empty(2, 2, 64, dtype=dtype, device="meta")
        cache = torch.empty(4, 16, 2, 64, dtype=dtype, device="meta")
        slots = torch.empty(2, dtype=torch.int64, device="meta")
        launch = write_kv_launch(key, key, cache, cache, slots)
        yield CompileCase(launch.kernel, f"{name} write_kv", launch.args, launch.kwargs)
        for codes, cache_dtype in kv_quant.CACHE_DTYPES.items():
            for head_dim in sorted({pad_head_dim(d): d for d in HEAD_DIMS}.values()):
                key = torch.empty(2, 2, head_dim, dtype=dtype, device="meta")
                cache = torch.empty(4, 16, 2, head_dim, dtype=cache_dtype, device="meta")
                launch = write_kv_launch(key, key, cache, cache, slots, *tc.example_kv_scales(cache))
                config = f"{name} write_kv kv={codes} block={pad_head_dim(head_dim)}"
                yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)
            key = torch.empty(2, 2, 80, dtype=dtype, device="meta")  # not a power of two: stored unrotated
            cache = torch.empty(4, 16, 2, 80, dtype=cache_dtype, device="meta")
            launch = write_kv_launch(key, key, cache, cache, slots, *tc.example_kv_scales(cache))
            yield CompileCase(launch.kernel, f"{name} write_kv kv={codes} head_dim=80", launch.args, launch.kwargs)
