"""Quantized linears on CPU, on the stored blocks: the fast path of GGUF, AWQ and GPTQ weights.

Every weight row is blocks of 32 inputs, each block (or half-block) unsigned codes `q` of 4, 5, 6 or 8 bits with a
scale `d` and an offset `m`: `w = q * d + m`. GGUF's Q4_0 / Q5_0 (`m = -8d`, `-16d`), Q4_1 / Q5_1 (`m` stored) and
Q8_0 (codes + 128, `m = -128d`) are this arithmetic as stored, with fp16 `d` and `m` a block (kind BLOCKS); AWQ
and GPTQ (`w = (q - z) * s` per group) too (`d = s`, `m = -z * s`, a group of 64 or 128 inputs being 2 or 4
blocks). GGUF's K-quants keep their super-blocks of 256 inputs: an fp16 `d` (and `dmin`) a super-block and small
integer scales a block (Q4_K, Q5_K: `d * sc`, `-dmin * mn`; kind SUPER_MINS) or half-block (Q6_K: `d * sc`, codes
centred on 32; kind SUPER_CENTRED), multiplied out in fp32 by the kernels, exactly as llama.cpp dequantizes them.
FP8 weights (kind FP8) are e4m3 codes in the 8-bit registers with an fp32 scale a block (`w = e4m3(q) * d`, `m =
0`; 9 bits a weight): compressed-tensors' per-tensor and per-channel scales and block-FP8's 128 x 128 blocks alike.
All are repacked once at load; a weight takes its format's bits and a little more (Q4_K 4.625, Q6_K 6.625).

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

Layout (`BlockWeights`; kernels/csrc/cpu_blocks.h spells it out): rows interleaved by 16 (padded with zero rows) so
that a vector lane is an output row. Per group and block the registers of 16 rows x 4 inputs (quad t: inputs
4t..4t+3), 8-bit quads 0..7 in turn, below 8 bits quads t and t + 4 in the low and high nibbles of register t
followed by a plane per bit above 4; BLOCKS: `codes` uint8 `[groups, blocks * code_bytes]`, `scales` / `offsets`
fp16 `[groups, blocks * 16]`; the super kinds: `codes` a record per group and super-block (its 8 blocks' codes, then
their integer scales), `scales` (d) / `offsets` (-dmin) fp16 `[groups, supers * 16]`; FP8: `codes` as 8-bit
BLOCKS, `scales` fp32 `[groups, blocks * 16]`, `offsets` empty.
"""

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tiffin.kernels import cpu_native
from tiffin.kernels.dispatch import implements, kernel

BLOCK = 32
LANES = 16  # weight rows interleaved
SUPER = 8  # blocks a super-block
SUB_BYTES = 256  # a record's integer scales (and mins)
BLOCKS, SUPER_MINS, SUPER_CENTRED, FP8 = 0, 1, 2, 3  # kinds: what a code is, where its d and m come from (cpu_blocks.h)
FORMATS = {(4, BLOCKS), (5, BLOCKS), (8, BLOCKS), (4, SUPER_MINS), (5, SUPER_MINS), (6, SUPER_CENTRED), (8, FP8)}


def code_bytes(bits: int) -> int:
    """Bytes of a group's codes a block: 8 registers of 64 bytes at 8 bits, else 4 and a plane per bit above 4."""
    return 512 if bits == 8 else 256 + 64 * (bits - 4)


@dataclass
class BlockWeights:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    in_features: int  # K
    out_features: int  # N, before padding to whole groups of 16
    levels: int = 1  # of int8 codes the activations are quantized to (2: 15 bits a block)
    kind: int = BLOCKS
    # W8A8 (`pack_codes`' per_token): activations quantized to int8 per token (row), as the format means them,
    # from `cpu_native.w8a8_min_rows()` rows on (`in_per_token`); 8-bit BLOCKS with one d a row and m = -128 d only
    per_token: bool = False
    native: object = field(default=None, repr=False)  # the kernels' view (cpu_native.NativeWeights), made once

    def __post_init__(self):
        if (self.bits, self.kind) not in FORMATS:
            raise ValueError(f"no block kernels for {self.bits}-bit codes of kind {self.kind}")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.offsets))

    def to(self, device: torch.device) -> "BlockWeights":
        if self.codes.device == device:
            return self
        moved = (t.to(device) for t in (self.codes, self.scales, self.offsets))
        return BlockWeights(
            *moved, self.bits, self.in_features, self.out_features, self.levels, self.kind, self.per_token
        )

    @property
    def sub_block(self) -> int:
        """Inputs that share a d and an m."""
        return BLOCK // 2 if self.kind == SUPER_CENTRED else BLOCK


