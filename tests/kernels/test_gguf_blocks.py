"""GGUF's quantized types decoded into the block layout (`tiffin.quant.gguf_blocks`): the weight the layout holds
against gguf-py's own dequantization, bit for bit, for every type kept quantized, and the native GEMM on it against
float64 algebra on that dequantized weight."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from tiffin.kernels import block_gemm as ig
from tiffin.quant import gguf_blocks

# type -> byte offsets of its fp16 fields in a block (d, and dmin or m)
HALF_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.Q3_K: (108,),
    QType.Q2_K: (80, 82),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
}
assert HALF_FIELDS.keys() == gguf_blocks.DECODERS.keys()


def random_rows(qtype: QType, n: int, k: int, seed: int) -> np.ndarray:
    """Rows of random blocks: random bytes, fp16 fields random finite values of a weight's magnitude (signed: a
    negative minimum or scale is as valid as a positive one)."""
    g = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = g.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        rows[..., at : at + 2] = (g.standard_normal((n, k // block, 1)) * 1e-2).astype(np.float16).view(np.uint8)
    return rows.reshape(n, -1)


@pytest.mark.parametrize("qtype", list(gguf_blocks.DECODERS), ids=lambda t: t.name)
def test_the_layout_holds_gguf_py_s_dequantized_weight(qtype):
    """Odd row counts (partial groups of 16) and inputs of one and of several blocks or super-blocks."""
    block = GGML_QUANT_SIZES[qtype][0]
    for n, k in [(37, 512), (5, block), (19, 3 * block)]:
        rows = random_rows(qtype, n, k, seed=int(qtype) + n)
        want = torch.from_numpy(gguf.dequantize(rows, qtype))
        blocks = gguf_blocks.to_blocks(torch.from_numpy(rows), qtype)
        assert torch.equal(ig.dequantize_blocks(blocks), want)
        ids = torch.tensor([n - 1, 0, n // 2, n // 2])
        assert torch.equal(ig.dequantize_blocks(blocks, ids), want[ids])  # natively where it is built


# bits a weight the layout holds of the types below 4 bits and IQ4's, against the file's 3.4375, 2.625, 4.5, 4.25
LAYOUT_BITS = {QType.Q3_K: 3.5625, QType.Q2_K: 2.625, QType.IQ4_NL: 4.5, QType.IQ4_XS: 4.3125}


@pytest.mark.parametrize("qtype", list(LAYOUT_BITS), ids=lambda t: t.name)
def test_the_layout_holds_close_to_the_file_s_bytes(qtype):
    rows = torch.from_numpy(random_rows(qtype, 64, 768, seed=2))
    blocks = gguf_blocks.to_blocks(rows, qtype)
    assert blocks.nbytes * 8 == LAYOUT_BITS[qtype] * 64 * 768 and blocks.nbytes <= 1.04 * rows.nbytes


def test_big_tensors_decode_a_chunk_of_rows_at_a_time(monkeypatch):
    rows = random_rows(QType.Q6_K, 70, 256, seed=1)
    whole = gguf_blocks.to_blocks(torch.from_numpy(rows), QType.Q6_K)
    monkeypatch.setattr(gguf_blocks, "ROW_CHUNK_BYTES", 210 * 20)  # 16 rows a chunk: 5 chunks, the last partial
    chunked = gguf_blocks.to_blocks(torch.from_numpy(rows), QType.Q6_K)
    assert all(torch.equal(a, b) for a, b in zip((whole.codes, whole.scales), (chunked.codes, chunked.scales)))
    assert torch.equal(ig.dequantize_blocks(chunked), torch.from_numpy(gguf.dequantize(rows, QType.Q6_K)))


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("qtype", list(gguf_blocks.DECODERS), ids=lambda t: t.name)
def test_the_gemm_on_decoded_rows_is_the_product_with_gguf_py_s_weight(qtype, levels):
    """Within the activations' rounding: one level of int8 codes ~1% of the output's scale, two ~1e-4, bf16 operands
    (two levels, prompt-sized steps) ~0.3%."""
    rows = random_rows(qtype, 40, 768, seed=int(qtype) + levels)
    weight = torch.from_numpy(gguf.dequantize(rows, qtype)).double()
    blocks = gguf_blocks.to_blocks(torch.from_numpy(rows), qtype, levels)
    for m in (1, 5, 64):
        x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
        want = x.double() @ weight.T
        got = ig.block_gemm(x, blocks).double()
        tolerance = 2e-2 if levels == 1 or ig.in_bf16(x, blocks) else 2e-3
        assert (got - want).abs().max() <= tolerance * want.abs().max()
