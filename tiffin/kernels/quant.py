"""INT4/INT8 weight-only GEMMs for AWQ, GPTQ and GGUF checkpoints, on the tensors exactly as the tools store them.

AWQ (gemm): `qweight [K, N/8]` int32, output column `c` of a word in nibble `AWQ_NIBBLE[c % 8]` (AutoAWQ
packs columns in the order 0,2,4,6,1,3,5,7); `qzeros [K/G, N/8]` the same way; `scales [K/G, N]`.
GPTQ: `qweight [K*bits/32, N]` packs consecutive input rows low bits first; `qzeros [groups, N*bits/32]` packs
consecutive output columns the same way; format `gptq` stores zeros minus one (`zero_offset=1`), `gptq_v2`
stores them as they are (`zero_offset=0`). Act-order checkpoints are expected here already sorted by group
(the caller repacks rows and passes `perm`: output = x[:, perm] @ W_sorted).

`W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]`, computed in the scales' dtype as the tools do, so the
torch path reproduces the tools' dequantized weights bit for bit. The torch path (CPU, and the reference) dequantizes
one layer's weight per call and drops it: nothing keeps dequantized copies of the model. The Triton path fuses
dequantization into its GEMM below `DENSE_MIN_TOKENS` rows; from there it dequantizes in one pass to x's dtype
(the torch dequantizers' values, bit for bit: codes read once, 2 bytes written per weight for 16-bit x) and
multiplies densely: a layer's weight in x's dtype is the largest buffer either path allocates.

GGUF Q4_0 / Q4_1 / Q8_0 keep llama.cpp's row layout (see `gguf_dequantize`) and its fp32 arithmetic.
"""

import torch

from tiffin.kernels.dispatch import implements, kernel

# From this many rows on the GEMM is compute-bound: the Triton backend dequantizes the weight once (one pass, to x's
# dtype) and multiplies densely (cuBLAS), which beats re-dequantizing tiles in every program of the fused kernel;
# vLLM switches at the same size.
DENSE_MIN_TOKENS = 256
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble of a packed word that holds output column c % 8
QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """`[R, C/8]` int32 -> `[R, C]` int32 codes in 0..15, columns in natural order."""
    # AWQ_NIBBLE[c] = 4 * (c % 2) + c // 2, computed on the device: no host data to upload (which a CUDA graph
    # capture cannot hold: the torch backend's decode graphs dequantize)
    c = torch.arange(8, dtype=torch.int32, device=packed.device)
    shifts = 4 * (4 * (c % 2) + c // 2)
    return ((packed[:, :, None] >> shifts) & 0xF).flatten(1)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight `[K*bits/32, N]` -> codes `[K, N]` (row k in bits `bits*(k % pack)` of word row k // pack)."""
    shifts = bits * torch.arange(32 // bits, dtype=torch.int32, device=packed.device)
    return ((packed[:, None, :] >> shifts[:, None]) & ((1 << bits) - 1)).flatten(0, 1)


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qzeros `[G, N*bits/32]` -> codes `[G, N]`."""
    shifts = bits * torch.arange(32 // bits, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & ((1 << bits) - 1)).flatten(1)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `unpack_rows` (used to repack act-order rows sorted by group)."""
    pack = 32 // bits
    shifts = bits * torch.arange(pack, dtype=torch.int64, device=codes.device)
    words = (codes.to(torch.int64).view(-1, pack, codes.shape[1]) << shifts[:, None]).sum(1)
    # 32 payload bits held in int64: the top bit becomes int32's sign, as in the checkpoints
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes `[K, N]`, zeros/scales `[groups, N]` with groups contiguous along K -> `[K, N]` in scales' dtype."""
    groups, n = scales.shape
    w = codes.view(groups, -1, n) - zeros[:, None]  # exact small integers
    return (w * scales[:, None]).view(-1, n)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[K, N]` weight in the scales' dtype (the group size is implied by the shapes)."""
    return _dequantize(unpack_awq(qweight), unpack_awq(qzeros), scales)


def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, zero_offset: int
) -> torch.Tensor:
    """`[K, N]` weight (rows in the order stored, groups contiguous) in the scales' dtype."""
    return _dequantize(unpack_rows(qweight, bits), unpack_cols(qzeros, bits) + zero_offset, scales)


def gguf_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 / Q8_0 rows -> the weight `[N, K]` in float32, exactly as llama.cpp computes it (`q * s`
    is exact in float32). `qweight`: 4-bit, uint8 `[N, K/2]`, 16 bytes per block of 32 inputs whose low nibbles
    are inputs 0..15 and high nibbles 16..31; 8-bit, int8 `[N, K]`. `scales` (and Q4_1's `mins`) `[N, K/32]`.
    Q4_0 (`bits` 4, no `mins`) centres its codes on 8, Q4_1 adds the minimum: `q * s + m`."""
    n, groups = scales.shape
    if bits == 4:
        packed = qweight.view(n, groups, 16)
        w = torch.cat([packed & 0xF, packed >> 4], dim=-1).float()
        if mins is None:
            w -= 8
    else:
        w = qweight.view(n, groups, 32).float()
    w *= scales.float()[..., None]
    if mins is not None:
        w += mins.float()[..., None]
    return w.view(n, -1)


def awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, backend: str = "torch"
) -> torch.Tensor:
    """`x [M, K]` @ the AWQ weight -> `[M, N]` in x's dtype (fp32 accumulation on the Triton path)."""
    _check_quant_args(x, qweight.shape[0], scales)
    return kernel("awq_gemm", backend)(x, qweight, qzeros, scales)


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    zero_offset: int,
    perm: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """`x [M, K]` @ the GPTQ weight -> `[M, N]`; `perm` (act-order) gathers x's columns into the stored row
    order first."""
    _check_quant_args(x, qweight.shape[0] * 32 // bits, scales)
    return kernel("gptq_gemm", backend)(x, qweight, qzeros, scales, bits, zero_offset, perm)


def gguf_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    backend: str = "torch",
) -> torch.Tensor:
    """`x [M, K]` @ a GGUF Q4_0 / Q4_1 / Q8_0 weight (see `gguf_dequantize`) -> `[M, N]` in x's dtype."""
    _check_quant_args(x, qweight.shape[1] * 8 // bits, scales)
    return kernel("gguf_gemm", backend)(x, qweight, scales, mins, bits)


@implements("awq_gemm", "torch")
def awq_gemm_torch(x, qweight, qzeros, scales) -> torch.Tensor:
    return x @ awq_dequantize(qweight, qzeros, scales).to(x.dtype)


@implements("gptq_gemm", "torch")
def gptq_gemm_torch(x, qweight, qzeros, scales, bits: int, zero_offset: int, perm=None) -> torch.Tensor:
    if perm is not None:
        x = x[:, perm]
    return x @ gptq_dequantize(qweight, qzeros, scales, bits, zero_offset).to(x.dtype)


@implements("gguf_gemm", "torch")
def gguf_gemm_torch(x, qweight, scales, mins, bits: int) -> torch.Tensor:
    return torch.nn.functional.linear(x, gguf_dequantize(qweight, scales, mins, bits).to(x.dtype))


def _check_quant_args(x: torch.Tensor, k: int, scales: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quantized gemm: x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in QUANT_DTYPES or scales.dtype not in QUANT_DTYPES:
        raise ValueError(f"quantized gemm: x and scales must be one of {QUANT_DTYPES}, got {x.dtype}/{scales.dtype}")
