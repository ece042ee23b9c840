"""Quantized linears on CPU, on the stored blocks: the fast path of GGUF, AWQ and GPTQ weights.

Every weight row is blocks of 32 inputs, each block (or half-block) unsigned codes `q` of 2 to 8 bits with a
scale `d` and an offset `m`: `w = q * d + m`. GGUF's Q4_0 / Q5_0 (`m = -8d`, `-16d`), Q4_1 / Q5_1 (`m` stored) and
Q8_0 (codes + 128, `m = -128d`) are this arithmetic as stored, with fp16 `d` and `m` a block (kind BLOCKS); AWQ
and GPTQ (`w = (q - z) * s` per group) too (`d = s`, `m = -z * s`, a group of 64 or 128 inputs being 2 or 4
blocks). GGUF's K-quants keep their super-blocks of 256 inputs: an fp16 `d` (and `dmin`) a super-block and small
integer scales a block (Q4_K, Q5_K: `d * sc`, `-dmin * mn`; kind SUPER_MINS) or half-block (Q6_K, Q3_K: `d * sc`,
codes centred on 32, 4; kind SUPER_CENTRED; Q2_K: `d * sc`, `-dmin * mn`; kind SUPER_MINS16), multiplied out in
fp32 by the kernels, exactly as llama.cpp dequantizes them. IQ4_NL and IQ4_XS keep their 4-bit indices into a
16-entry int8 codebook (kinds CODEBOOK, SUPER_CODEBOOK: a block's fp16 d, or a super-block's d times an integer
scale a block), which the kernels look up as they load the codes (`vpshufb`), as the value + 128 with `m = -128 d`.
FP8 weights (kind FP8) are e4m3 codes in the 8-bit registers with an fp32 scale a block (`w = e4m3(q) * d`, `m =
0`; 9 bits a weight): compressed-tensors' per-tensor and per-channel scales and block-FP8's 128 x 128 blocks alike.
All are repacked once at load; a weight takes its format's bits and a little more (Q4_K 4.625, Q6_K 6.625;
IQ4_XS 4.3125 against the file's 4.25).

Activations are quantized per row and block (`quantize_activations`): one level of int8 codes (`dx = max|x| /
127`, llama.cpp's scheme) or two (15 bits), so a block contributes `d * dx * sum(q * qx) + m * dx * sum(qx)`: an
exact integer dot product, then fp32. At two levels, steps from `cpu_native.bf16_min_rows()` rows on (bound by
arithmetic, not by reading the weights) run bf16 dot products instead (`in_bf16`); FP8 weights always do (their
codes are not integers), on the weight `e4m3(q) * d` rounded to bf16, decode steps included (on a CPU without
AVX-512 BF16 their reference in torch: `native_runs`). `block_gemm_reference` is each
arithmetic in torch; the native kernels (`kernels/csrc/cpu_quant*.cpp`) compute the same with AVX-512 VNNI / BF16
or AMX bf16 tiles.

W8A8 weights (`per_token`: compressed-tensors int-quantized with int8 activations, one d a row and m = -128 d) take
their format's own activations instead, int8 per token (`quantize_tokens`: `dx = max|x_row| / 127`), at every number
of rows where the kernels are built (`in_per_token`): `y = dx d (sum(qx u) - 128 sum(qx))`, one exact integer dot
product over the whole input (cpu_quant_w8a8.cpp: AMX-INT8 tiles, or AVX-512 VNNI), whatever the layer's levels.

The layout the kernels read, and its packers, are `tiffin.kernels.block_layout`'s.
"""

import torch

from tiffin.kernels import cpu_native
from tiffin.kernels.block_layout import (  # noqa: F401 (the layout's names, re-exported: callers see one module)
    BLOCK,
    BLOCKS,
    CODEBOOK,
    FORMATS,
    FP8,
    LANES,
    SUPER,
    SUPER_CENTRED,
    SUPER_CODEBOOK,
    SUPER_MINS,
    SUPER_MINS16,
    BlockWeights,
    StackedBlocks,
    code_bytes,
    code_values,
    factors,
    from_gguf,
    from_groups,
    pack_codebook,
    pack_codes,
    pack_fp8,
    pack_super,
    parts,
    stack_groups,
    unpack_codes,
)
from tiffin.kernels.dispatch import implements, kernel


