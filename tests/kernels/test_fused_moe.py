"""`kernels.fused_moe` (kernels/fused_moe.py, triton_fused_moe.py): a mixture of experts' weighted sum over each
token's chosen experts.

- The Triton kernel under the interpreter (fp32, fp16) and the torch implementation equal a float64 reference
  written here pair by pair (each (token, choice)'s expert applied to its row, weighted, summed): odd hidden and
  intermediate sizes, top_k 1, 2 and 8, experts no token chose, token counts that are no multiple of BLOCK_M,
  every tile `moe_tile` picks; its buffers NaN-filled, so a row no program wrote shows.
- The sort by expert (`align_by_expert`) places every pair once, in blocks of one expert each, within the padded
  length the host computes from the token count alone.
- Under the CUDA emulation the Triton path is captured in a graph and replays new tokens and routings written in
  place; the torch path (one host read of the experts' counts) makes the capture raise.
- compile_check registers every tile for each dtype (slow: a sample compiles for sm_80 and sm_90 without spills).
"""

import pytest
import torch
from compile_samples import assert_sample_compiles

from tiffin import kernels
from tiffin.kernels import compile_check
from tiffin.kernels import triton_common as tc
from tiffin.kernels.fused_moe import align_by_expert, fused_moe_torch, padded_pairs
from tiffin.kernels.triton_fused_moe import moe_tile
from tiffin.testing.cuda_emulation import EmulatedCudaError

# (tokens, experts, top_k, hidden, intermediate, experts never chosen)
CASES = [
    (1, 8, 2, 64, 32, 0),  # a decode row
    (37, 6, 2, 40, 24, 2),  # 74 pairs: no multiple of 16; two experts idle
    (5, 16, 8, 72, 48, 5),  # top 8 of 11 chosen experts
    (45, 4, 2, 32, 20, 1),  # 90 pairs: the 32-row tile
    (21, 6, 1, 32, 20, 1),
    (130, 2, 2, 48, 16, 0),  # 130 pairs an expert: the 64-row tile
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}  # relative to the output's scale


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def example(tokens, num_experts, top_k, hidden, inter, idle, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, torch.randperm(num_experts, generator=g)[:idle]] = float("-inf")
    weights, experts = logits.softmax(-1).topk(top_k, dim=-1)
    return [t.to(dtype) for t in (x, w13, w2, weights)] + [experts]


def reference(x, w13, w2, weights, experts) -> torch.Tensor:
    """Pair by pair in float64."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for j, e in enumerate(experts[t].tolist()):
            out[t] += weights[t, j] * (w2[e] @ silu_and_mul(w13[e] @ x[t]))
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and not got.isnan().any()
    assert (got.double() - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()


@pytest.fixture
def nan_buffers(monkeypatch):
    monkeypatch.setattr(tc, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-e{}-k{}-h{}-i{}-idle{}".format(*c))
def test_triton_and_torch_equal_the_reference(case, dtype, nan_buffers, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w13, w2, weights, experts = example(*case, dtype)
    want = reference(x, w13, w2, weights, experts)
    act = lambda h: kernels.silu_and_mul(h, "triton")
    assert_close(kernels.fused_moe(x, w13, w2, weights, experts, act, "triton"), want, dtype)
    if dtype == torch.float32:  # CPU torch has no fp16 GEMMs worth testing against
        assert_close(fused_moe_torch(x, w13, w2, weights, experts, silu_and_mul), want, dtype)


def test_the_cases_cover_every_tile():
    tiles = {moe_tile(t * k, e, torch.float16).block_m for t, e, k, *_ in CASES}
    assert tiles == {16, 32, 64}
    assert any((t * k) % 16 for t, _, k, *_ in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-e{}-k{}".format(*c[:3]))
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_by_expert_places_every_pair_once_in_blocks_of_one_expert(case, block_m):
    tokens, num_experts, top_k, *_ = case
    experts = example(*case, torch.float32)[-1]
    sorted_pairs, block_expert = align_by_expert(experts, num_experts, block_m)
    num_pairs = tokens * top_k
    assert len(sorted_pairs) == padded_pairs(num_pairs, num_experts, block_m) == len(block_expert) * block_m
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair once
    flat = experts.flatten()
    for b, e in enumerate(block_expert.tolist()):
        pairs = sorted_pairs[b * block_m : (b + 1) * block_m]
        pairs = pairs[pairs < num_pairs]
        if e < 0:  # past the last expert's blocks: padding only, and no expert's block after it
            assert not len(pairs) and (block_expert[b:] < 0).all()
        else:  # an expert's block holds its pairs (its last one padded), never an idle expert's
            assert len(pairs) and (flat[pairs.long()] == e).all()
    chosen = flat.unique()
    assert sorted(set(block_expert.tolist()) - {-1}) == chosen.tolist()


def test_bad_shapes_are_refused():
    x, w13, w2, weights, experts = example(*CASES[0], torch.float32)
    with pytest.raises(ValueError, match="fused_moe: x .* do not fit"):
        kernels.fused_moe(x[:, :-1], w13, w2, weights, experts, silu_and_mul)
    with pytest.raises(ValueError, match="fused_moe: weights"):
        kernels.fused_moe(x, w13, w2, weights[:, :1], experts, silu_and_mul)


def test_a_graph_replays_new_routing_and_the_torch_path_cannot_be_captured(cuda_emulation):
    """The Triton path captured once replays other tokens and other experts written into its inputs (as a decode
    graph's buffers are); the torch path reads the experts' counts on the host, which a capture refuses."""
    case = (3, 8, 2, 32, 16, 0)
    x, w13, w2, weights, experts = (t.cuda() for t in example(*case, torch.float32))
    act = lambda h: kernels.silu_and_mul(h, "triton")
    run = lambda: kernels.fused_moe(x, w13, w2, weights, experts, act, "triton")
    run()  # eager first, as `DecodeGraphs.capture` does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2):
        new = example(*case, torch.float32, seed=seed)
        new[1:3] = w13.cpu(), w2.cpu()  # the weights stay
        for buffer, value in zip((x, weights, experts), (new[0], new[3], new[4])):
            buffer.copy_(value.cuda())
        graph.replay()
        assert_close(out.cpu(), reference(*new), torch.float32)
    with pytest.raises(EmulatedCudaError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            kernels.fused_moe(x, w13, w2, weights, experts, act, "torch")


def test_compile_check_registers_every_tile():
    configs = {case.config for _, case in compile_check.collect(80, ["fused_moe"])}
    for dtype in ("float32", "float16", "bfloat16"):
        for tokens in (1, 512, 2048):  # decode, mid and prefill-sized tiles, both GEMMs
            assert sum(c.startswith(dtype) and c.endswith(f"tokens={tokens}") for c in configs) == 2


SAMPLE = [
    "float32 tile=16x32x32 gate_up tokens=1",
    "float32 tile=64x32x32 down tokens=2048",
    "bfloat16 tile=16x64x64 down tokens=1",
    "float16 tile=64x64x32 gate_up tokens=2048",
]


@pytest.mark.slow
@pytest.mark.subprocess
def test_compile_check_compiles_a_sample():
    """A sample compiles for sm_80 and sm_90 without spills (every case, every arch: `python -m
    tiffin.kernels.compile_check --kernels fused_moe`)."""
    assert_sample_compiles(["fused_moe"], SAMPLE)
