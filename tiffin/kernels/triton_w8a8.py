"""Triton GEMMs on quantized activations (the GPU path of `block_gemm.format_gemm`): FP8 weights times e4m3
activations from sm_89 on, INT8 W8A8 weights (`BlockWeights.per_token`) times int8 activations from sm_80 on, both
reading the weights' 8-bit codes in the block layout in place (`block_layout`: a group of 16 rows' block of 32
inputs is 512 bytes, input j of lane l at byte `(j // 4) * 64 + 4 l + j % 4`).

Activations are quantized a row (token) at a time by `_quantize_rows_kernel`, into codes and an fp32 scale a row:
- FP8: `s = max(max|x| / 448, 2^-126)` (dynamic, compressed-tensors' `dynamic` token strategy; the floor keeps an
  all-zero row finite) or the checkpoint's static `input_scale` (`BlockWeights.input_scale`), codes `e4m3(x / s)`
  saturated at +-448, rounded to nearest even (integer arithmetic: `triton_common.kv_quantize`'s).
- INT8: symmetric `s = max|x| / 127`, `q = rne(x * (1 / s))` clamped to +-127 (`block_gemm.quantize_tokens`, as the
  CPU's W8A8 kernels); asymmetric (`zero_points`): `s = (max(x, 0) - min(x, 0)) / 255`, `z = -128 - rne(min * (1 /
  s))`, `q = clamp(rne(x * (1 / s)) + z, -128, 127)`.
The GEMM: `tl.dot` on e4m3 x e4m3 (fp32 accumulators) or int8 x int8 (int32, exact); the epilogue in fp32:
- FP8 `y = acc * s_x * d` where a row has one weight scale (`BlockWeights.scale_inputs` = K: per tensor or channel);
  with finer runs (128 x 128 blocks) each K step of one run's inputs is scaled by its `d` as it is added (`acc +=
  dot * d`), and `y = acc * s_x`.
- INT8 `y = float(acc - z * sum_k w) * (s_x * d)`: `d` the row's fp16 scale, the weight codes signed (`u - 128`),
  their row sums taken as the tiles pass (asymmetric activations only).
Decode-sized M splits K across programs (`triton_common.split_k`): each split applies the epilogue to its partial,
summed in the kernel (fp32: a split INT8 sum is no longer exact). `reference` is this arithmetic in torch.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.block_layout import BLOCK, FP8, LANES, BlockWeights, factors, unpack_codes
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.triton_blocks import block_gemm_triton

FP8_MAX, FP8_MIN_SCALE = 448.0, 2.0**-126
FP8_MIN_ARCH = 89  # e4m3 tensor-core dots: Ada (sm_89), Hopper (sm_90), Blackwell (sm_120)
QUANTIZE_BLOCK = 1024  # inputs a step of the activation quantizer
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + it) - it rounds fp32 |y| < 2^22 to nearest even


def fp8_dots(device: torch.device) -> bool:
    """Whether FP8 weights multiply e4m3 activations on `device` (from sm_89; older GPUs decode them to x's dtype)."""
    return tc.arch(device) >= FP8_MIN_ARCH


@implements("format_block_gemm", "triton")
def format_gemm_triton(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """`x [M, K]` @ the weight -> `[M, N]` in x's dtype: W8A8 on int8 activations, FP8 on e4m3 activations where the
    GPU has e4m3 dots, anything else on the weight decoded to x's dtype (`triton_blocks`)."""
    fp8 = w.kind == FP8 and fp8_dots(x.device)
    if not (fp8 or w.per_token):
        return block_gemm_triton(x, w)
    out = tc.empty((x.shape[0], w.out_features), x.dtype, x.device)
    if x.shape[0]:
        codes, scales, zeros = quantize_rows(x, "fp8" if fp8 else "int8", w.input_scale, w.input_zero_points)
        w8a8_gemm_launch(codes, scales, zeros, w, out)[0](x.device)
    return out


def quantize_rows(
    x: torch.Tensor, codes: str, static: torch.Tensor | None = None, zero_points: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`x [M, K]` -> codes `[M, K]` (fp8: e4m3 bytes as uint8; int8), their fp32 scale a row `[M]` (`static`'s value
    where given, FP8 only) and, with `zero_points` (int8), an int32 zero point a row."""
    m, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    q = tc.empty((m, k), torch.uint8 if codes == "fp8" else torch.int8, x.device)
    scales = tc.empty((m,), torch.float32, x.device)
    zeros = tc.empty((m,), torch.int32, x.device) if zero_points else None
    if m:
        quantize_launch(x, q, scales, zeros, static)(x.device)
    return q, scales, zeros


def quantize_launch(x, q, scales, zeros, static) -> tc.Launch:
    fp8 = q.dtype == torch.uint8
    if static is not None and not fp8:
        raise ValueError("int8 activations are quantized per token: a static scale is for FP8")
    if zeros is not None and fp8:
        raise ValueError("FP8 activations are symmetric: zero points are for int8")
    args = (x, q, scales, scales if zeros is None else zeros, scales if static is None else static, x.shape[1])
    args += (x.stride(0), q.stride(0))
    kwargs = dict(FP8=fp8, STATIC=static is not None, ZEROS=zeros is not None, BLOCK=QUANTIZE_BLOCK, num_warps=4)
    return tc.Launch(_quantize_rows_kernel, (x.shape[0],), args, kwargs)


@triton.jit
def _rne(y):
    return (y + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, static_ptr, K, stride_xm, stride_qm,
    FP8: tl.constexpr, STATIC: tl.constexpr, ZEROS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        hi, lo = tl.zeros([BLOCK], dtype=tl.float32), tl.zeros([BLOCK], dtype=tl.float32)  # 0 in the range
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            hi, lo = tl.maximum(hi, x), tl.minimum(lo, x)
        top, bottom = tl.max(hi, 0), tl.min(lo, 0)
        if FP8:
            scale = tl.maximum(tl.math.div_rn(tl.maximum(top, -bottom), 448.0), 1.1754943508222875e-38)
        elif ZEROS:
            scale = tl.math.div_rn(top - bottom, 255.0)
        else:
            scale = tl.math.div_rn(tl.maximum(top, -bottom), 127.0)
    tl.store(scale_ptr + row, scale)
    if not FP8:
        inv = tl.where(scale != 0, tl.math.div_rn(1.0, tl.where(scale != 0, scale, 1.0)), 0.0)
    if ZEROS:
        zero = -128 - _rne(bottom * inv).to(tl.int32)
        tl.store(zero_ptr + row, zero)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        if FP8:
            q = tc.kv_quantize(x, scale, "fp8_e4m3")
        elif ZEROS:
            q = _rne(tl.minimum(tl.maximum(x * inv, -256.0), 256.0)).to(tl.int32) + zero
            q = tl.minimum(tl.maximum(q, -128), 127).to(tl.int8)
        else:
            q = _rne(tl.minimum(tl.maximum(x * inv, -127.0), 127.0)).to(tl.int8)
        tl.store(q_row + offs, q, mask=offs < K)


@triton.jit
def _weight_codes(codes_ptr, k0, offs_n, mask_n, K, OTHER: tl.constexpr, BLOCK_K: tl.constexpr):
    """The codes of inputs k0..k0+BLOCK_K at columns `offs_n`, uint8 `[BLOCK_K, BLOCK_N]` (OTHER past K)."""
    k = k0 + tl.arange(0, BLOCK_K)
    group, lane = (offs_n // 16).to(tl.int64), offs_n % 16
    within = (k // 32) * 512 + (k % 32 // 4) * 64 + k % 4
    at = (group * (K // 32) * 512 + 4 * lane)[None, :] + within[:, None]
    return tl.load(codes_ptr + at, mask=(k < K)[:, None] & mask_n[None, :], other=OTHER)


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr, a_scale_ptr, a_zero_ptr, codes_ptr, scales_ptr, out_ptr, partial_ptr, tile_counters_ptr,
    M, N, K, k_per_split, stride_am, stride_om, stride_split,
    INT8: tl.constexpr, ZEROS: tl.constexpr, ROW_SCALE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    # a row's scale of block b: scales[group, b * 16 + lane] (fp32 for FP8, fp16 for W8A8)
    scale_row = scales_ptr + (offs_n // 16).to(tl.int64) * (K // 32) * 16 + offs_n % 16
    k_start = pid_k * k_per_split
    k_end = tl.where(k_start + k_per_split < K, k_start + k_per_split, K)
    if INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        w_sum = tl.zeros((BLOCK_N,), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :],
                    other=0)  # fmt: skip
        if INT8:  # unsigned codes u = w + 128 (128 past K: w = 0)
            w = (_weight_codes(codes_ptr, k0, offs_n, mask_n, K, 128, BLOCK_K) ^ 0x80).to(tl.int8, bitcast=True)
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            if ZEROS:
                w_sum += tl.sum(w.to(tl.int32), 0)
        else:
            w = _weight_codes(codes_ptr, k0, offs_n, mask_n, K, 0, BLOCK_K).to(tl.float8e4nv, bitcast=True)
            a = a.to(tl.float8e4nv, bitcast=True)
            if ROW_SCALE:
                acc = tl.dot(a, w, acc)
            else:  # BLOCK_K within one run of a scale
                d = tl.load(scale_row + (k0 // 32) * 16, mask=mask_n, other=0.0)
                acc += tl.dot(a, w) * d[None, :]
    s_x = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)
    if INT8:
        if ZEROS:
            acc -= tl.load(a_zero_ptr + offs_m, mask=mask_m, other=0)[:, None] * w_sum[None, :]
        d = tl.load(scale_row, mask=mask_n, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * (s_x[:, None] * d[None, :])
    elif ROW_SCALE:
        y = acc * s_x[:, None] * tl.load(scale_row, mask=mask_n, other=0.0)[None, :]
    else:
        y = acc * s_x[:, None]
    tile = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        counter = tile_counters_ptr + pid_m * tl.num_programs(1) + pid_n
        tc.reduce_split_k(y, partial_ptr + tile, out_ptr + tile, mask, counter, pid_k, tl.num_programs(2), stride_split)
    else:
        tl.store(out_ptr + tile, y.to(out_ptr.dtype.element_ty), mask=mask)


def w8a8_tile(m: int, w: BlockWeights, zeros: bool) -> tc.Tile:
    """8-bit operands: K steps of 128 bytes, within one run of an FP8 scale. The prefill tile steps 64 where the
    zero points' row sums or a scale a K step take registers (128 spilled on sm_80 and sm_89)."""
    row_scale = w.kind != FP8 or w.scale_inputs >= w.in_features
    if m <= 16:
        tile = tc.Tile(16, 64, 128, num_warps=4, num_stages=3)
    elif m <= 64:
        tile = tc.Tile(64, 64, 128, num_warps=4, num_stages=3)
    else:
        tile = tc.Tile(128, 128, 128 if row_scale and not zeros else 64, num_warps=8, num_stages=3)
    if not row_scale:
        tile = dataclasses.replace(tile, block_k=min(tile.block_k, w.scale_inputs))
    return tile


def w8a8_gemm_launch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    w: BlockWeights,
    out: torch.Tensor,
    splits: int | None = None,
) -> tuple[tc.Launch, torch.Tensor | None]:
    """The launch that writes `out` from quantized activations (`quantize_rows`), and with split-K its fp32
    partials (scratch, returned for tests)."""
    _check(codes, zeros, w)
    m, k = codes.shape
    tile = tc.emulated_width(w8a8_tile(m, w, zeros is not None), w.out_features)
    grid_mn = (triton.cdiv(m, tile.block_m), triton.cdiv(w.out_features, tile.block_n))
    k_per_split, partial = tc.split_k(out, k, tile.block_k, grid_mn[0] * grid_mn[1], splits)
    counters = tc.tile_counters(out.device, grid_mn[0] * grid_mn[1]) if partial is not None else out
    args = (codes, scales, scales if zeros is None else zeros, w.codes, w.scales, out)
    args += (out if partial is None else partial, counters, m, w.out_features, k, k_per_split, codes.stride(0))
    args += (out.stride(0), partial.stride(0) if partial is not None else 0)
    kwargs = dict(INT8=w.kind != FP8, ZEROS=zeros is not None, ROW_SCALE=w.scale_inputs >= k)
    kwargs |= dict(SPLIT=partial is not None, **tile.options())
    return tc.Launch(_w8a8_gemm_kernel, (*grid_mn, triton.cdiv(k, k_per_split)), args, kwargs), partial


def _check(codes: torch.Tensor, zeros: torch.Tensor | None, w: BlockWeights) -> None:
    fp8 = w.kind == FP8
    if not (fp8 or w.per_token):
        raise ValueError(f"w8a8 gemm: FP8 or W8A8 (per-token) weights only, got {w.bits}-bit kind {w.kind}")
    want = torch.uint8 if fp8 else torch.int8
    if codes.dtype != want or codes.dim() != 2 or codes.shape[1] != w.in_features or codes.stride(1) != 1:
        raise ValueError(f"w8a8 gemm: activations must be {want} [M, {w.in_features}], got {codes.dtype} "
                         f"{tuple(codes.shape)}")  # fmt: skip
    if zeros is not None and fp8:
        raise ValueError("w8a8 gemm: FP8 activations take no zero points")
    groups = -(-w.out_features // LANES)
    if w.codes.shape != (groups, w.in_features // BLOCK * 512) or not w.codes.is_contiguous():
        raise ValueError(f"w8a8 gemm: codes {tuple(w.codes.shape)} are not the 8-bit block layout")
    if w.scales.dtype != (torch.float32 if fp8 else torch.float16):
        raise ValueError(f"w8a8 gemm: scales of {'FP8' if fp8 else 'W8A8'} weights are not {w.scales.dtype}")


def reference(x: torch.Tensor, w: BlockWeights, zero_points: bool = False) -> torch.Tensor:
    """The kernels' arithmetic in torch, fp32 (before the output's rounding): activations quantized as
    `quantize_rows`, products summed exactly (float64 for e4m3, int64 for int8), the epilogue's fp32 products."""
    xf = x.float()
    if w.kind == FP8:
        if w.input_scale is not None:
            s_x = w.input_scale.float().expand(x.shape[0])
        else:
            s_x = (xf.abs().amax(1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
        qx = (xf / s_x[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double()
        codes = unpack_codes(w).view(torch.float8_e4m3fn).double()
        d = factors(w)[0]  # [N, K / 32]
        run = min(w.scale_inputs, x.shape[1])
        if run >= x.shape[1]:
            return (qx @ codes.T).float() * s_x[:, None] * d[None, :, 0]
        steps = -(-x.shape[1] // run)
        acc = torch.zeros(x.shape[0], w.out_features)
        for i in range(steps):  # a step of the kernel's loop: a run of one scale
            cols = slice(i * run, (i + 1) * run)
            acc += (qx[:, cols] @ codes[:, cols].T).float() * d[None, :, i * run // BLOCK]
        return acc * s_x[:, None]
    if zero_points:
        top, bottom = xf.amax(1).clamp_min(0), xf.amin(1).clamp_max(0)
        s_x = (top - bottom) / 255
        inv = torch.where(s_x != 0, 1 / s_x, 0)
        z = -128 - (bottom * inv).round()
        qx = ((xf * inv[:, None]).round() + z[:, None]).clamp(-128, 127)
    else:
        s_x = xf.abs().amax(1) / 127
        inv = torch.where(s_x != 0, 1 / s_x, 0)
        qx, z = (xf * inv[:, None]).round().clamp(-127, 127), torch.zeros_like(s_x)
    wq = unpack_codes(w).to(torch.int64) - 128
    dots = qx.to(torch.int64) @ wq.T - z.to(torch.int64)[:, None] * wq.sum(1)[None, :]
    return dots.float() * (s_x[:, None] * factors(w)[0][None, :, 0])


@register("w8a8_gemm")
def _compile_cases(arch: int):
    """The activation quantizer (FP8 dynamic and static, int8 symmetric and asymmetric) per dtype; the GEMM's decode
    (whole and split-K), mid and prefill tiles for FP8 (from sm_89: a scale a row, and 128 x 128 blocks) and INT8
    (symmetric and asymmetric activations)."""
    for dtype in tc.DTYPES:
        x = torch.empty(1, 4096, dtype=dtype, device="meta")
        for codes, static, zeros in [("fp8", False, False), ("fp8", True, False), ("int8", False, False),
                                     ("int8", False, True)]:  # fmt: skip
            if codes == "fp8" and arch < FP8_MIN_ARCH:
                continue
            q = torch.empty(1, 4096, dtype=torch.uint8 if codes == "fp8" else torch.int8, device="meta")
            s = torch.empty(1, dtype=torch.float32, device="meta")
            launch = quantize_launch(x, q, s, s.int() if zeros else None, s if static else None)
            name = f"quantize {str(dtype).removeprefix('torch.')} {codes}" + " static" * static + " zeros" * zeros
            yield CompileCase(launch.kernel, name, launch.args, launch.kwargs)
    variants = [("int8", False, 4096), ("int8 zeros", True, 4096)]
    if arch >= FP8_MIN_ARCH:
        variants += [("fp8 row scale", False, 4096), ("fp8 128-blocks", False, 128)]
    for name, zeros, run in variants:
        w = _example_weights(name.startswith("fp8"), run)
        for dtype in (torch.bfloat16, torch.float16):
            for m, splits in [(1, 1), (1, 4), (32, 1), (256, 1)]:
                codes = torch.empty(m, 4096, dtype=torch.uint8 if w.kind == FP8 else torch.int8, device="meta")
                s = torch.empty(m, dtype=torch.float32, device="meta")
                out = torch.empty(m, 4096, dtype=dtype, device="meta")
                launch, _ = w8a8_gemm_launch(codes, s, s.int() if zeros else None, w, out, splits)
                kw = launch.kwargs
                config = f"{name} {str(dtype).removeprefix('torch.')} tile={kw['BLOCK_M']}x{kw['BLOCK_N']}"
                yield CompileCase(launch.kernel, config + f"x{kw['BLOCK_K']}" + " split-K" * kw["SPLIT"], launch.args,
                                  kw)  # fmt: skip


def _example_weights(fp8: bool, scale_inputs: int, k: int = 4096, n: int = 4096) -> BlockWeights:
    codes = torch.empty(n // 16, k // 32 * 512, dtype=torch.uint8, device="meta")
    scales = torch.empty(n // 16, k // 32 * 16, dtype=torch.float32 if fp8 else torch.float16, device="meta")
    offsets = torch.empty(0 if fp8 else n // 16, k // 32 * 16, dtype=torch.float16, device="meta")
    w = BlockWeights(codes, scales, offsets, 8, k, n, kind=FP8 if fp8 else 0, per_token=not fp8)
    w.scale_inputs = scale_inputs
    return w
