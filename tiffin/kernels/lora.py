"""Multi-LoRA ops: `lora_shrink` / `lora_expand` apply a different adapter to each token of one flattened batch.

Adapters sit in `S` device slots. Per layer:
- `a_stack [S, N, K]`: slot s's A rows. A fused layer (qkv, gate_up) with `n` slices keeps slice i's A in rows
  `i*R:(i+1)*R`, so `N = n*R` (R: the slot rank; smaller ranks are zero-padded).
- `b_stack [S, R, O]`: slot s's B, transposed (a slice's outputs are then a column block, and rows run along
  the outputs as the GEMMs want them); output o of slice i reads the shrink result's columns `i*R:(i+1)*R`.
  Scaling is folded into B.

`lora_shrink(x, a) -> h [T, N]` (h[t] = A[slot_t] x[t]); `lora_expand(h, b, y)` adds B[slot_t] h[t] to `y` in
place. Tokens of slot -1 (the base model) are untouched by expand; their rows of `h` are undefined.

Both paths group tokens by slot (Punica's segmented GEMM, SGMV). The Triton kernels run one program per tile
of one slot's tokens. The torch path picks per call, from host-side sizes: when groups are of similar size
(decode) it pads every group to the largest and runs one batched GEMM (`bmm`) over the slots, a handful of ops
however many adapters mix; when one group dwarfs the others (a long prefill chunk beside decodes), padding
would multiply the work, so it runs one GEMM per slot on the tokens gathered in slot order.
"""

from dataclasses import dataclass

import numpy as np
import torch

PAD_LIMIT = 2  # the torch path pads groups while that costs at most this many times the real rows


@dataclass
class LoRAMetadata:
    """Which slot each token of a step uses, grouped by slot. Built once per step, read by every layer."""

    num_tokens: int
    sorted_tokens: torch.Tensor  # [T'] int64: indices of the tokens with an adapter, grouped by slot
    slot_starts: torch.Tensor  # [num_slots] int32: where slot s's tokens start in sorted_tokens
    slot_counts: torch.Tensor  # [num_slots] int32
    num_slots: int  # slots 0..num_slots-1 may be used: the kernels' grid, how far the stacks are read
    max_slot_tokens: int  # tokens of the largest group (sizes the kernels' grids)
    # torch path, host-side choices
    groups: list[tuple[int, int, int]]  # (slot, start, end) in sorted_tokens, one per slot with tokens
    padded: bool  # pad the groups into one bmm (else one GEMM per group)
    active_slots: torch.Tensor | None  # [G] int64 slots of the groups, None when they are 0..G-1
    padded_tokens: torch.Tensor | None  # [G * max_slot_tokens] int64: group g's tokens, its last repeated
    padded_real: torch.Tensor | None  # [T'] int64: where the real rows sit in that padded layout
    pad_mask: torch.Tensor | None  # [G, max_slot_tokens, 1]: 1 for real rows, 0 for repeats

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device, dtype: torch.dtype) -> "LoRAMetadata":
        """`token_slots [T]`: slot per token, -1 for the base model. At least one token must use a slot."""
        slots = np.asarray(token_slots, dtype=np.int64)
        used = slots[slots >= 0]
        if used.size == 0:
            raise ValueError("LoRAMetadata needs at least one token with an adapter slot")
        num_slots = int(used.max()) + 1
        counts = np.bincount(used, minlength=num_slots)
        starts = np.cumsum(counts) - counts
        order = np.argsort(slots, kind="stable")[slots.size - used.size :]  # -1s sort first
        active = np.flatnonzero(counts)
        width = int(counts.max())
        groups = [(int(s), int(starts[s]), int(starts[s] + counts[s])) for s in active]
        padded = len(groups) * width <= PAD_LIMIT * used.size
        to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(device, dt)  # noqa: E731
        md = cls(int(slots.size), to(order, torch.int64), to(starts, torch.int32), to(counts, torch.int32),
                 num_slots, width, groups, padded, None, None, None, None)  # fmt: skip
        if padded:
            # position j of group g holds its token min(j, count-1): repeats of a real row, masked in expand
            pos = np.minimum(np.arange(width)[None, :], counts[active, None] - 1) + starts[active, None]
            real = np.arange(width)[None, :] < counts[active, None]
            md.padded_tokens = to(order[pos].reshape(-1), torch.int64)
            md.padded_real = to(np.flatnonzero(real), torch.int64)
            md.pad_mask = to(real[:, :, None], dtype)
            if not np.array_equal(active, np.arange(len(active))):
                md.active_slots = to(active, torch.int64)
        return md


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata, backend: str = "torch") -> torch.Tensor:
    """`x [T, K]`, `a_stack [S, N, K]` -> `[T, N]` in x's dtype: each token times its slot's A."""
    _check_shrink(x, a_stack, md)
    if backend == "triton":
        from tiffin.kernels.triton_lora import lora_shrink_triton

        return lora_shrink_triton(x, a_stack, md)
    return lora_shrink_torch(x, a_stack, md)


