"""GGUF's quantized rows decoded into the block layout of `tiffin.kernels.block_gemm`, one decoder per type, in
torch, exactly as llama.cpp (and gguf-py) lay each type out:

- Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1: blocks of 32 inputs, an fp16 `d` (Q4_1, Q5_1: then an fp16 minimum `m`), Q5's
  32 high bits as a little-endian word, then the codes (Q8_0: 32 int8; Q4 / Q5: 16 bytes whose low nibbles are
  inputs 0..15 and high nibbles 16..31). `w = (q - 8) d`, `(q - 16) d`, `q d`, or `q d + m`.
- Q4_K / Q5_K: super-blocks of 256 inputs: fp16 `d` and `dmin`, 12 bytes of eight 6-bit scales and mins
  (`get_scale_min`), Q5_K's 32 bytes of high bits (bit j of byte l: input 32j + l), 128 bytes of nibbles (byte l
  of 32-byte chunk c: inputs 64c + l low, 64c + 32 + l high). `w = q d sc - dmin mn` per 32 inputs.
- Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 `d`; `w = (q - 32) d sc` per 16.
- Q3_K: 32 bytes of high bits (bit j of byte l: input 32j + l), 64 of low 2-bit pairs (pair s of byte l of 32-byte
  chunk c: input 128c + 32s + l), 12 bytes of sixteen 6-bit scales (`scale_k3`), fp16 `d`; `w = (q - 4) d (sc - 32)`
  per 16.
- Q2_K: 16 bytes `sc | mn << 4`, 64 of 2-bit codes (as Q3_K's low pairs), fp16 `d` and `dmin`; `w = q d sc - dmin mn`
  per 16.
- IQ4_NL: blocks of 32, fp16 `d` and 16 bytes of nibbles (as Q4_0's): `w = IQ4_VALUES[q] d`.
- IQ4_XS: super-blocks of 256: fp16 `d`, a little-endian word of 2-bit high scale parts (bits 2b, 2b + 1: block
  b's), 4 bytes of 4-bit low parts (block b: nibble b % 2 of byte b / 2), 128 bytes of nibbles (16 a block, as
  IQ4_NL's); `w = IQ4_VALUES[q] d (sc - 32)` per 32.

Each decoder returns the codes `[N, K]` and what the layout's packers take; big tensors are decoded `ROW_CHUNK`
rows at a time, so the transient unpacked codes stay small beside the model.
"""

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from tiffin.kernels.block_layout import (
    SUPER_CODEBOOK,
    SUPER_MINS16,
    BlockWeights,
    from_gguf,
    pack_codebook,
    pack_codes,
    pack_super,
    stack_groups,
)

ROW_CHUNK_BYTES = 1 << 20  # raw rows decoded at a time: their transients stay small, and reused


def _fields(raw: torch.Tensor, qtype: QType) -> torch.Tensor:
    """Rows `uint8 [N, row_bytes]` -> `[N, blocks, block_bytes]`."""
    return raw.view(raw.shape[0], -1, GGML_QUANT_SIZES[qtype][1])


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes `[..., n * itemsize]` read as `dtype` `[..., n]` (little-endian, as GGUF stores them)."""
    t = t.contiguous()
    return (t.clone() if t.data_ptr() % dtype.itemsize else t).view(dtype)


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> 32 low-4-bit codes: low nibbles inputs 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """A block's 4 bytes of high bits (a little-endian word, bit j: input j) -> `[..., 32]` 0 or 1."""
    return (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)).flatten(-2) & 1


def _q5(raw: torch.Tensor, with_min: bool, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.Q5_1 if with_min else QType.Q5_0)
    n, at = raw.shape[0], 4 if with_min else 2
    d = _as(blocks[..., :2], torch.float16).view(n, -1)
    codes = _nibbles_32(blocks[..., at + 4 :]) | (_high_bits_32(blocks[..., at : at + 4]) << 4)
    offsets = _as(blocks[..., 2:4], torch.float16).view(n, -1) if with_min else -16 * d.float()
    return pack_codes(codes.view(n, -1), d, offsets, 5, levels)


def _q4_0_1_8_0(raw: torch.Tensor, qtype: QType, levels: int) -> BlockWeights:
    blocks = _fields(raw, qtype)
    n, at = raw.shape[0], 4 if qtype == QType.Q4_1 else 2
    codes = blocks[..., at:].reshape(n, -1)
    scales = _as(blocks[..., :2], torch.float16).view(n, -1)
    mins = _as(blocks[..., 2:4], torch.float16).view(n, -1) if qtype == QType.Q4_1 else None
    return from_gguf(codes, scales, mins, 8 if qtype == QType.Q8_0 else 4, levels)


def scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes `[..., 12]` -> eight 6-bit scales and eight 6-bit mins, each `uint8 [..., 8]`: bytes
    0-3 hold scales 0-3 (and in their top bits scales 4-7's), 4-7 mins 0-3 (and mins 4-7's), 8-11 the low 4 bits
    of scales 4-7 and mins 4-7."""
    d, m, md = packed[..., :4], packed[..., 4:8], packed[..., 8:]
    scales = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scales, mins


def _k_mins(raw: torch.Tensor, bits: int, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.Q5_K if bits == 5 else QType.Q4_K)
    n = raw.shape[0]
    d, dmin = (_as(blocks[..., at : at + 2], torch.float16).view(n, -1) for at in (0, 2))
    sc, mn = scale_min_k4(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(n, -1, 4, 1, 32)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=3).view(n, -1, 8, 32)  # [N, supers, sub-block, input]
    if bits == 5:
        qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
        codes = codes | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    return pack_super(codes.view(n, -1), sc.view(n, -1), mn.view(n, -1), d, dmin, bits, levels)


def _q6_k(raw: torch.Tensor, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.Q6_K)
    n = raw.shape[0]
    ql = blocks[..., :128].reshape(n, -1, 2, 1, 64)  # per half of the super-block
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [N, supers, 2, 2, 64]: input 128c + 64s + l
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # input 128c + 32s + l
    codes = low.view(n, -1, 2, 128) | (high.view(n, -1, 2, 128) << 4)
    scales = _as(blocks[..., 192:208], torch.int8).view(n, -1)
    d = _as(blocks[..., 208:210], torch.float16).view(n, -1)
    return pack_super(codes.view(n, -1), scales, None, d, None, 6, levels)


def _pairs_256(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K's 64 bytes of 2-bit codes `[..., 64]` -> `[..., 256]`: pair s of byte l of chunk c is input 128c +
    32s + l."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3).flatten(-3)


def scale_k3(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes `[..., 12]` -> sixteen signed scales `int8 [..., 16]` (6-bit, less 32): bytes 0-7 hold the low
    4 bits of scales 0-7 (low nibbles) and 8-15 (high), bytes 8-11 the top 2 bits (bits 2j, 2j + 1 of byte 8 + i:
    scale 4j + i)."""
    low = torch.cat([packed[..., :8] & 15, packed[..., :8] >> 4], dim=-1)
    high = (packed[..., None, 8:] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    return ((low | (high.flatten(-2) << 4)).to(torch.int16) - 32).to(torch.int8)


def _q3_k(raw: torch.Tensor, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.Q3_K)
    n = raw.shape[0]
    high = (blocks[..., :32].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # input 32j + l
    codes = _pairs_256(blocks[..., 32:96]) | (high.flatten(-2) << 2)
    d = _as(blocks[..., 108:110], torch.float16).view(n, -1)
    return pack_super(codes.view(n, -1), scale_k3(blocks[..., 96:108]).view(n, -1), None, d, None, 3, levels)


def _q2_k(raw: torch.Tensor, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.Q2_K)
    n = raw.shape[0]
    d, dmin = (_as(blocks[..., at : at + 2], torch.float16).view(n, -1) for at in (80, 82))
    sub = blocks[..., :16].reshape(n, -1)  # sc | mn << 4, as the layout holds them
    return pack_super(_pairs_256(blocks[..., 16:80]).view(n, -1), sub, None, d, dmin, 2, levels, SUPER_MINS16)


def _iq4_nl(raw: torch.Tensor, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.IQ4_NL)
    n = raw.shape[0]
    d = _as(blocks[..., :2], torch.float16).view(n, -1)
    return pack_codebook(_nibbles_32(blocks[..., 2:]).view(n, -1), d, levels)


def _iq4_xs(raw: torch.Tensor, levels: int) -> BlockWeights:
    blocks = _fields(raw, QType.IQ4_XS)
    n = raw.shape[0]
    d = _as(blocks[..., :2], torch.float16).view(n, -1)
    high = (_as(blocks[..., 2:4], torch.int16).int() >> (2 * torch.arange(8))) & 3  # [N, supers, 8]
    low = torch.stack([blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4], dim=-1).flatten(-2)
    sc = ((low.int() | (high << 4)) - 32).to(torch.int8)
    codes = _nibbles_32(blocks[..., 8:].reshape(n, -1, 8, 16))
    return pack_super(codes.view(n, -1), sc.view(n, -1), None, d, None, 4, levels, SUPER_CODEBOOK)


# GGUF type -> decoder of its rows `uint8 [N, row_bytes]` into the block layout at `levels` activation levels
DECODERS: dict[QType, Callable[[torch.Tensor, int], BlockWeights]] = {
    QType.Q4_0: lambda raw, levels: _q4_0_1_8_0(raw, QType.Q4_0, levels),
    QType.Q4_1: lambda raw, levels: _q4_0_1_8_0(raw, QType.Q4_1, levels),
    QType.Q8_0: lambda raw, levels: _q4_0_1_8_0(raw, QType.Q8_0, levels),
    QType.Q5_0: lambda raw, levels: _q5(raw, False, levels),
    QType.Q5_1: lambda raw, levels: _q5(raw, True, levels),
    QType.Q4_K: lambda raw, levels: _k_mins(raw, 4, levels),
    QType.Q5_K: lambda raw, levels: _k_mins(raw, 5, levels),
    QType.Q6_K: _q6_k,
    QType.Q3_K: _q3_k,
    QType.Q2_K: _q2_k,
    QType.IQ4_NL: _iq4_nl,
    QType.IQ4_XS: _iq4_xs,
}


def to_blocks(raw: torch.Tensor, qtype: QType, levels: int = 1) -> BlockWeights:
    """GGUF rows of `qtype` (`uint8 [N, row_bytes]`, any alignment) in the block layout."""
    rows = max(16, ROW_CHUNK_BYTES // max(1, raw.shape[1]) // 16 * 16)
    chunks = (DECODERS[qtype](raw[start : start + rows], levels) for start in range(0, raw.shape[0], rows))
    return stack_groups(chunks, raw.shape[0])
