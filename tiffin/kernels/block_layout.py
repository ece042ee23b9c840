"""The block layout the quantized GEMMs of `tiffin.kernels.block_gemm` read (kernels/csrc/cpu_blocks.h spells it out
for the native kernels, kernels/triton_blocks.py decodes it on GPU): packing a format's codes and factors into it,
and reading them back.

Every weight row is blocks of 32 inputs of unsigned codes `q` of 2 to 8 bits, each block (or half-block) with a
scale `d` and an offset `m`: `w = v(q) * d + m`, `v(q) = q` but for the codebook kinds. Rows are interleaved by 16
(padded with zero rows) so that a vector lane is an output row. Per group and block the registers of 16 rows x 4
inputs (quad t: inputs 4t..4t+3): 8-bit quads 0..7 in turn; below 8 bits, L = 4 low bits (4 to 6 bits) or 2 (2 and
3 bits) of each code in L registers, register r's field f (bits Lf..Lf+L-1 of each byte) holding quad r + Lf, then a
plane per bit above L (bit t of a plane's byte 4l + j: input 4t + j of lane l). A block's codes take 64 bytes a bit.

Kinds (where d and m come from; `sub_bytes(kind)` of integer scales close each super kind's record):
- BLOCKS: `codes` uint8 `[groups, blocks * code_bytes]`, `scales` / `offsets` fp16 `[groups, blocks * 16]`.
- SUPER_MINS (GGUF Q4_K, Q5_K): a record per group and super-block of 256 inputs, its 8 blocks' codes then uint8
  sub-scales `[8][16]` and sub-mins `[8][16]`; `scales` (d) / `offsets` (-dmin) fp16 `[groups, supers * 16]`:
  `d * sc`, `-dmin * mn` a block.
- SUPER_MINS16 (Q2_K): as SUPER_MINS, a byte `sc | mn << 4` a half-block `[16][16]`: `d * sc`, `-dmin * mn` per 16.
- SUPER_CENTRED (Q6_K, Q3_K): records with int8 sub-scales `[16 half-blocks][16]`, `scales` d: a half-block's d is
  `d * sc`, its m `-2^(bits-1)` times that (codes centred).
- CODEBOOK (IQ4_NL): as BLOCKS without offsets: 4-bit codes index `IQ4_VALUES` (int8), held as `v(q) = value +
  128`, so that the integer kernels' u8 x s8 products take them; `m = -128 d`.
- SUPER_CODEBOOK (IQ4_XS): records of 8 blocks of those codes, then int8 sub-scales `[8][16]`; `scales` d: a block's
  d is `d * sc`, its m `-128` times that.
- FP8: 8-bit BLOCKS of e4m3 codes, `scales` fp32 `[groups, blocks * 16]`, `offsets` empty, `w = e4m3(q) * d`.
GGUF's fp16 d and integer sub-scales multiply out exactly in fp32, and so does `v(q) * d + m`: the weight is the one
gguf-py dequantizes, bit for bit.
"""

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

BLOCK = 32
LANES = 16  # weight rows interleaved
SUPER = 8  # blocks a super-block
# kinds: what a code is, where its d and m come from (cpu_blocks.h)
BLOCKS, SUPER_MINS, SUPER_CENTRED, FP8, CODEBOOK, SUPER_CODEBOOK, SUPER_MINS16 = range(7)
FORMATS = {(4, BLOCKS), (5, BLOCKS), (8, BLOCKS), (4, SUPER_MINS), (5, SUPER_MINS), (6, SUPER_CENTRED), (8, FP8)}
FORMATS |= {(4, CODEBOOK), (4, SUPER_CODEBOOK), (3, SUPER_CENTRED), (2, SUPER_MINS16)}
PLAIN = (BLOCKS, FP8, CODEBOOK)  # a group's blocks in turn, no records
HALVES = (SUPER_CENTRED, SUPER_MINS16)  # kinds with a d and an m a half-block
CODEBOOKS = (CODEBOOK, SUPER_CODEBOOK)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # GGUF's IQ4_NL / IQ4_XS


def code_bytes(bits: int) -> int:
    """Bytes of a group's codes a block: 64 a bit (8 registers at 8 bits; L registers and a plane per bit above L)."""
    return 64 * bits


def low_bits(bits: int) -> int:
    """Bits of each code the registers hold as fields (the rest in planes)."""
    return 8 if bits == 8 else 4 if bits >= 4 else 2


def sub_bytes(kind: int) -> int:
    """Bytes of integer scales (and mins) closing a super kind's record: a byte a block or half-block and lane."""
    return 0 if kind in PLAIN else 128 if kind == SUPER_CODEBOOK else 256


