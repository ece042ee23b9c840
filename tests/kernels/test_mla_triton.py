"""The Triton latent-attention decode (kernels/triton_mla.py) under the interpreter, fp32 and fp16: decode rows of
several context lengths (one token, within a block, across many) over a latent cache with scrambled block tables,
heads no multiple of the kernel's 16 and a rank no power of two, equal a float64 MLA written here with the keys
and values expanded per head, and the torch implementation; its output buffer NaN-filled, so an unwritten row
shows. Captured in a graph under the CUDA emulation, it replays other contexts written in place (the torch
implementation, planned on the host, makes the capture raise). compile_check
registers DeepSeek-V3's latent for the 16-bit dtypes (fp32 past rank 128 decodes by the torch plan)."""

import pytest
import torch

from tiffin import kernels
from tiffin.kernels import compile_check
from tiffin.kernels import triton_common as tc
from tiffin.kernels.attention import AttentionMetadata
from tiffin.kernels.mla import decodes_on_triton, mla_attention_torch
from tiffin.testing.cuda_emulation import EmulatedCudaError

HEADS, NOPE, ROPE, RANK, V_DIM, BLOCK = 20, 16, 8, 24, 12, 4
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}


def example(dtype: torch.dtype, seq_lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-max(seq_lens) // BLOCK)
    tables = torch.randperm(len(seq_lens) * blocks + 3, generator=g)[: len(seq_lens) * blocks].view(len(seq_lens), -1)
    cache = torch.randn(len(seq_lens) * blocks + 3, BLOCK, 1, RANK + ROPE, generator=g)
    q_nope, q_pe = (
        torch.randn(len(seq_lens), HEADS, NOPE, generator=g),
        torch.randn(len(seq_lens), HEADS, ROPE, generator=g),
    )
    w_uk, w_uv = torch.randn(HEADS, NOPE, RANK, generator=g) / 4, torch.randn(HEADS, V_DIM, RANK, generator=g) / 4
    rows = len(seq_lens)
    md = AttentionMetadata(
        slot_mapping=torch.full((rows,), -1),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        query_start_loc_cpu=list(range(rows + 1)),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    tensors = [t.to(dtype) for t in (q_nope, q_pe, cache)]
    return tensors[:2] + [tensors[2], md, 0.3] + [w.to(dtype) for w in (w_uk, w_uv)]


def reference(q_nope, q_pe, cache, md, scale, w_uk, w_uv) -> torch.Tensor:
    """Each row against its context's keys [W_UK c, k_pe] and values W_UV c, expanded per head, in float64."""
    out = []
    for i, length in enumerate(md.seq_lens_cpu):
        slots = torch.arange(length)
        latent = cache[md.block_tables[i, slots // BLOCK].long(), slots % BLOCK, 0].double()
        c, k_pe = latent.split([RANK, ROPE], -1)
        keys = torch.cat([torch.einsum("lr,hnr->hln", c, w_uk.double()), k_pe.expand(HEADS, -1, -1)], -1)
        values = torch.einsum("lr,hvr->hlv", c, w_uv.double())
        query = torch.cat([q_nope[i], q_pe[i]], -1).double()
        weights = (torch.einsum("hd,hld->hl", query, keys) * scale).softmax(-1)
        out.append(torch.einsum("hl,hlv->hv", weights, values))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_equals_the_reference(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tc, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
    args = example(dtype, [1, 3, 17, 40, 9])
    want = reference(*args)
    for got in (kernels.mla_attention(*args, backend="triton"), mla_attention_torch(*args)):
        assert got.dtype == dtype and not got.isnan().any()
        assert (got.double() - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()


def test_a_graph_replays_other_contexts(cuda_emulation):
    q_nope, q_pe, cache, md, scale, w_uk, w_uv = example(torch.float32, [5, 30])
    on_device = lambda t: t.cuda()
    q_nope, q_pe, cache, w_uk, w_uv = map(on_device, (q_nope, q_pe, cache, w_uk, w_uv))
    md.seq_lens, md.block_tables = md.seq_lens.cuda(), md.block_tables.cuda()
    md.slot_mapping, md.query_start_loc = md.slot_mapping.cuda(), md.query_start_loc.cuda()
    md.seq_lens_cpu = [1, 1]  # what a capture is told (`DecodeGraphs.capture`): the kernel reads the device's
    run = lambda: kernels.mla_attention(q_nope, q_pe, cache, md, scale, w_uk, w_uv, backend="triton")
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed, lengths in ((1, [12, 2]), (2, [30, 29])):
        new = example(torch.float32, lengths, seed)
        new[2] = cache.cpu()  # a graph's cache is the pool's; the tables and lengths change
        new[3].block_tables = md.block_tables.cpu()
        for buffer, value in zip((q_nope, q_pe, md.seq_lens), (new[0], new[1], new[3].seq_lens)):
            buffer.copy_(value.cuda())
        new[5:] = w_uk.cpu(), w_uv.cpu()
        graph.replay()
        want = reference(*new)
        assert (out.cpu().double() - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(EmulatedCudaError, match="inside a CUDA graph capture"):  # the torch plan's host lists
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            kernels.mla_attention(q_nope, q_pe, cache, md, scale, w_uk, w_uv, backend="torch")


def test_compile_check_registers_the_latents_the_kernel_takes():
    configs = {case.config for _, case in compile_check.collect(80, ["mla_attention"])}
    assert {"bfloat16 rank=512 rope=64", "float16 rank=512 rope=64", "float32 rank=128 rope=32"} <= configs
    assert "float32 rank=512 rope=64" not in configs and not decodes_on_triton(512, torch.float32)
