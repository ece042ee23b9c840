"""Quantized linears on CPU, on the stored blocks: the fast path of GGUF, AWQ and GPTQ weights.

Every weight row is blocks of 32 inputs, each block unsigned codes `q` (4 or 8 bits) with a scale `d` and an
offset `m`: `w = q * d + m`. GGUF's Q4_0 (`m = -8d`), Q4_1 (`m` stored) and Q8_0 (codes + 128, `m = -128d`)
are this arithmetic as stored; AWQ and GPTQ (`w = (q - z) * s` per group) too (`d = s`, `m = -z * s`, a group of
64 or 128 inputs being 2 or 4 blocks). All are repacked once at load. Scales and offsets are kept in fp16, as
GGUF stores them and AWQ / GPTQ scales are: a weight takes 5 bits (9 at 8 bits).

Activations are quantized per row and block (`quantize_activations`): one level of int8 codes (`dx = max|x| /
127`, llama.cpp's scheme) or two (15 bits), so a block contributes `d * dx * sum(q * qx) + m * dx * sum(qx)`: an
exact integer dot product, then fp32. At two levels, steps from `cpu_native.bf16_min_rows()` rows on (bound by
arithmetic, not by reading the weights) run bf16 dot products instead (`in_bf16`). `block_gemm_reference` is each
arithmetic in torch; the native kernels (`kernels/csrc/cpu_quant*.cpp`) compute the same with AVX-512 VNNI / BF16
or AMX bf16 tiles.

Layout (`BlockWeights`), rows interleaved by 16 (padded with zero rows) so that a vector lane is an output row:
`codes` uint8 `[groups, blocks * 16 * 32 * bits / 8]`, per group and block the registers of 16 rows x 4 inputs
(quad t: inputs 4t..4t+3), 8-bit quads 0..7 in turn, 4-bit quads t and t + 4 in the low and high nibbles of
register t; `scales` / `offsets` fp16 `[groups, blocks * 16]`.
"""

from dataclasses import dataclass

import torch

from tiffin.kernels import cpu_native

BLOCK = 32
LANES = 16  # weight rows interleaved


