"""Multi-LoRA shrink / expand: the torch path and the Triton kernels (under the interpreter) against a
per-adapter reference loop in float64. Their compile_check configurations are compiled with every other
kernel's by test_kernels_attention.py::test_compile_check_every_arch.

Interpreter setup as in test_kernels_attention.py: TRITON_INTERPRET=1 only while this module's kernel tests
run (the launcher reads it at call time)."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiffin.kernels import triton_common as tc
from tiffin.kernels import triton_lora as tlora
from tiffin.kernels.lora import LoRAMetadata, group_by_slot, lora_apply, lora_expand, lora_shrink
from tiffin.kernels.row_buckets import padded_tokens

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the Triton path allocates (shrink output, split partials) starts as NaN."""
    monkeypatch.setattr(
        tc, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


def make_case(token_slots, hidden, rank, slice_sizes, num_slots, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, n, o = len(token_slots), len(slice_sizes) * rank, sum(slice_sizes)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    a = (torch.randn(num_slots, n, hidden, generator=g) / hidden**0.5).to(dtype)
    b = (torch.randn(num_slots, rank, o, generator=g) / rank**0.5).to(dtype)
    y = torch.randn(t, o, generator=g).to(dtype)
    offsets = [0, *np.cumsum(slice_sizes).tolist()]
    return x, a, b, y, offsets, LoRAMetadata.build(np.array(token_slots), torch.device("cpu"), dtype)


def reference(x, a, b, y, offsets, token_slots):
    """float64, one adapter at a time: its tokens' rows through its A, then each slice through its B."""
    x, a, b, y = x.double(), a.double(), b.double(), y.double().clone()
    r = b.shape[1]
    slots = torch.tensor(token_slots)
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for s in sorted(set(token_slots) - {-1}):
        rows = slots == s
        h[rows] = x[rows] @ a[s].T
        for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            y[rows, lo:hi] += h[rows, i * r : (i + 1) * r] @ b[s, :, lo:hi]
    return h, y, slots >= 0


CASES = {
    # name: (token slots, hidden, rank, slice sizes, slots)
    "decode-mixed": ([0, -1, 2, 0, 1, -1, 2, 2], 64, 16, [64, 32, 32], 4),
    "one-slot": ([1] * 5, 96, 8, [48], 2),
    "prefill-groups": ([3] * 40 + [-1] * 7 + [0] * 19 + [3] * 5 + [1] * 70, 128, 16, [80, 80], 4),
    "odd-sizes": ([0, 1, -1, 1, 0, 0, 1], 40, 4, [24, 8, 8], 3),
    "skewed": ([2] * 60 + [0, 1, -1, 0], 64, 16, [64, 32, 32], 3),  # torch path: one GEMM per group
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_shrink_expand_match_per_adapter_loop(case, dtype, backend, interpreter, poisoned):
    token_slots, hidden, rank, slices, num_slots = CASES[case]
    x, a, b, y, offsets, md = make_case(token_slots, hidden, rank, slices, num_slots, dtype)
    assert md.padded == (case != "skewed")
    h_ref, y_ref, adapted = reference(x, a, b, y, offsets, token_slots)
    h = lora_shrink(x, a, md, backend)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(h[adapted].double(), h_ref[adapted], rtol=tol, atol=tol)
    base_rows = y[~adapted].clone()
    out = lora_expand(h_ref.to(dtype), b, y, offsets, md, backend)
    assert out is y
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    assert torch.equal(y[~adapted], base_rows)  # base-model tokens are never touched


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_apply_matches_per_adapter_loop(case, dtype, backend, interpreter, poisoned):
    """Shrink and expand in one call (the torch path keeps the padded layout in between)."""
    token_slots, hidden, rank, slices, num_slots = CASES[case]
    x, a, b, y, offsets, md = make_case(token_slots, hidden, rank, slices, num_slots, dtype, seed=1)
    _, y_ref, adapted = reference(x, a, b, y, offsets, token_slots)
    base_rows = y[~adapted].clone()
    assert lora_apply(x, a, b, y, offsets, md, backend) is y
    # fp16 rounds the shrink result before expand as the reference does not: a looser bound
    tol = TOLERANCE[dtype] * (2 if dtype == torch.float16 else 1)
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    assert torch.equal(y[~adapted], base_rows)


class GemmRows(TorchDispatchMode):
    """The row counts of every mm / bmm run under it."""

    def __init__(self):
        super().__init__()
        self.rows = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
            self.rows.add(args[0].shape[-2])
        return func(*args, **(kwargs or {}))


def test_half_precision_gemms_run_bucketed_row_counts():
    """At bf16 oneDNN keeps a kernel per GEMM row count: the torch path's shrink, expand and apply run only
    `padded_tokens` row counts (fp32, left to MKL, runs the real ones), with the results of the fp32 path."""
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        rows[dtype] = set()
        for token_slots, hidden, rank, slices, num_slots in CASES.values():
            x, a, b, y, offsets, md = make_case(token_slots, hidden, rank, slices, num_slots, dtype)
            _, y_ref, _ = reference(x, a, b, y, offsets, token_slots)
            with GemmRows() as gemms:
                h = lora_shrink(x, a, md)
                out = lora_expand(h, b, y.clone(), offsets, md)
                lora_apply(x, a, b, y, offsets, md)
            rows[dtype] |= gemms.rows
            tol = 2 * TOLERANCE[dtype]  # bf16: the shrink result rounded before expand
            torch.testing.assert_close(out.double(), y_ref, rtol=tol, atol=tol)
            torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    assert {padded_tokens(n) for n in rows[torch.bfloat16]} == rows[torch.bfloat16]
    assert {padded_tokens(n) for n in rows[torch.float32]} != rows[torch.float32]  # e.g. the 60-token group


@pytest.mark.parametrize("case", ["decode-mixed", "odd-sizes"])
def test_graphed_metadata_over_stale_buffers(case, interpreter, poisoned):
    """A decode graph's metadata (`graphed_over`): fixed-size buffers, every slot in the grid (some empty, one
    never used), token entries past the groups left from an earlier step; the kernels read only the groups."""
    token_slots, hidden, rank, slices, num_slots = CASES[case]
    x, a, b, y, offsets, _ = make_case(token_slots, hidden, rank, slices, num_slots + 1, torch.float32, seed=2)
    _, y_ref, adapted = reference(x, a, b, y, offsets, token_slots)
    tokens, starts, counts = group_by_slot(np.array(token_slots), num_slots + 1)
    stale = torch.full((len(token_slots),), len(token_slots) - 1)
    stale[: len(tokens)] = torch.from_numpy(tokens)
    md = LoRAMetadata.graphed_over(stale, torch.from_numpy(starts), torch.from_numpy(counts))
    assert md.num_slots == num_slots + 1 and md.max_slot_tokens == len(token_slots) and md.graphed
    lora_apply(x, a, b, y, offsets, md, "triton")
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)


SPLIT_CASES = {
    # name: token slots (3 slots; N = 3 x 24 = 72 columns: ragged N tiles in fp32 and fp16)
    "decode": [0, 2, -1, 2, 0],  # 16-row tiles
    "ragged": [1] * 40 + [0, -1, 2] + [1] * 30 + [0] * 4,  # slot 1: 70 rows, two 64-row tiles, the second ragged
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=list(SPLIT_CASES))
def test_shrink_split_k(case, splits, dtype, interpreter, poisoned):
    """Forced K splits (K = 360: a ragged last split) over several slots. The last split of each tile sums the
    partials into `out` in the kernel: launched again onto NaN output and partials, as a graph replays it, the tile
    counters were reset and the second launch writes the same result (the partials are summed in split order)."""
    token_slots = SPLIT_CASES[case]
    x, a, _, _, _, md = make_case(token_slots, 360, 24, [24, 24, 24], 3, dtype, seed=3)
    out = torch.full((x.shape[0], a.shape[1]), float("nan"), dtype=dtype)
    launch, partial = tlora.shrink_launch(x, a, out, md, splits=splits)
    assert (partial is None) == (splits == 1) and launch.grid[1] == (1 if partial is None else partial.shape[0])
    launch(x.device)
    first = out.clone()
    out.fill_(float("nan"))
    if partial is not None:
        partial.fill_(float("nan"))
    launch(x.device)
    rows = torch.tensor(token_slots) >= 0
    assert torch.equal(out[rows], first[rows])
    h_ref = reference(x, a, torch.zeros(3, 24, 72), torch.zeros(len(token_slots), 72), [0, 24, 48, 72], token_slots)[0]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[rows].double(), h_ref[rows], rtol=tol, atol=tol)


def test_split_k_shrink_is_one_launch(cuda_emulation, poisoned):
    """Captured in a decode graph, a split-K shrink is one kernel: nothing sums the partials after it."""
    token_slots = [0, 1, -1, 1]
    x, a, _, _, _, md = make_case(token_slots, 512, 16, [16, 16], 2, torch.float32, seed=4)
    x, a = x.cuda(), a.cuda()
    md = LoRAMetadata.build(np.array(token_slots), x.device, torch.float32)
    launch, partial = tlora.shrink_launch(x, a, torch.empty(4, 32, device=x.device), md)
    assert partial is not None and partial.shape[0] > 1  # the dispatcher's own choice splits K
    h = lora_shrink(x, a, md, "triton")  # eager first, as the engine does: the tile counters exist before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = lora_shrink(x, a, md, "triton")
    kernels = [k for k in graph.kernels() if k != "aten.full.default"]  # `poisoned` NaN-fills the allocations
    assert kernels == ["_lora_shrink_kernel"], graph.kernels()
    h.fill_(float("nan"))
    graph.replay()
    h_ref = reference(x.cpu(), a.cpu(), torch.zeros(2, 16, 32), torch.zeros(4, 32), [0, 16, 32], token_slots)[0]
    rows = torch.tensor(token_slots) >= 0
    torch.testing.assert_close(h.cpu()[rows].double(), h_ref[rows], rtol=1e-4, atol=1e-4)


def test_bf16_torch_path():
    token_slots = [0, -1, 1, 1]
    x, a, b, y, offsets, md = make_case(token_slots, 64, 16, [64], 2, torch.bfloat16)
    h_ref, y_ref, _ = reference(x, a, b, y, offsets, token_slots)
    lora_expand(lora_shrink(x, a, md), b, y, offsets, md)
    torch.testing.assert_close(y.double(), y_ref, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_adapters_over_bf16_outputs(backend, interpreter):
    """The engine on CPU keeps adapters in fp32 over a bf16 model: expand adds into a bf16 y."""
    token_slots = [1, -1, 0, 1, 0, -1]
    x, a, b, y, offsets, md = make_case(token_slots, 64, 16, [32, 16, 16], 2, torch.float32)
    y = y.to(torch.bfloat16)
    _, y_ref, adapted = reference(x, a, b, y, offsets, token_slots)
    base_rows = y[~adapted].clone()
    lora_expand(lora_shrink(x, a, md, backend), b, y, offsets, md, backend)
    assert y.dtype == torch.bfloat16 and torch.equal(y[~adapted], base_rows)
    torch.testing.assert_close(y.double(), y_ref, rtol=8e-3, atol=1e-2)  # one bf16 rounding


def test_metadata_groups_tokens_by_slot():
    md = LoRAMetadata.build(np.array([2, -1, 0, 2, -1, 0, 0]), torch.device("cpu"), torch.float32)
    assert md.num_slots == 3 and md.max_slot_tokens == 3
    assert md.slot_counts.tolist() == [3, 0, 2] and md.slot_starts.tolist() == [0, 3, 3]
    assert md.sorted_tokens.tolist() == [2, 5, 6, 0, 3]
    assert md.groups == [(0, 0, 3), (2, 3, 5)] and md.padded and md.active_slots.tolist() == [0, 2]
    assert md.padded_tokens.tolist() == [2, 5, 6, 0, 3, 3] and md.padded_real.tolist() == [0, 1, 2, 3, 4]
    assert md.pad_mask.flatten().tolist() == [1, 1, 1, 1, 1, 0]
    assert md.token_rows.tolist() == [3, 5, 0, 4, 5, 1, 2]  # base tokens read the zeroed padding row 5
    even = LoRAMetadata.build(np.array([0, -1, 1]), torch.device("cpu"), torch.float32)
    assert even.pad_width == 2 and even.token_rows.tolist() == [0, 1, 2]  # widened to make a padding row
    skewed = LoRAMetadata.build(np.array([0] * 9 + [1, 2]), torch.device("cpu"), torch.float32)
    assert not skewed.padded and skewed.groups == [(0, 0, 9), (1, 9, 10), (2, 10, 11)]
    with pytest.raises(ValueError, match="at least one token"):
        LoRAMetadata.build(np.array([-1, -1]), torch.device("cpu"), torch.float32)


def test_bad_shapes_rejected():
    x, a, b, y, offsets, md = make_case([0, 1], 32, 8, [16, 16], 2, torch.float32)
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(x[:, :16], a, md)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_expand(torch.zeros(2, 16), b, y, [0, 16, 24], md)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x, a[:1], md)
