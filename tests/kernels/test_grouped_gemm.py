"""The grouped GEMM of a mixture of experts' decode step (`tiffin_grouped_gemm`, kernels/csrc/cpu_quant.cpp): each
chosen expert's rows against its weight in one parallel region, every expert's tiles prefetching the next expert's
first rows. Each expert's rows must equal `tiffin_block_gemm` on them alone, bit for bit, and the torch reference of
the block arithmetic to fp32 rounding: odd expert counts, experts no row chose, 1 to 8 rows an expert (top-k 1, 2
and 8 of a decode step's tokens), experts of fewer rows than a tile, an expert of prompt-sized rows (its own
GEMM), at 1 and 2 threads."""

import ctypes

import pytest
import torch
from test_block_gemm import random_blocks

from tiffin.kernels import block_gemm as ig
from tiffin.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: no native kernels")
K = 256


def grouped_gemm(x: torch.Tensor, weights: list[ig.BlockWeights], counts: list[int], levels: int) -> torch.Tensor:
    """Rows of x in expert order, counts[e] of them expert e's, through one tiffin_grouped_gemm call."""
    n = weights[0].out_features
    starts = torch.tensor([0, *counts]).cumsum(0)
    views = [ig.native_weights(w) for w in weights]
    pointers = (ctypes.POINTER(cpu_native.NativeWeights) * len(views))(*map(ctypes.pointer, views))
    y = torch.full((len(x), n), float("nan"))
    code = cpu_native.ACT_DTYPE_CODES[x.dtype]
    failed = cpu_native.library().tiffin_grouped_gemm(
        code, ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(K), ctypes.c_int64(K), pointers,
        ctypes.c_void_p(starts.data_ptr()), ctypes.c_int64(len(weights)), code, ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int64(n), levels, torch.get_num_threads(),
    )  # fmt: skip
    assert failed == 0
    return y


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize(
    "bits, n, counts",
    [
        (4, 96, [1, 0, 1, 1, 0, 1, 0]),  # top-1 of 4 tokens over 7 experts, 6 row groups an expert
        (4, 40, [2, 1, 0, 3, 2]),  # top-2 of 4 tokens, 3 row groups (the last one partial): under a tile
        (8, 64, [1] * 8 + [0] * 3),  # top-8 of one token over 11 experts
        (8, 200, [3, 0, 5, 8, 0, 1, 3, 4, 0]),  # top-8 of 3 tokens, uneven, 13 row groups an expert
        (4, 64, [17, 0, 2]),  # a prompt-sized expert: bf16 dot products at two levels, on its own
    ],
)
def test_each_expert_is_its_block_gemm_alone(bits, n, counts, levels, threads):
    weights = [random_blocks(n, K, bits, seed=e, levels=levels) for e in range(len(counts))]
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(n)) * 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = grouped_gemm(x, weights, counts, levels)
        chosen = [(rows, w) for rows, w in zip(x.split(counts), weights) if len(rows)]
        alone = torch.cat([ig.block_gemm(rows, w) for rows, w in chosen])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, alone)
    want = torch.cat([ig.block_gemm_reference(rows, w) for rows, w in chosen])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
