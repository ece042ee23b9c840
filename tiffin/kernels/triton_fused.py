"""Triton kernels of the element-wise ops of a decode layer, one launch each where torch issues a chain:
RMSNorm (with or without the residual add before it), SiLU- and GELU-and-mul, and the rotary embedding (with
Qwen3's per-head q/k RMSNorm before it) fused with the KV cache write. The torch implementations
(kernels/__init__.py, kernels/fused.py) are their references: each kernel rounds where torch rounds (every
intermediate torch stores in the activation dtype is cast to it here), with fp32 arithmetic in between. One
program per row (per token and head for the rotary): decode rows are few and short, and a row fits one block
(hidden sizes up to 16k).
"""

import itertools

import torch
import triton
import triton.language as tl

from tiffin.kernels import kv_quant
from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.triton_common import hadamard_halves, kv_quantize, kv_scale

MAX_ROW = 16384  # the widest row one program handles (a block of the whole row)


def _row_launch_options(width: int) -> dict:
    """One block of the row, padded to a power of two; warps so that each thread holds at most 16 elements."""
    block = triton.next_power_of_2(width)
    if block > MAX_ROW:
        raise ValueError(f"row of {width} elements: the fused kernels take at most {MAX_ROW}")
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 512)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[rows, width]` with unit stride along the row (a copy only where it has none)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    width,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if ADD_RESIDUAL:  # the sum is stored in x's dtype, and the norm reads it rounded
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / width + eps)
    normed = (xf * rstd).to(dtype)  # cast back before the weight multiply, as the reference models do
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)


def rms_norm_launch(x, residual, weight, eps: float) -> tuple[tc.Launch, torch.Tensor, torch.Tensor | None]:
    """The launch and its outputs (normed `[rows, width]`, and the new residual when `residual` is given)."""
    x = _rows(x)
    rows, width = x.shape
    if weight.shape != (width,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous [{width}], got {tuple(weight.shape)}")
    out = tc.empty((rows, width), x.dtype, x.device)
    residual_out = None if residual is None else tc.empty((rows, width), x.dtype, x.device)
    residual = x if residual is None else _rows(residual)
    target = out if residual_out is None else residual_out  # unused placeholder without a residual
    launch = tc.Launch(
        _rms_norm_kernel,
        (rows,),
        (
            x,
            residual,
            weight,
            out,
            target,
            width,
            eps,
            x.stride(0),
            residual.stride(0),
            out.stride(0),
            target.stride(0),
        ),
        dict(ADD_RESIDUAL=residual_out is not None, **_row_launch_options(width)),
    )
    return launch, out, residual_out


@implements("rms_norm", "triton")
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    launch, out, _ = rms_norm_launch(x, None, weight, eps)
    if x.numel():
        launch(x.device)
    return out.view(x.shape)


@implements("add_rms_norm", "triton")
def add_rms_norm_triton(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    launch, out, residual_out = rms_norm_launch(x, residual, weight, eps)
    if x.numel():
        launch(x.device)
    return out.view(x.shape), residual_out.view(x.shape)


@triton.jit
def _act_and_mul_kernel(gate_up_ptr, out_ptr, width, stride_in, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACT == "silu":
        act = g / (1.0 + tl.exp(-g))
    elif ACT == "gelu":
        act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:  # "gelu_tanh": 0.5 g (1 + tanh(u)) written as g * sigmoid(2u), which neither tail cancels or overflows
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-2.0 * u))
    act = act.to(gate.dtype)  # torch stores act(gate) before the multiply
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


ACTS = {"silu": "silu", "none": "gelu", "tanh": "gelu_tanh"}  # silu, or gelu's `approximate` -> the kernel's ACT


def act_and_mul_launch(gate_up: torch.Tensor, act: str) -> tuple[tc.Launch, torch.Tensor]:
    """`act` one of `ACTS`' values."""
    gate_up = _rows(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = tc.empty((rows, width), gate_up.dtype, gate_up.device)
    launch = tc.Launch(
        _act_and_mul_kernel,
        (rows,),
        (gate_up, out, width, gate_up.stride(0), out.stride(0)),
        dict(ACT=act, **_row_launch_options(width)),
    )
    return launch, out


def _act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    launch, out = act_and_mul_launch(gate_up, act)
    if gate_up.numel():
        launch(gate_up.device)
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@implements("silu_and_mul", "triton")
def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(gate_up, "silu")


@implements("gelu_and_mul", "triton")
def gelu_and_mul_triton(gate_up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return _act_and_mul(gate_up, ACTS[approximate])


@triton.jit
def _rotary_write_kv_kernel(
    qk_ptr,
    v_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    num_heads,
    stride_qk_token,
    stride_qk_head,
    stride_v_token,
    stride_v_head,
    stride_q_token,
    stride_q_head,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    CODES: tl.constexpr,
    QK_NORM: tl.constexpr,
    ROTATE_KEYS: tl.constexpr,
    ROTATE_QUERIES: tl.constexpr,
):
    """Program (token, head) over the query heads then the key heads; a key head also copies its value head. A
    quantized cache (`CODES` "int8", "fp8_e4m3", "fp8_e5m2"; scales as int16 bf16 bits) takes each head's codes
    and scale, the head's two halves reduced together; `ROTATE_KEYS` (power-of-two head dims) its keys times the
    Hadamard matrix (`kv_quant`), `ROTATE_QUERIES` the returned queries alike, for the attention to meet them.
    `QK_NORM`: the head is first RMS-normalized by its weight (`q_norm_ptr` for a query head, `k_norm_ptr` for a
    key head), its halves reduced together likewise."""
    token, head = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    pos = tl.load(positions_ptr + token)
    src = qk_ptr + token * stride_qk_token + head * stride_qk_head
    x1 = tl.load(src + d, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + d, mask=mask, other=0.0)
    dtype = x1.dtype
    if QK_NORM:  # rounded as `rms_norm`: the normed head cast to x's dtype, then times the weight, cast again
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / (2 * HALF) + eps)
        norm_ptr = q_norm_ptr if head < num_heads else k_norm_ptr
        w1 = tl.load(norm_ptr + d, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype)
    # cos/sin rounded to x's dtype, each product and the sum rounded to it: the unfused rotation's arithmetic
    cos = tl.load(cos_ptr + pos * HALF + d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HALF + d, mask=mask, other=0.0).to(dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = ((a * cos).to(dtype).to(tl.float32) - (b * sin).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((b * cos).to(dtype).to(tl.float32) + (a * sin).to(dtype).to(tl.float32)).to(dtype)
    if head < num_heads:
        if ROTATE_QUERIES:  # rounded to x's dtype after, as `kv_quant.rotate(query).to(query.dtype)`
            r1, r2 = hadamard_halves(y1, y2, HALF)
            y1, y2 = r1.to(dtype), r2.to(dtype)
        dst = q_out_ptr + token * stride_q_token + head * stride_q_head
        tl.store(dst + d, y1, mask=mask)
        tl.store(dst + HALF + d, y2, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:  # -1: a padding row, written nowhere
            kv_head = head - num_heads
            num_kv_heads = tl.num_programs(1) - num_heads
            head_row = slot * num_kv_heads + kv_head  # contiguous caches: [slots, kv_heads, head_dim]
            row = head_row * (2 * HALF)
            v_src = v_ptr + token * stride_v_token + kv_head * stride_v_head
            v_lo = tl.load(v_src + d, mask=mask, other=0.0)
            v_hi = tl.load(v_src + HALF + d, mask=mask, other=0.0)
            if CODES == "":
                k_cache_dtype = k_cache_ptr.dtype.element_ty
                tl.store(k_cache_ptr + row + d, y1.to(k_cache_dtype), mask=mask)
                tl.store(k_cache_ptr + row + HALF + d, y2.to(k_cache_dtype), mask=mask)
                v_cache_dtype = v_cache_ptr.dtype.element_ty
                tl.store(v_cache_ptr + row + d, v_lo.to(v_cache_dtype), mask=mask)
                tl.store(v_cache_ptr + row + HALF + d, v_hi.to(v_cache_dtype), mask=mask)
            else:  # masked lanes hold 0.0: they never raise the largest magnitude
                k1, k2 = y1.to(tl.float32), y2.to(tl.float32)
                if ROTATE_KEYS:
                    k1, k2 = hadamard_halves(y1, y2, HALF)
                scale, scale_bits = kv_scale(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)), CODES)
                tl.store(k_cache_ptr + row + d, kv_quantize(k1, scale, CODES), mask=mask)
                tl.store(k_cache_ptr + row + HALF + d, kv_quantize(k2, scale, CODES), mask=mask)
                tl.store(k_scale_ptr + head_row, scale_bits)
                v1, v2 = v_lo.to(tl.float32), v_hi.to(tl.float32)
                scale, scale_bits = kv_scale(tl.maximum(tl.max(tl.abs(v1), 0), tl.max(tl.abs(v2), 0)), CODES)
                tl.store(v_cache_ptr + row + d, kv_quantize(v1, scale, CODES), mask=mask)
                tl.store(v_cache_ptr + row + HALF + d, kv_quantize(v2, scale, CODES), mask=mask)
                tl.store(v_scale_ptr + head_row, scale_bits)


def rotary_write_kv_launch(
    qk,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    positions,
    cos,
    sin,
    num_heads: int,
    k_scale=None,
    v_scale=None,
    q_norm_weight=None,
    k_norm_weight=None,
    eps: float = 0.0,
    rotate_query: bool = False,
) -> tuple[tc.Launch, torch.Tensor]:
    num_tokens, heads, head_dim = qk.shape
    if k_cache.shape[2:] != (heads - num_heads, head_dim) or k_cache.shape != v_cache.shape:
        raise ValueError(f"rotary_write_kv: caches {tuple(k_cache.shape)} do not fit qk {tuple(qk.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != v_cache.dtype:
        raise ValueError("rotary_write_kv: k_cache and v_cache must be contiguous and of one dtype")
    if k_scale is not None:
        tc.check_kv_scales("rotary_write_kv", k_cache, k_scale, v_scale)
        if qk.dtype not in tc.DTYPES or v.dtype != qk.dtype:
            raise ValueError(f"rotary_write_kv: qk/v dtypes must be one of {tc.DTYPES}, got {qk.dtype}/{v.dtype}")
    if qk.stride(2) != 1 or v.stride(2) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary_write_kv: qk, v, cos and sin need unit stride along head_dim")
    if slot_mapping.dtype != torch.int64 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError("rotary_write_kv: slot_mapping must be int64 and positions integers")
    norms = (q_norm_weight, k_norm_weight) if q_norm_weight is not None else (qk, qk)  # stand-ins, never read
    if q_norm_weight is not None and not all(w.is_contiguous() and w.dtype == qk.dtype for w in norms):
        raise ValueError(f"rotary_write_kv: q/k norm weights must be contiguous {qk.dtype}")
    q = tc.empty((num_tokens, num_heads, head_dim), qk.dtype, qk.device)
    half = head_dim // 2
    rotate_keys = k_scale is not None and kv_quant.rotates(head_dim)
    launch = tc.Launch(
        _rotary_write_kv_kernel,
        (num_tokens, heads),
        (
            qk,
            v,
            positions,
            cos,
            sin,
            q,
            tc.kv_code_view(k_cache),
            tc.kv_code_view(v_cache),
            # scales as int16 bits; a model-dtype cache passes itself (never read: CODES="")
            k_cache if k_scale is None else k_scale.view(torch.int16),
            v_cache if v_scale is None else v_scale.view(torch.int16),
            slot_mapping,
            *norms,
            eps,
            num_heads,
            qk.stride(0),
            qk.stride(1),
            v.stride(0),
            v.stride(1),
            q.stride(0),
            q.stride(1),
        ),
        dict(
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
            CODES=tc.kv_codes(k_cache),
            QK_NORM=q_norm_weight is not None,
            ROTATE_KEYS=rotate_keys,
            ROTATE_QUERIES=rotate_keys and rotate_query,
            num_warps=1,
        ),
    )
    return launch, q


@implements("rotary_write_kv", "triton")
def rotary_write_kv_triton(
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
    args = (qk, v, k_cache, v_cache, slot_mapping, positions, cos, sin, num_heads, k_scale, v_scale)
    launch, q = rotary_write_kv_launch(*args, q_norm_weight, k_norm_weight, eps, rotate_query)
    if qk.shape[0]:
        launch(qk.device)
    return q


@register("fused_elementwise")
def _compile_cases(arch: int):
    """Per activation dtype: RMSNorm with and without the residual (hidden 2048 and 8192, the widest block per warp
    count), SiLU- and both GELU-and-mul (intermediate 8192 and 14336), the rotary KV write (head_dim 64, 128, 256)
    into a cache of the model's dtype and each quantized one (keys and queries rotated, as the layers ask), and
    with the q/k norm into a model-dtype and an int8 cache (the norm comes before, and is the same for, every cache
    format); into an int8 cache with the queries left as they are (head_dim 128), and at head_dim 80 (no
    rotation: not a power of two)."""
    meta = dict(device="meta")
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        for hidden in (2048, 8192):
            x = torch.empty(4, hidden, dtype=dtype, **meta)
            weight = torch.empty(hidden, dtype=dtype, **meta)
            for residual in (None, torch.empty_like(x)):
                launch, _, _ = rms_norm_launch(x, residual, weight, 1e-6)
                add = "add_" if residual is not None else ""
                yield CompileCase(launch.kernel, f"{add}rms_norm {name} hidden={hidden}", launch.args, launch.kwargs)
        for (op, act), intermediate in itertools.product(
            [("silu_and_mul", "silu"), ("gelu_and_mul", "gelu"), ("gelu_tanh_and_mul", "gelu_tanh")], (8192, 14336)
        ):
            launch, _ = act_and_mul_launch(torch.empty(4, 2 * intermediate, dtype=dtype, **meta), act)
            yield CompileCase(launch.kernel, f"{op} {name} I={intermediate}", launch.args, launch.kwargs)
        caches = [("", dtype, False), *((codes, d, False) for codes, d in kv_quant.CACHE_DTYPES.items())]
        caches += [("", dtype, True), ("int8", torch.int8, True)]
        cases = [(*cache, head_dim, True) for cache, head_dim in itertools.product(caches, (64, 128, 256))]
        cases += [("int8", torch.int8, False, 128, False), ("int8", torch.int8, False, 80, True)]
        for codes, cache_dtype, qk_norm, head_dim, rotate_query in cases:
            qkv = torch.empty(4, (32 + 16) * head_dim, dtype=dtype, **meta)
            qk, v = qkv.split([40 * head_dim, 8 * head_dim], dim=-1)
            cache = torch.empty(64, 16, 8, head_dim, dtype=cache_dtype, **meta)
            rope = torch.empty(4096, head_dim // 2, dtype=torch.float32, **meta)
            norm_weight = torch.empty(head_dim, dtype=dtype, **meta) if qk_norm else None
            launch, _ = rotary_write_kv_launch(
                qk.view(4, 40, head_dim),
                v.view(4, 8, head_dim),
                cache,
                torch.empty_like(cache),
                torch.empty(4, dtype=torch.int64, **meta),
                torch.empty(4, dtype=torch.int64, **meta),
                rope,
                torch.empty_like(rope),
                32,
                *tc.example_kv_scales(cache),
                norm_weight,
                norm_weight,
                1e-6,
                rotate_query,
            )
            kv = f" kv={codes}" if codes else ""
            norm = " qk_norm" if qk_norm else ""
            plain_query = "" if rotate_query or not codes else " query unrotated"
            config = f"rotary_write_kv {name} head_dim={head_dim}{kv}{norm}{plain_query}"
            yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)
