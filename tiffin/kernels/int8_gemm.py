"""Quantized linears on int8 activations: the CPU's fast path for GGUF, AWQ and GPTQ weights (llama.cpp's scheme).

Every weight row is blocks of 32 inputs, each block unsigned codes `q` (4 or 8 bits) with a scale `d` and an
offset `m`: `w = q * d + m`. GGUF's Q4_0 (`m = -8d`), Q4_1 (`m` stored) and Q8_0 (codes + 128, `m = -128d`)
are this layout as stored; AWQ and GPTQ (`w = (q - z) * s` per group) repack into it once at load (`d = s`,
`m = -z * s`, a group of 64 or 128 inputs being 2 or 4 blocks). Activations are quantized per row and block to
int8 (`dx = max|x| / 127`, `qx = round(x / dx)`), so a block contributes `d * dx * sum(q * qx) + m * dx *
sum(qx)`: an exact integer dot product, then fp32 (`int8_gemm_reference` is that arithmetic in torch; the native
kernel computes the same with AVX-512 VNNI). Scales and offsets are kept in fp16, as GGUF stores them and AWQ /
GPTQ scales are: a weight takes 5 bits (9 at 8 bits).

Layout (`BlockWeights`): `codes` uint8 `[N, nb2 * 32 * bits / 8]` with nb2 the row's blocks rounded up to even
(4-bit: block b's 16 bytes hold inputs 0..15 in the low nibbles, 16..31 in the high ones, as GGUF's Q4), and
`scales` / `offsets` fp16 `[N, nb2]`; padding is zero.
"""

from dataclasses import dataclass

import torch

from tiffin.kernels import cpu_native

BLOCK = 32


@dataclass
class BlockWeights:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    in_features: int  # K, before padding

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.offsets))


def padded_blocks(in_features: int) -> int:
    """A row's blocks rounded up to even (the kernel reads them in pairs)."""
    nb = in_features // BLOCK
    return nb + nb % 2


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> BlockWeights:
    """Weights `w[n, k] = codes[n, k] * scales[n, k // 32] + offsets[n, k // 32]` from unpacked unsigned codes
    `[N, K]` (K a multiple of 32) and per-block scales and offsets `[N, K / 32]`."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or offsets.shape != scales.shape:
        raise ValueError(
            f"codes [N, K] need K a multiple of {BLOCK} and [N, K/{BLOCK}] scales, got {tuple(codes.shape)}"
        )
    nb2 = padded_blocks(k)
    padded = torch.zeros(n, nb2 * BLOCK, dtype=torch.uint8)
    padded[:, :k] = codes
    if bits == 4:  # a block's inputs j and j + 16 share byte j
        halves = padded.view(n, nb2, 2, 16)
        packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1)
    else:
        packed = padded
    fp16 = lambda t: torch.nn.functional.pad(t.to(torch.float16), (0, nb2 - k // BLOCK))
    return BlockWeights(packed.contiguous(), fp16(scales), fp16(offsets), bits, k)


def from_gguf(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> BlockWeights:
    """GGUF Q4_0 / Q4_1 / Q8_0 rows as `tiffin.quant.gguf` keeps them (see `gguf_dequantize`)."""
    n = qweight.shape[0]
    if bits == 4:
        halves = qweight.view(n, -1, 16)
        codes = torch.cat([halves & 0xF, halves >> 4], dim=-1).view(n, -1)
        offsets = mins if mins is not None else -8 * scales.float()
    else:
        codes = (qweight.view(n, -1).to(torch.int16) + 128).to(torch.uint8)
        offsets = -128 * scales.float()
    return pack_codes(codes, scales, offsets, bits)


def from_groups(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int) -> BlockWeights:
    """AWQ / GPTQ: codes `[K, N]` in 0..2^bits-1, zeros (as integers) and scales `[K / G, N]`, `w = (q - z) * s`
    per group of G = K / groups consecutive inputs (G a multiple of 32)."""
    k, n = codes.shape
    per_group = k // scales.shape[0] // BLOCK
    expand = lambda t: t.T.repeat_interleave(per_group, dim=1)  # [N, K / 32]
    s = expand(scales).float()
    return pack_codes(codes.T.to(torch.uint8), s, -expand(zeros).float() * s, bits)


def int8_gemm(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """`x [M, K]` @ the weight -> `[M, N]` in x's dtype; natively where `cpu_native` runs, else the reference."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"int8_gemm: x must be [M, {w.in_features}], got {tuple(x.shape)}")
    if x.device.type == "cpu" and x.dtype in cpu_native.ACT_DTYPE_CODES and cpu_native.library() is not None:
        return cpu_native.int8_gemm(x.contiguous(), w.codes, w.scales, w.offsets, w.bits)
    return int8_gemm_reference(x, w).to(x.dtype)


def quantize_activations(x: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of 32: int8 codes `[M, padded * 32]` and scales `[M, padded]` (zero past K)."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inverse[..., None]).round().clamp(-127, 127).to(torch.int8).view(m, k)
    pad = padded * BLOCK - k
    return torch.nn.functional.pad(q, (0, pad)), torch.nn.functional.pad(d, (0, padded - k // BLOCK))


def unpack_codes(w: BlockWeights) -> torch.Tensor:
    """The codes `[N, nb2 * 32]` as integers."""
    if w.bits == 8:
        return w.codes
    halves = w.codes.view(w.out_features, -1, 16)
    return torch.cat([halves & 0xF, halves >> 4], dim=-1).view(w.out_features, -1)


def dequantize_blocks(w: BlockWeights, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight `[N, K]` (or its rows `rows`) in float32: `q * d + m`, exact for GGUF's blocks (each product
    and sum is representable)."""
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    blocks = BlockWeights(pick(w.codes), pick(w.scales), pick(w.offsets), w.bits, w.in_features)
    n, nb2 = blocks.out_features, padded_blocks(w.in_features)
    q = unpack_codes(blocks).view(n, nb2, BLOCK).float()
    d, m = blocks.scales[:, :nb2, None].float(), blocks.offsets[:, :nb2, None].float()
    return (q * d + m).view(n, -1)[:, : w.in_features]


def int8_gemm_reference(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """The kernel's arithmetic in torch: exact integer block dot products, each scaled and summed in fp32."""
    nb2 = padded_blocks(w.in_features)
    qx, dx = quantize_activations(x, nb2)
    m, n = x.shape[0], w.out_features
    qx_blocks = qx.view(m, nb2, BLOCK).to(torch.int64)
    q_blocks = unpack_codes(w).view(n, nb2, BLOCK).to(torch.int64)
    dots = torch.einsum("mbj,nbj->mnb", qx_blocks, q_blocks).float()  # exact: |dot| < 2^24
    d, offsets = w.scales.float(), w.offsets.float()
    sx = dx * qx_blocks.sum(-1).float()
    return (dots * (d[None] * dx[:, None])).sum(-1) + sx @ offsets.T