@dataclass
class StackedBlocks:
    """A stacked layer (q/k/v, gate/up) whose shards are stored in different formats (a GGUF Q4_K_M's Q5_0 q and k
    beside a Q8_0 v): each run of shards stored alike one `BlockWeights`, their outputs side by side."""

    parts: list[BlockWeights]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def parts(w: "BlockWeights | StackedBlocks") -> list[BlockWeights]:
    return w.parts if isinstance(w, StackedBlocks) else [w]


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """`[N, blocks, ...]` -> `[groups, blocks, 16, ...]`, rows padded with zeros to whole groups."""
    groups = -(-t.shape[0] // LANES)
    if t.shape[0] % LANES:  # (a pad copies even when it adds nothing)
        t = torch.nn.functional.pad(t, (0,) * (2 * (t.dim() - 1)) + (0, groups * LANES - t.shape[0]))
    return t.view(groups, LANES, *t.shape[1:]).transpose(1, 2)


def _lanes_last(t: torch.Tensor) -> torch.Tensor:
    """`[N, A, B]` -> `[groups, A, B, 16]` contiguous: each entry's 16 rows of a group side by side."""
    return _interleave(t).movedim(2, -1).contiguous()


def _quads(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes `[N, K]` as the 4 bytes each register of a block holds of a row, `uint8 [N, blocks, registers,
    4]`: 8-bit quads in turn, or nibbles of quads t and t + 4 then the high bits' planes (bit t of a plane's byte j:
    input 4t + j)."""
    n, k = codes.shape
    quads = codes.to(torch.uint8).view(n, k // BLOCK, 8, 4)
    if bits == 8:
        return quads
    low = quads & 0xF
    registers = [low[:, :, :4] | (low[:, :, 4:] << 4)]
    weights = (1 << torch.arange(8, dtype=torch.uint8)).view(1, 1, 8, 1)
    for p in range(bits - 4):
        registers.append((((quads >> (4 + p)) & 1) * weights).sum(2, dtype=torch.uint8).unsqueeze(2))
    return torch.cat(registers, dim=2)


def _registers(quads: torch.Tensor) -> torch.Tensor:
    """A row's quads `uint8 [N, blocks, registers, 4]` -> `uint8 [groups, blocks, registers * 64]`, moved as int32s."""
    lanes = _interleave(quads.contiguous().view(torch.int32).squeeze(-1)).transpose(2, 3)  # [groups, b, regs, 16]
    return lanes.contiguous().view(torch.uint8).view(lanes.shape[0], lanes.shape[1], -1)


def _fp16_lanes(t: torch.Tensor) -> torch.Tensor:
    """Per row and block (or super-block) values `[N, B]` -> fp16 `[groups, B * 16]`."""
    groups = -(-t.shape[0] // LANES)
    return _interleave(t.to(torch.float16)).reshape(groups, -1).contiguous()


def pack_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    levels: int = 1,
    per_token: bool = False,
) -> BlockWeights:
    """Weights `w[n, k] = codes[n, k] * scales[n, k // 32] + offsets[n, k // 32]` from unpacked unsigned codes
    `[N, K]` (K a multiple of 32) and per-block scales and offsets `[N, K / 32]`. `per_token`: a W8A8 weight, whose
    activations are int8 per token (`BlockWeights.per_token`): 8-bit codes, each row's scale one value and its
    offset -128 times it, as held (fp16)."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or offsets.shape != scales.shape:
        raise ValueError(f"codes [N, K] need K a multiple of {BLOCK} and [N, K/{BLOCK}] scales, got {codes.shape}")
    w = _pack_quads(_quads(codes, bits), scales, offsets, bits, k, levels)
    if per_token:
        d, m = scales.to(torch.float16).float(), offsets.to(torch.float16).float()
        if bits != 8 or not (torch.equal(d, d[:, :1].expand_as(d)) and torch.equal(m, -128 * d)):
            raise ValueError("per-token (W8A8) weights need 8-bit codes, one scale a row and offsets -128 times it")
        w.per_token = True
    return w


def _pack_quads(
    quads: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, k: int, levels: int
) -> BlockWeights:
    """BLOCKS from a row's quads `uint8 [N, blocks, registers, 4]` and fp16 scales and offsets `[N, blocks]`."""
    registers = _registers(quads)
    codes = registers.view(registers.shape[0], -1)
    return BlockWeights(codes, _fp16_lanes(scales), _fp16_lanes(offsets), bits, k, quads.shape[0], levels)


def pack_super(
    codes: torch.Tensor,
    sub_scales: torch.Tensor,
    sub_mins: torch.Tensor | None,
    d: torch.Tensor,
    dmin: torch.Tensor | None,
    bits: int,
    levels: int = 1,
) -> BlockWeights:
    """K-quant super-blocks of 256 inputs: codes `[N, K]`; with `sub_mins` (SUPER_MINS) `w = q * d * sc - dmin * mn`,
    `sub_scales` and `sub_mins` `uint8 [N, K / 32]`; without (SUPER_CENTRED) `w = (q - 2^(bits-1)) * d * sc`,
    `sub_scales` `int8 [N, K / 16]`. `d`, `dmin` `[N, K / 256]`, fp16 values."""
    n, k = codes.shape
    supers = k // (SUPER * BLOCK)
    if k % (SUPER * BLOCK) or d.shape != (n, supers):
        raise ValueError(f"super-blocks need K a multiple of {SUPER * BLOCK} and [N, K/256] scales, got {codes.shape}")
    kind = SUPER_MINS if sub_mins is not None else SUPER_CENTRED
    blocks = _registers(_quads(codes, bits))  # [groups, k / 32, code bytes]
    groups = blocks.shape[0]
    subs = [sub_scales] if sub_mins is None else [sub_scales, sub_mins]
    sub = torch.cat([_lanes_last(s.contiguous().view(torch.uint8).view(n, supers, -1)) for s in subs], dim=2)
    record = torch.cat([blocks.view(groups, supers, -1), sub.view(groups, supers, SUB_BYTES)], dim=2)
    offsets = _fp16_lanes(-dmin.to(torch.float16)) if dmin is not None else torch.empty(0, dtype=torch.float16)
    return BlockWeights(record.view(groups, -1), _fp16_lanes(d), offsets, bits, k, n, levels, kind)


def pack_fp8(codes: torch.Tensor, scales: torch.Tensor) -> BlockWeights:
    """FP8 weights `w[n, k] = e4m3(codes[n, k]) * scales[n, k // 32]` from `float8_e4m3fn [N, K]` (or its bytes) and
    float32 scales `[N, K / 32]`."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK):
        raise ValueError(f"fp8 codes [N, K] need K a multiple of {BLOCK} and [N, K/{BLOCK}] scales, got {codes.shape}")
    registers = _registers(_quads(codes.view(torch.uint8), 8))
    groups = registers.shape[0]
    d = _interleave(scales.float()).reshape(groups, -1).contiguous()
    return BlockWeights(registers.view(groups, -1), d, d.new_empty(0), 8, k, n, 2, FP8)


def stack_groups(chunks: Iterable[BlockWeights], rows: int) -> BlockWeights:
    """One weight of `rows` rows from consecutive chunks of them (each but the last whole groups of 16), copied into
    tensors allocated once: a weight converted a chunk at a time never holds two copies of itself."""
    chunks = iter(chunks)
    first = next(chunks)
    if first.out_features == rows:
        return first
    groups = -(-rows // LANES)
    full = lambda t: t.new_empty(groups, *t.shape[1:]) if t.numel() else t
    w = BlockWeights(full(first.codes), full(first.scales), full(first.offsets), first.bits, first.in_features, rows,
                     first.levels, first.kind, first.per_token)  # fmt: skip
    start = 0
    for chunk in itertools.chain([first], chunks):
        end = start + chunk.codes.shape[0]
        for target, source in zip((w.codes, w.scales, w.offsets), (chunk.codes, chunk.scales, chunk.offsets)):
            if source.numel():
                target[start:end] = source
        start = end
    return w


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
def dequantized_gemm_torch(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize_blocks(w).to(x.dtype))


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


def _block_codes(w: BlockWeights) -> torch.Tensor:
    """Every group's codes a block, `uint8 [groups, blocks, code_bytes]` (a view: records' scales left out)."""
    blocks, groups = w.in_features // BLOCK, w.codes.shape[0]
    if w.kind in (BLOCKS, FP8):
        return w.codes.view(groups, blocks, -1)
    records = w.codes.view(groups, blocks // SUPER, -1)
    return records[:, :, : SUPER * code_bytes(w.bits)].unflatten(2, (SUPER, -1)).flatten(1, 2)


def unpack_codes(w: BlockWeights, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The codes `[N, K]` (or of rows `rows`) as integers, in input order."""
    rows = torch.arange(w.out_features, device=w.codes.device) if rows is None else rows
    registers = _block_codes(w)[rows // LANES].view(len(rows), w.in_features // BLOCK, -1, LANES, 4)
    registers = registers[torch.arange(len(rows), device=rows.device), :, :, rows % LANES]  # [R, blocks, regs, 4]
    if w.bits == 8:
        return registers.reshape(len(rows), w.in_features)
    quads = torch.cat([registers[:, :, :4] & 0xF, registers[:, :, :4] >> 4], dim=2)  # [R, blocks, 8, 4]
    bit = torch.arange(8, dtype=torch.uint8, device=rows.device).view(1, 1, 8, 1)
    for p in range(w.bits - 4):
        quads = quads | (((registers[:, :, 4 + p, None] >> bit) & 1) << (4 + p))
    return quads.reshape(len(rows), w.in_features)


def factors(w: BlockWeights, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's d and m (`[R, K / w.sub_block]` float32) of rows `rows` (default: all), exactly."""
    rows = torch.arange(w.out_features, device=w.codes.device) if rows is None else rows
    per_row = lambda t: t.view(t.shape[0], -1, LANES)[rows // LANES, :, rows % LANES].float()
    if w.kind in (BLOCKS, FP8):
        d = per_row(w.scales)
        return d, per_row(w.offsets) if w.kind == BLOCKS else torch.zeros_like(d)
    groups, supers = w.codes.shape[0], w.in_features // (SUPER * BLOCK)
    sub = w.codes.view(groups, supers, -1)[:, :, -SUB_BYTES:].view(groups, supers, -1, LANES)
    sub = sub[rows // LANES, :, :, rows % LANES]  # [R, supers, 16]: 8 scales then 8 mins, or 16 scales
    if w.kind == SUPER_MINS:
        sc, mn = sub[:, :, :SUPER].flatten(1).float(), sub[:, :, SUPER:].flatten(1).float()
        return per_row(w.scales).repeat_interleave(SUPER, 1) * sc, per_row(w.offsets).repeat_interleave(SUPER, 1) * mn
    d = per_row(w.scales).repeat_interleave(2 * SUPER, 1) * sub.flatten(1).view(torch.int8).float()
    return d, d * -(2 ** (w.bits - 1))


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
    q = (q.view(torch.float8_e4m3fn) if w.kind == FP8 else q).float().view(len(rows), -1, w.sub_block)
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
    codes = unpack_codes(w).view(n, -1, sub).to(torch.int64)
    dots = torch.einsum("mbj,nbj->mnb", qx_subs, codes).float()
    dx = dx.repeat_interleave(BLOCK // sub, dim=1)
    d, offsets = factors(w)
    sx = dx * qx_subs.sum(-1).float()
    return (dots * (d[None] * dx[:, None])).sum(-1) + sx @ offsets.T