def block_gemm(x: torch.Tensor, w: BlockWeights | StackedBlocks) -> torch.Tensor:
    """`x [M, K]` @ the weight -> `[M, N]` in x's dtype; natively where `cpu_native` runs, else the reference."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"block_gemm: x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.device.type != "cpu" or x.dtype not in cpu_native.ACT_DTYPE_CODES or cpu_native.library() is None:
        return torch.cat([block_gemm_reference(x, part) for part in parts(w)], dim=1).to(x.dtype)
    x, y = x.contiguous(), torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
    first = 0
    for part in parts(w):
        out = y[:, first : first + part.out_features]
        if native_runs(part):
            cpu_native.block_gemm(x, native_weights(part), out, part.levels)
        else:
            out.copy_(block_gemm_reference(x, part))
        first += part.out_features
    return y


def native_runs(w: BlockWeights) -> bool:
    """Whether the native kernels multiply by `w` (the library built): every format but FP8 where the CPU has no
    AVX-512 BF16 (its codes are not integers: only bf16 dot products take them)."""
    return cpu_native.library() is not None and (w.kind != FP8 or cpu_native.bf16_min_rows() is not None)


def dequantized_gemm(x: torch.Tensor, w: BlockWeights | StackedBlocks, backend: str = "torch") -> torch.Tensor:
    """`x [M, K]` @ the weight dequantized exactly (`dequantize_blocks`) and rounded to x's dtype -> `[M, N]`:
    transformers' numerics, what the torch and Triton backends compute."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"dequantized_gemm: x must be [M, {w.in_features}], got {tuple(x.shape)}")
    outputs = [kernel("dequantized_block_gemm", backend)(x, part) for part in parts(w)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


@implements("dequantized_block_gemm", "torch")
@implements("format_block_gemm", "torch")
def dequantized_gemm_torch(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """On CPU the weight decoded by the native row pass where it is built (4-10x torch's unpacking, which took half
    of a step of `cpu_quant_compute="exact"`, the path that decodes every layer each step)."""
    rows = torch.arange(w.out_features) if x.device.type == "cpu" else None
    return torch.nn.functional.linear(x, dequantize_blocks(w, rows).to(x.dtype))


def format_gemm(x: torch.Tensor, w: BlockWeights | StackedBlocks, backend: str = "torch") -> torch.Tensor:
    """`x [M, K]` @ the weight -> `[M, N]` on a kernel backend, computed as the format means it where the backend
    can: the Triton backend quantizes activations for W8A8 weights (int8 per token) and, from sm_89, for FP8 weights
    (e4m3 per token, or the checkpoint's static scale), `triton_w8a8`; every other weight, and the torch backend,
    compute `dequantized_gemm`'s product."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"format_gemm: x must be [M, {w.in_features}], got {tuple(x.shape)}")
    outputs = [kernel("format_block_gemm", backend)(x, part) for part in parts(w)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def native_weights(w: BlockWeights) -> "cpu_native.NativeWeights":
    """The kernels' view of `w` (pointers into its tensors, which must stay as they are)."""
    if w.native is None:
        w.native = cpu_native.NativeWeights(
            w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), w.out_features, w.bits, w.kind, w.per_token
        )
    return w.native


def in_per_token(x: torch.Tensor, w: BlockWeights) -> bool:
    """Whether `x` times `w` runs on int8 activations per token (the W8A8 GEMM): a per-token weight, from
    `cpu_native.w8a8_min_rows()` rows on, where the kernels have it (cpu_quant.cpp's `w8a8_runs`)."""
    if not w.per_token or cpu_native.library() is None or w.in_features > 65536:
        return False
    rows = cpu_native.w8a8_min_rows()
    return rows is not None and x.shape[0] >= rows


def in_bf16(x: torch.Tensor, w: BlockWeights) -> bool:
    """Whether `x` times `w` runs in bf16 dot products: prompt-sized inputs at two activation levels, where the
    arithmetic (not reading the weights) bounds the call and the CPU has them."""
    if w.kind == FP8:
        return True
    rows = cpu_native.bf16_min_rows() if cpu_native.library() is not None else None
    return w.levels == 2 and rows is not None and x.shape[0] >= rows


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (token): int8 codes `[M, K]` and their step `[M]`, `d = max|x| / 127`, as `quantize_activations`
    a block."""
    xf = x.float()
    d = xf.abs().amax(-1, keepdim=True) / 127
    q = (xf * torch.where(d != 0, 1 / d, 0)).round().clamp(-127, 127)
    return q.to(torch.int8), d.squeeze(-1)


def quantize_activations(x: torch.Tensor, levels: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of 32: integer codes `[M, K]` and their step `[M, K / 32]`, x ~ code * step. One level:
    int8 codes of step `d = max|x| / 127`; two: `127 q1 + q2`, q1 those codes and q2 the int8 codes of what they
    leave (`x - q1 d`, rounded once) at step `d / 127`, the step of the sum."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    code = lambda v, step: (v * torch.where(step != 0, 1 / step, 0)).round().clamp(-127, 127)
    q = code(blocks, d)
    if levels == 2:
        rest = (blocks.double() - q.double() * d.double()).float()  # one rounding, as the kernel's fma
        d = d / 127
        q = 127 * q + code(rest, d)
    return q.to(torch.int32 if levels == 2 else torch.int8).view(m, k), d.squeeze(-1)


def dequantize_blocks(w: BlockWeights | StackedBlocks, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight `[N, K]` (or its rows `rows`) in float32: `q * d + m`, exact for GGUF's blocks (each product
    and sum is representable, as gguf-py dequantizes them); a few rows (an embedding lookup) in one native pass
    where it is built."""
    if isinstance(w, StackedBlocks):
        return torch.cat([dequantize_blocks(part) for part in w.parts])
    if rows is not None and rows.device.type == "cpu" and cpu_native.library() is not None:
        return cpu_native.dequantize_rows(native_weights(w), w.in_features, rows)
    rows = torch.arange(w.out_features, device=w.codes.device) if rows is None else rows
    q = unpack_codes(w, rows)
    q = (q.view(torch.float8_e4m3fn) if w.kind == FP8 else code_values(w, q)).float().view(len(rows), -1, w.sub_block)
    d, m = factors(w, rows)
    return (q * d[..., None] + m[..., None]).view(len(rows), -1)


def block_gemm_reference(
    x: torch.Tensor, w: BlockWeights, bf16: bool | None = None, per_token: bool | None = None
) -> torch.Tensor:
    """The kernels' arithmetic in torch: exact integer dot products a block (half-block for SUPER_CENTRED), each
    scaled and summed in fp32; or for `in_bf16` calls (`bf16` overrides), bf16 activations times the weight rounded
    to bf16, summed in fp32; or for `in_per_token` calls (`per_token` overrides) int8 activations per token against
    the signed codes, an exact integer dot product a row times `dx * d` (both rounded once)."""
    if in_per_token(x, w) if per_token is None else per_token:
        qx, dx = quantize_tokens(x)
        dots = qx.to(torch.int64) @ (unpack_codes(w).to(torch.int64) - 128).T
        return dots.float() * (dx[:, None] * factors(w)[0][None, :, 0])
    if in_bf16(x, w) if bf16 is None else bf16:
        weight = dequantize_blocks(w).bfloat16().float()
        return x.bfloat16().float() @ weight.T
    qx, dx = quantize_activations(x, w.levels)
    m, n, sub = x.shape[0], w.out_features, w.sub_block
    qx_subs = qx.view(m, -1, sub).to(torch.int64)
    codes = code_values(w, unpack_codes(w)).view(n, -1, sub).to(torch.int64)
    dots = torch.einsum("mbj,nbj->mnb", qx_subs, codes).float()
    dx = dx.repeat_interleave(BLOCK // sub, dim=1)
    d, offsets = factors(w)
    sx = dx * qx_subs.sum(-1).float()
    return (dots * (d[None] * dx[:, None])).sum(-1) + sx @ offsets.T