def record_bytes(bits: int, kind: int) -> int:
    return code_bytes(bits) if kind in PLAIN else SUPER * code_bytes(bits) + sub_bytes(kind)


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
    # FP8: inputs along a row that share each scale (`scale_run`: the row's K for a scale a row or tensor, 128 for
    # 128 x 128 blocks), and a static activation scale (float32 `[1]`, a checkpoint's `input_scale`) or None (per
    # token, dynamic): what the Triton FP8 GEMM needs (triton_w8a8); the CPU kernels read neither
    scale_inputs: int = BLOCK
    input_scale: torch.Tensor | None = None
    input_zero_points: bool = False  # W8A8 on GPU: asymmetric int8 activations, a zero point a token (triton_w8a8)
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
        moved = {name: getattr(self, name).to(device) for name in ("codes", "scales", "offsets")}
        static = None if self.input_scale is None else self.input_scale.to(device)
        return dataclasses.replace(self, **moved, input_scale=static, native=None)

    @property
    def sub_block(self) -> int:
        """Inputs that share a d and an m."""
        return BLOCK // 2 if self.kind in HALVES else BLOCK


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
    4]`: 8-bit quads in turn, or the low bits' fields then the high bits' planes (see the module's docstring)."""
    n, k = codes.shape
    quads = codes.to(torch.uint8).view(n, k // BLOCK, 8, 4)
    low = low_bits(bits)
    if bits == 8:
        return quads
    fields = (quads & ((1 << low) - 1)).view(n, k // BLOCK, 8 // low, low, 4)  # [.., field, register, 4]
    registers = [(fields << (low * torch.arange(8 // low, dtype=torch.uint8)).view(-1, 1, 1)).sum(2, dtype=torch.uint8)]
    weights = (1 << torch.arange(8, dtype=torch.uint8)).view(1, 1, 8, 1)
    for p in range(bits - low):
        registers.append((((quads >> (low + p)) & 1) * weights).sum(2, dtype=torch.uint8).unsqueeze(2))
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


def pack_codebook(codes: torch.Tensor, scales: torch.Tensor, levels: int = 1) -> BlockWeights:
    """CODEBOOK (IQ4_NL): `w[n, k] = IQ4_VALUES[codes[n, k]] * scales[n, k // 32]`, codes `[N, K]` in 0..15, fp16
    scales `[N, K / 32]`."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK):
        raise ValueError(f"codes [N, K] need K a multiple of {BLOCK} and [N, K/{BLOCK}] scales, got {codes.shape}")
    return _pack_quads(_quads(codes, 4), scales, None, 4, k, levels, CODEBOOK)


def _pack_quads(
    quads: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    k: int,
    levels: int,
    kind: int = BLOCKS,
) -> BlockWeights:
    """BLOCKS (CODEBOOK: no offsets) from a row's quads `uint8 [N, blocks, registers, 4]` and fp16 scales and offsets
    `[N, blocks]`."""
    registers = _registers(quads)
    codes = registers.view(registers.shape[0], -1)
    held = _fp16_lanes(offsets) if offsets is not None else torch.empty(0, dtype=torch.float16)
    return BlockWeights(codes, _fp16_lanes(scales), held, bits, k, quads.shape[0], levels, kind)


def pack_super(
    codes: torch.Tensor,
    sub_scales: torch.Tensor,
    sub_mins: torch.Tensor | None,
    d: torch.Tensor,
    dmin: torch.Tensor | None,
    bits: int,
    levels: int = 1,
    kind: int | None = None,
) -> BlockWeights:
    """K-quant super-blocks of 256 inputs: codes `[N, K]`; with `sub_mins` (SUPER_MINS) `w = q * d * sc - dmin * mn`,
    `sub_scales` and `sub_mins` `uint8 [N, K / 32]`; without (SUPER_CENTRED) `w = (q - 2^(bits-1)) * d * sc`,
    `sub_scales` `int8 [N, K / 16]`; or the `kind` named: SUPER_MINS16 `sub_scales` `uint8 [N, K / 16]` each `sc |
    mn << 4`, with `dmin`; SUPER_CODEBOOK `sub_scales` `int8 [N, K / 32]`. `d`, `dmin` `[N, K / 256]`, fp16 values."""
    n, k = codes.shape
    supers = k // (SUPER * BLOCK)
    if k % (SUPER * BLOCK) or d.shape != (n, supers):
        raise ValueError(f"super-blocks need K a multiple of {SUPER * BLOCK} and [N, K/256] scales, got {codes.shape}")
    kind = kind if kind is not None else SUPER_MINS if sub_mins is not None else SUPER_CENTRED
    blocks = _registers(_quads(codes, bits))  # [groups, k / 32, code bytes]
    groups = blocks.shape[0]
    subs = [sub_scales] if sub_mins is None else [sub_scales, sub_mins]
    sub = torch.cat([_lanes_last(s.contiguous().view(torch.uint8).view(n, supers, -1)) for s in subs], dim=2)
    record = torch.cat([blocks.view(groups, supers, -1), sub.view(groups, supers, sub_bytes(kind))], dim=2)
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
    w = BlockWeights(registers.view(groups, -1), d, d.new_empty(0), 8, k, n, 2, FP8)
    w.scale_inputs = scale_run(scales)
    return w


def scale_run(scales: torch.Tensor) -> int:
    """Inputs along a row that share each scale of per-block scales `[N, K / 32]`: K where each row has one, else
    the longest run of 32 * 2^i inputs, from multiples of it, over which no row's scale changes."""
    blocks = scales.shape[1]
    if torch.equal(scales, scales[:, :1].expand_as(scales)):
        return blocks * BLOCK
    run = 1
    starts = lambda run: torch.arange(blocks, device=scales.device) // run * run  # each block's run's first
    while 2 * run < blocks and torch.equal(scales, scales[:, starts(2 * run)]):
        run *= 2
    return run * BLOCK


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


def _block_codes(w: BlockWeights) -> torch.Tensor:
    """Every group's codes a block, `uint8 [groups, blocks, code_bytes]` (a view: records' scales left out)."""
    blocks, groups = w.in_features // BLOCK, w.codes.shape[0]
    if w.kind in PLAIN:
        return w.codes.view(groups, blocks, -1)
    records = w.codes.view(groups, blocks // SUPER, -1)
    return records[:, :, : SUPER * code_bytes(w.bits)].unflatten(2, (SUPER, -1)).flatten(1, 2)


def unpack_codes(w: BlockWeights, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The codes `[N, K]` (or of rows `rows`) as integers, in input order (a codebook's indices)."""
    rows = torch.arange(w.out_features, device=w.codes.device) if rows is None else rows
    registers = _block_codes(w)[rows // LANES].view(len(rows), w.in_features // BLOCK, -1, LANES, 4)
    registers = registers[torch.arange(len(rows), device=rows.device), :, :, rows % LANES]  # [R, blocks, regs, 4]
    if w.bits == 8:
        return registers.reshape(len(rows), w.in_features)
    low = low_bits(w.bits)
    shifts = (low * torch.arange(8 // low, dtype=torch.uint8, device=rows.device)).view(1, 1, -1, 1, 1)
    fields = (registers[:, :, None, :low] >> shifts) & ((1 << low) - 1)  # [R, blocks, field, register, 4]
    quads = fields.flatten(2, 3)  # quad r + low * f at field f, register r
    bit = torch.arange(8, dtype=torch.uint8, device=rows.device).view(1, 1, 8, 1)
    for p in range(w.bits - low):
        quads = quads | (((registers[:, :, low + p, None] >> bit) & 1) << (low + p))
    return quads.reshape(len(rows), w.in_features)


def code_values(w: BlockWeights, codes: torch.Tensor) -> torch.Tensor:
    """The unsigned integers `v(q)` the kernels multiply for codes `q` (`unpack_codes`): the codes, or for the
    codebook kinds their values + 128 (int32)."""
    if w.kind not in CODEBOOKS:
        return codes.to(torch.int32)
    return (torch.tensor(IQ4_VALUES, dtype=torch.int32, device=codes.device) + 128)[codes.long()]


def factors(w: BlockWeights, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sub-block's d and m (`[R, K / w.sub_block]` float32) of rows `rows` (default: all), exactly."""
    rows = torch.arange(w.out_features, device=w.codes.device) if rows is None else rows
    per_row = lambda t: t.view(t.shape[0], -1, LANES)[rows // LANES, :, rows % LANES].float()
    if w.kind in PLAIN:
        d = per_row(w.scales)
        return d, per_row(w.offsets) if w.kind == BLOCKS else -128 * d if w.kind == CODEBOOK else torch.zeros_like(d)
    groups, supers = w.codes.shape[0], w.in_features // (SUPER * BLOCK)
    sub = w.codes.view(groups, supers, -1)[:, :, -sub_bytes(w.kind) :].view(groups, supers, -1, LANES)
    sub = sub[rows // LANES, :, :, rows % LANES]  # [R, supers, entries]
    per_sub = lambda t: per_row(t).repeat_interleave(sub.shape[2] // (2 if w.kind == SUPER_MINS else 1), 1)
    if w.kind == SUPER_MINS:  # 8 scales then 8 mins
        sc, mn = sub[:, :, :SUPER].flatten(1).float(), sub[:, :, SUPER:].flatten(1).float()
        return per_sub(w.scales) * sc, per_sub(w.offsets) * mn
    if w.kind == SUPER_MINS16:  # sc | mn << 4
        return per_sub(w.scales) * (sub & 15).flatten(1).float(), per_sub(w.offsets) * (sub >> 4).flatten(1).float()
    d = per_sub(w.scales) * sub.flatten(1).view(torch.int8).float()
    return d, d * (-128 if w.kind == SUPER_CODEBOOK else -(2 ** (w.bits - 1)))