@dataclass
class BlockWeights:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    in_features: int  # K
    out_features: int  # N, before padding to whole groups of 16
    levels: int = 1  # of int8 codes the activations are quantized to (2: 15 bits a block)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.offsets))


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """`[N, blocks, ...]` -> `[groups, blocks, 16, ...]`, rows padded with zeros to whole groups."""
    groups = -(-t.shape[0] // LANES)
    if t.shape[0] % LANES:  # (a pad copies even when it adds nothing)
        t = torch.nn.functional.pad(t, (0,) * (2 * (t.dim() - 1)) + (0, groups * LANES - t.shape[0]))
    return t.view(groups, LANES, *t.shape[1:]).transpose(1, 2)


def pack_codes(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, levels: int = 1
) -> BlockWeights:
    """Weights `w[n, k] = codes[n, k] * scales[n, k // 32] + offsets[n, k // 32]` from unpacked unsigned codes
    `[N, K]` (K a multiple of 32) and per-block scales and offsets `[N, K / 32]`."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or offsets.shape != scales.shape:
        raise ValueError(f"codes [N, K] need K a multiple of {BLOCK} and [N, K/{BLOCK}] scales, got {codes.shape}")
    quads = codes.to(torch.uint8).view(n, k // BLOCK, 8, 4)
    if bits == 4:
        quads = quads[:, :, :4] | (quads[:, :, 4:] << 4)
    return _pack_quads(quads.contiguous(), scales, offsets, bits, k, levels)


def _pack_quads(
    quads: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, k: int, levels: int
) -> BlockWeights:
    """The layout from a row's quads `uint8 [N, blocks, registers, 4]` (its 4 bytes of each register of a block),
    moved as int32s: one copy."""
    n = quads.shape[0]
    lanes = _interleave(quads.view(torch.int32).squeeze(-1)).transpose(2, 3)  # [groups, blocks, registers, 16]
    groups = lanes.shape[0]
    fp16 = lambda t: _interleave(t.to(torch.float16)).reshape(groups, -1).contiguous()
    codes = lanes.contiguous().view(torch.uint8).view(groups, -1)
    return BlockWeights(codes, fp16(scales), fp16(offsets), bits, k, n, levels)


def from_gguf(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, levels: int = 1
) -> BlockWeights:
    """GGUF Q4_0 / Q4_1 / Q8_0 rows as `tiffin.quant.gguf` keeps them (see `gguf_dequantize`). Their blocks hold
    each quad of inputs as the layout does (a Q4 block's byte j holds inputs j and j + 16 in its nibbles, as byte
    4l + j of register t holds 4t + j and 4t + 16 + j), so repacking moves whole quads; Q8_0's codes + 128 flip
    the top bit."""
    n = qweight.shape[0]
    raw = qweight.contiguous().view(torch.uint8)
    if bits == 4:
        offsets = mins if mins is not None else -8 * scales.float()
    else:
        raw, offsets = raw ^ 0x80, -128 * scales.float()
    k = raw.shape[1] * 8 // bits
    return _pack_quads(raw.view(n, k // BLOCK, -1, 4), scales, offsets, bits, k, levels)


def from_groups(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, levels: int = 1
) -> BlockWeights:
    """AWQ / GPTQ: codes `[K, N]` in 0..2^bits-1, zeros (as integers) and scales `[K / G, N]`, `w = (q - z) * s`
    per group of G = K / groups consecutive inputs (G a multiple of 32)."""
    k, n = codes.shape
    per_group = k // scales.shape[0] // BLOCK
    expand = lambda t: t.T.repeat_interleave(per_group, dim=1)  # [N, K / 32]
    s = expand(scales).float()
    return pack_codes(codes.T.to(torch.uint8), s, -expand(zeros).float() * s, bits, levels)


def block_gemm(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """`x [M, K]` @ the weight -> `[M, N]` in x's dtype; natively where `cpu_native` runs, else the reference."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"block_gemm: x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.device.type != "cpu" or x.dtype not in cpu_native.ACT_DTYPE_CODES or cpu_native.library() is None:
        return block_gemm_reference(x, w).to(x.dtype)
    return cpu_native.block_gemm(x.contiguous(), w.codes, w.scales, w.offsets, w.bits, w.out_features, w.levels)


def in_bf16(x: torch.Tensor, w: BlockWeights) -> bool:
    """Whether `x` times `w` runs in bf16 dot products: prompt-sized inputs at two activation levels, where the
    arithmetic (not reading the weights) bounds the call and the CPU has them."""
    rows = cpu_native.bf16_min_rows() if cpu_native.library() is not None else None
    return w.levels == 2 and rows is not None and x.shape[0] >= rows


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


def unpack_codes(w: BlockWeights, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The codes `[N, K]` (or of rows `rows`) as integers, in input order."""
    rows = torch.arange(w.out_features) if rows is None else rows
    quads = w.codes[rows // LANES].view(len(rows), w.in_features // BLOCK, -1, LANES, 4)
    quads = quads[torch.arange(len(rows)), :, :, rows % LANES]  # [R, blocks, 4 or 8, 4]
    if w.bits == 4:
        quads = torch.cat([quads & 0xF, quads >> 4], dim=2)
    return quads.reshape(len(rows), w.in_features)


def _per_row(t: torch.Tensor, w: BlockWeights, rows: torch.Tensor) -> torch.Tensor:
    """Scales or offsets `[R, K / 32]` of rows `rows`, as float32."""
    return t.view(t.shape[0], -1, LANES)[rows // LANES, :, rows % LANES].float()


def dequantize_blocks(w: BlockWeights, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight `[N, K]` (or its rows `rows`) in float32: `q * d + m`, exact for GGUF's blocks (each product
    and sum is representable); a few rows (an embedding lookup) in one native pass where it is built."""
    if rows is not None and rows.device.type == "cpu" and cpu_native.library() is not None:
        return cpu_native.dequantize_rows(w.codes, w.scales, w.offsets, w.bits, w.in_features, rows)
    rows = torch.arange(w.out_features) if rows is None else rows
    q = unpack_codes(w, rows).view(len(rows), -1, BLOCK).float()
    d, m = _per_row(w.scales, w, rows)[..., None], _per_row(w.offsets, w, rows)[..., None]
    return (q * d + m).view(len(rows), -1)


def block_gemm_reference(x: torch.Tensor, w: BlockWeights, bf16: bool | None = None) -> torch.Tensor:
    """The kernels' arithmetic in torch: exact integer block dot products, each scaled and summed in fp32; or for
    `in_bf16` calls (`bf16` overrides), bf16 activations times the weight rounded to bf16, summed in fp32."""
    if in_bf16(x, w) if bf16 is None else bf16:
        weight = dequantize_blocks(w).bfloat16().float()
        return x.bfloat16().float() @ weight.T
    qx, dx = quantize_activations(x, w.levels)
    m, n, rows = x.shape[0], w.out_features, torch.arange(w.out_features)
    qx_blocks = qx.view(m, -1, BLOCK).to(torch.int64)
    dots = torch.einsum("mbj,nbj->mnb", qx_blocks, unpack_codes(w).view(n, -1, BLOCK).to(torch.int64)).float()
    d, offsets = _per_row(w.scales, w, rows), _per_row(w.offsets, w, rows)
    sx = dx * qx_blocks.sum(-1).float()
    return (dots * (d[None] * dx[:, None])).sum(-1) + sx @ offsets.T