def lora_expand(h: torch.Tensor, b_stack: torch.Tensor, y: torch.Tensor, slice_offsets: list[int],
                md: LoRAMetadata, backend: str = "torch") -> torch.Tensor:
    """`y[t, o] += B[slot_t][o] . h[t, slice(o)*R : slice(o)*R + R]` in place; returns `y`.
    `slice_offsets`: output boundaries of the slices, `[0, O_0, O_0+O_1, ..., O]`."""
    _check_expand(h, b_stack, y, slice_offsets, md)
    if backend == "triton":
        from tiffin.kernels.triton_lora import lora_expand_triton

        lora_expand_triton(h, b_stack, y, slice_offsets, md)
        return y
    return lora_expand_torch(h, b_stack, y, slice_offsets, md)


def lora_shrink_torch(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata) -> torch.Tensor:
    h = x.new_empty(x.shape[0], a_stack.shape[1])
    if md.padded:
        xs = x.index_select(0, md.padded_tokens).view(len(md.groups), md.max_slot_tokens, -1)
        hs = torch.bmm(xs, _slots(a_stack, md).transpose(1, 2)).flatten(0, 1)
        return h.index_copy_(0, md.sorted_tokens, hs.index_select(0, md.padded_real))
    xs, hs = x.index_select(0, md.sorted_tokens), h.new_empty(md.sorted_tokens.shape[0], h.shape[1])
    for slot, start, end in md.groups:
        torch.mm(xs[start:end], a_stack[slot].T, out=hs[start:end])
    return h.index_copy_(0, md.sorted_tokens, hs)


def lora_expand_torch(h: torch.Tensor, b_stack: torch.Tensor, y: torch.Tensor, slice_offsets: list[int],
                      md: LoRAMetadata) -> torch.Tensor:
    r, pieces = b_stack.shape[1], list(zip(slice_offsets, slice_offsets[1:]))
    if md.padded:
        hs = h.index_select(0, md.padded_tokens).view(len(md.groups), md.max_slot_tokens, -1) * md.pad_mask
        b = _slots(b_stack, md)
        if len(pieces) == 1:
            out = torch.bmm(hs, b)
        else:  # slice by slice into one contiguous buffer: index_add_ into column slices of y is far slower
            out = y.new_empty(*hs.shape[:2], y.shape[1])
            for i, (lo, hi) in enumerate(pieces):
                out[:, :, lo:hi] = torch.bmm(hs[:, :, i * r : (i + 1) * r], b[:, :, lo:hi])
        return y.index_add_(0, md.padded_tokens, out.flatten(0, 1))  # repeated rows add exact zeros
    hs, ys = h.index_select(0, md.sorted_tokens), y.new_empty(md.sorted_tokens.shape[0], y.shape[1])
    for slot, start, end in md.groups:
        for i, (lo, hi) in enumerate(pieces):
            ys[start:end, lo:hi] = hs[start:end, i * r : (i + 1) * r] @ b_stack[slot, :, lo:hi]
    return y.index_add_(0, md.sorted_tokens, ys)


def _slots(stack: torch.Tensor, md: LoRAMetadata) -> torch.Tensor:
    """The stack rows of the groups' slots, in group order (a view when they are the first slots)."""
    return stack[: len(md.groups)] if md.active_slots is None else stack.index_select(0, md.active_slots)


def _check_shrink(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata) -> None:
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"lora_shrink: x [T, K] and a_stack [S, N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(a_stack.shape)}")  # fmt: skip
    if a_stack.dtype != x.dtype or not a_stack.is_contiguous():
        raise ValueError(f"lora_shrink: a_stack must be contiguous {x.dtype}, got {a_stack.dtype}")
    _check_md(x.shape[0], a_stack.shape[0], md, "lora_shrink")


def _check_expand(h, b_stack, y, slice_offsets, md: LoRAMetadata) -> None:
    if h.dim() != 2 or y.dim() != 2 or b_stack.dim() != 3 or h.shape[0] != y.shape[0]:
        raise ValueError(f"lora_expand: h [T, N], b_stack [S, R, O], y [T, O] expected, got {tuple(h.shape)}, "
                         f"{tuple(b_stack.shape)}, {tuple(y.shape)}")  # fmt: skip
    _, r, o = b_stack.shape
    slices = len(slice_offsets) - 1
    if (slices < 1 or slice_offsets[0] != 0 or slice_offsets[-1] != o or y.shape[1] != o
            or any(b < a for a, b in zip(slice_offsets, slice_offsets[1:])) or h.shape[1] != slices * r):
        raise ValueError(f"lora_expand: slice_offsets {slice_offsets} do not fit y {tuple(y.shape)}, "
                         f"b_stack {tuple(b_stack.shape)} and h {tuple(h.shape)}")  # fmt: skip
    if b_stack.dtype != y.dtype or h.dtype != y.dtype or not b_stack.is_contiguous():
        raise ValueError(f"lora_expand: h and a contiguous b_stack must be {y.dtype}, got {h.dtype}, {b_stack.dtype}")
    _check_md(h.shape[0], b_stack.shape[0], md, "lora_expand")


def _check_md(num_tokens: int, num_slots: int, md: LoRAMetadata, op: str) -> None:
    if md.num_tokens != num_tokens or md.num_slots > num_slots:
        raise ValueError(f"{op}: metadata for {md.num_tokens} tokens and {md.num_slots} slots does not fit "
                         f"{num_tokens} tokens and a stack of {num_slots} slots")  # fmt: skip
