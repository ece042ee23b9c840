"""Multi-LoRA ops: `lora_shrink` / `lora_expand` apply a different adapter to each token of one flattened batch.

Adapters sit in `S` device slots. Per layer, with `n` slices (3 for qkv, 2 for gate_up, else 1) and slot rank R
(smaller ranks zero-padded), `N = n*R`:
- `a_stack [S, N, K]`: slot s's A; slice i's A in rows `i*R:(i+1)*R`.
- `b_stack [S, R, O]`: slot s's B, transposed; slice i's B in its own output columns, which read the shrink
  result's columns `i*R:(i+1)*R`. Scaling is folded in.

`lora_shrink(x, a) -> h [T, N]` (h[t] = A[slot_t] x[t]); `lora_expand(h, b, y)` adds each slice's
`h[t, i*R:(i+1)*R] B[slot_t][:, slice i]` to `y` in place (y may be of a lower precision than h and B). Tokens
of slot -1 (the base model) are untouched by expand; their rows of `h` are undefined.

Both paths group tokens by slot (Punica's segmented GEMM, SGMV). The Triton kernels run one program per tile
of one slot's tokens. The torch path picks per step, from host-side sizes: when groups are of similar size
(decode) it pads every group to the largest and runs one batched GEMM (`bmm`) over the slots, a handful of ops
however many adapters mix; when one group dwarfs the others (a long prefill chunk beside decodes), padding
would multiply the work, so it runs one GEMM per slot on the tokens gathered in slot order. At bf16/fp16 every
GEMM's row count is a `padded_tokens` size (oneDNN keeps a kernel per row count): the padded width, and each
group's rows on the per-slot path, padded with repeats of the group's last token whose results are never read.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiffin.kernels.dispatch import implements, kernel
from tiffin.kernels.row_buckets import padded_tokens

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
    # (slot, start, end) in sorted_tokens, one per slot with tokens; on the per-slot path at bf16/fp16, in the
    # layout of `padded_tokens` (each group's rows padded to a bucket)
    groups: list[tuple[int, int, int]]
    padded: bool  # pad the groups into one bmm (else one GEMM per group)
    active_slots: torch.Tensor | None = None  # [G] int64 slots of the groups; None when they are 0..G-1
    pad_width: int = 0  # rows per group in the padded layout
    padded_tokens: torch.Tensor | None = None  # [G * pad_width] int64: group g's tokens, its last repeated (or
    # on the per-slot path at bf16/fp16: each group's tokens then repeats of its last, up to its bucket)
    padded_real: torch.Tensor | None = None  # [T'] int64: the real rows of that layout, in sorted order
    pad_mask: torch.Tensor | None = None  # [G, pad_width, 1]: 1 on real rows, 0 on repeats
    token_rows: torch.Tensor | None = None  # [T] int64: each token's row in the layout; a zeroed row for base
    token_slots: np.ndarray | None = None  # [T] host: what `build` was given
    graphed: bool = False  # `graphed_over`'s: every adapter layer launches, whatever its slots hold

    @classmethod
    def graphed_over(
        cls, sorted_tokens: torch.Tensor, slot_starts: torch.Tensor, slot_counts: torch.Tensor
    ) -> "LoRAMetadata":
        """Metadata over persistent buffers that a CUDA graph reads, refilled in place every step with
        `group_by_slot`'s arrays: its shapes and the kernels' grids are fixed (every slot, any group as large as
        the batch), and every adapter layer launches, even while its slots hold nothing (adapters load after the
        capture). Triton kernels only: the torch path groups on the host."""
        n = sorted_tokens.shape[0]
        return cls(n, sorted_tokens, slot_starts, slot_counts, slot_starts.shape[0], n, [], False, graphed=True)

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device, dtype: torch.dtype) -> "LoRAMetadata":
        """`token_slots [T]`: slot per token, -1 for the base model (at least one must use a slot); `dtype`:
        the stacks' dtype. Its arrays copied to `device` one by one: a step sends them with its batch (`staged`)."""
        arrays = []

        def add(a: np.ndarray) -> int:
            arrays.append(a)
            return len(arrays) - 1

        return cls.staged(token_slots, dtype, add)(lambda i: torch.from_numpy(arrays[i]).to(device))

    @classmethod
    def staged(
        cls, token_slots: np.ndarray, dtype: torch.dtype, add: Callable[[np.ndarray], int]
    ) -> Callable[[Callable[[int], torch.Tensor]], "LoRAMetadata"]:
        """`build` in two halves around a step's one upload: its host arrays given to `add` (which returns a
        handle) now, the metadata made from their device copies (`get(handle)`) by the returned function."""
        slots = np.asarray(token_slots, dtype=np.int64)
        used = slots[slots >= 0]
        if used.size == 0:
            raise ValueError("LoRAMetadata needs at least one token with an adapter slot")
        num_slots = int(used.max()) + 1
        order, starts, counts = group_by_slot(slots, num_slots)
        active = np.flatnonzero(counts)
        groups = [(int(s), int(starts[s]), int(starts[s] + counts[s])) for s in active]
        max_slot_tokens = width = int(counts.max())
        padded = len(groups) * width <= PAD_LIMIT * used.size
        bucketed = dtype != torch.float32  # oneDNN's bf16/fp16 GEMMs keep a kernel per row count
        grouped = [add(order), add(starts), add(counts)]
        layout = {}
        if padded:
            if used.size < slots.size and len(groups) * width == used.size:
                width += 1  # base tokens need a padding row to read zeros from
            width = padded_tokens(width) if bucketed else width
            real, gather = _layout(order, starts[active], counts[active], np.full(len(active), width))
            pad_rows = np.flatnonzero(~real)
            rows = np.full(slots.size, pad_rows[0] if pad_rows.size else 0)  # base tokens read a zeroed row
            rows[order] = np.flatnonzero(real)
            layout = {
                "padded_tokens": add(gather),
                "padded_real": add(np.flatnonzero(real)),
                "pad_mask": add(real.reshape(len(active), width, 1).astype(np.float32)),
                "token_rows": add(rows),
            }
            if not np.array_equal(active, np.arange(len(active))):
                layout["active_slots"] = add(active)
        elif bucketed:
            widths = np.array([padded_tokens(int(c)) for c in counts[active]])
            real, gather = _layout(order, starts[active], counts[active], widths)
            layout = {"padded_tokens": add(gather), "padded_real": add(np.flatnonzero(real))}
            ends = np.cumsum(widths)
            groups = [(slot, int(end - w), int(end)) for (slot, _, _), w, end in zip(groups, widths, ends)]

        def finish(get: Callable[[int], torch.Tensor]) -> "LoRAMetadata":
            on_device = {name: get(handle) for name, handle in layout.items()}
            if "pad_mask" in on_device:
                on_device["pad_mask"] = on_device["pad_mask"].to(dtype)
            grouping = [get(handle) for handle in grouped]
            pad_width = width if padded else 0
            return cls(
                int(slots.size), *grouping, num_slots, max_slot_tokens, groups, padded, **on_device,
                pad_width=pad_width, token_slots=slots,
            )  # fmt: skip

        return finish


def _layout(
    order: np.ndarray, starts: np.ndarray, counts: np.ndarray, widths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Groups (`starts`/`counts` in `order`) laid out `widths` rows each: row j of group g holds its token
    min(j, count-1), a repeat of a real row past its count -> (which rows are real, the token of each row)."""
    group = np.repeat(np.arange(len(widths)), widths)
    j = np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
    n = counts[group]
    return j < n, order[starts[group] + np.minimum(j, n - 1)]


def group_by_slot(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`token_slots [T]` int64 (-1: the base model) -> the tokens with a slot, grouped by slot in token order
    (int64), and each of the `num_slots` slots' start among them and count (int32)."""
    used = token_slots[token_slots >= 0]
    counts = np.bincount(used, minlength=num_slots)
    order = np.argsort(token_slots, kind="stable")[token_slots.size - used.size :]  # -1s sort first
    return order, (np.cumsum(counts) - counts).astype(np.int32), counts.astype(np.int32)


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata, backend: str = "torch") -> torch.Tensor:
    """`x [T, K]`, `a_stack [S, N, K]` of x's dtype -> `[T, N]`: each token times its slot's A."""
    _check_shrink(x, a_stack, md)
    return kernel("lora_shrink", backend)(x, a_stack, md)


def lora_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: list[int],
    md: LoRAMetadata,
    backend: str = "torch",
) -> torch.Tensor:
    """`y[t, slice i] += h[t, i*R:(i+1)*R] @ B[slot_t][:, slice i]` in place; returns `y`. `slice_offsets`: the
    slices' output boundaries `[0, O_0, O_0+O_1, ..., O]`."""
    _check_expand(h, b_stack, y, slice_offsets, md)
    return kernel("lora_expand", backend)(h, b_stack, y, slice_offsets, md)


def lora_apply(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: list[int],
    md: LoRAMetadata,
    backend: str = "torch",
) -> torch.Tensor:
    """Shrink then expand: `y += LoRA(x)` in place; returns `y`."""
    _check_shrink(x, a_stack, md)
    _check_b(b_stack, y, slice_offsets, a_stack.shape[1], a_stack.dtype, md)
    _check_md(x.shape[0], b_stack.shape[0], md, "lora_expand")
    return kernel("lora_apply", backend)(x, a_stack, b_stack, y, slice_offsets, md)


@implements("lora_shrink", "torch")
def lora_shrink_torch(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata) -> torch.Tensor:
    h = x.new_empty(x.shape[0], a_stack.shape[1])
    if md.padded:
        hs = _padded_shrink(x, a_stack, md).flatten(0, 1)
        return h.index_copy_(0, md.sorted_tokens, hs.index_select(0, md.padded_real))
    rows = md.sorted_tokens if md.padded_tokens is None else md.padded_tokens
    xs, hs = x.index_select(0, rows), h.new_empty(rows.shape[0], h.shape[1])
    for slot, start, end in md.groups:
        torch.mm(xs[start:end], a_stack[slot].T, out=hs[start:end])
    return h.index_copy_(0, md.sorted_tokens, hs if md.padded_tokens is None else hs.index_select(0, md.padded_real))


@implements("lora_expand", "torch")
def lora_expand_torch(
    h: torch.Tensor, b_stack: torch.Tensor, y: torch.Tensor, slice_offsets: list[int], md: LoRAMetadata
) -> torch.Tensor:
    if md.padded:
        hs = h.index_select(0, md.padded_tokens).view(len(md.groups), md.pad_width, -1) * md.pad_mask
        return _padded_expand(hs, b_stack, y, slice_offsets, md)
    rows = md.sorted_tokens if md.padded_tokens is None else md.padded_tokens
    r, hs = b_stack.shape[1], h.index_select(0, rows)
    ys = h.new_empty(rows.shape[0], y.shape[1])
    for slot, start, end in md.groups:
        for i, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:])):
            ys[start:end, lo:hi] = hs[start:end, i * r : (i + 1) * r] @ b_stack[slot, :, lo:hi]
    ys = ys if md.padded_tokens is None else ys.index_select(0, md.padded_real)
    return y.index_add_(0, md.sorted_tokens, ys.to(y.dtype))


@implements("lora_apply", "torch")
def lora_apply_torch(x, a_stack, b_stack, y, slice_offsets: list[int], md: LoRAMetadata) -> torch.Tensor:
    """On the padded path the shrink result stays in the padded layout in between (a layer's whole delta in a
    handful of ops)."""
    if not md.padded:
        return lora_expand_torch(lora_shrink_torch(x, a_stack, md), b_stack, y, slice_offsets, md)
    hs = _padded_shrink(x, a_stack, md) * md.pad_mask
    return _padded_expand(hs, b_stack, y, slice_offsets, md)


def _padded_shrink(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata) -> torch.Tensor:
    """`[G, pad_width, N]`: every group's tokens (its last one repeated) through its slot's A."""
    xs = x.index_select(0, md.padded_tokens).view(len(md.groups), md.pad_width, -1)
    return torch.bmm(xs, _slots(a_stack, md).transpose(1, 2))


def _padded_expand(
    hs: torch.Tensor, b_stack: torch.Tensor, y: torch.Tensor, slice_offsets: list[int], md: LoRAMetadata
) -> torch.Tensor:
    """Adds `hs [G, pad_width, N]` (repeated rows zeroed) through each group's B into the tokens' rows of y."""
    r, b = b_stack.shape[1], _slots(b_stack, md)
    for i, (lo, hi) in enumerate(zip(slice_offsets, slice_offsets[1:])):
        out = torch.bmm(hs[:, :, i * r : (i + 1) * r], b[:, :, lo:hi]).flatten(0, 1)
        # each token gathers its row (base tokens a zero row): far cheaper than index_add_ into y's columns
        y[:, lo:hi].add_(out.index_select(0, md.token_rows).to(y.dtype))
    return y


def _slots(stack: torch.Tensor, md: LoRAMetadata) -> torch.Tensor:
    """The stack rows of the groups' slots, in group order (a view when they are the first slots)."""
    return stack[: len(md.groups)] if md.active_slots is None else stack.index_select(0, md.active_slots)


def _check_shrink(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata) -> None:
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(
            f"lora_shrink: x [T, K] and a_stack [S, N, K] expected, got {tuple(x.shape)} and {tuple(a_stack.shape)}"
        )
    if a_stack.dtype != x.dtype or not a_stack.is_contiguous():
        raise ValueError(f"lora_shrink: a_stack must be contiguous {x.dtype}, got {a_stack.dtype}")
    _check_md(x.shape[0], a_stack.shape[0], md, "lora_shrink")


def _check_expand(h, b_stack, y, slice_offsets, md: LoRAMetadata) -> None:
    if h.dim() != 2:
        raise ValueError(f"lora_expand: h must be [T, N], got {tuple(h.shape)}")
    _check_b(b_stack, y, slice_offsets, h.shape[1], h.dtype, md)
    _check_md(h.shape[0], b_stack.shape[0], md, "lora_expand")


def _check_b(b_stack, y, slice_offsets, n: int, dtype: torch.dtype, md: LoRAMetadata) -> None:
    if y.dim() != 2 or b_stack.dim() != 3 or y.shape[0] != md.num_tokens:
        raise ValueError(
            f"lora_expand: b_stack [S, R, O] and y [{md.num_tokens}, O] expected, got "
            f"{tuple(b_stack.shape)} and {tuple(y.shape)}"
        )
    _, r, o = b_stack.shape
    slices = len(slice_offsets) - 1
    if (
        slices < 1
        or slice_offsets[0] != 0
        or slice_offsets[-1] != o
        or y.shape[1] != o
        or n != slices * r
        or any(b < a for a, b in zip(slice_offsets, slice_offsets[1:]))
    ):
        raise ValueError(
            f"lora_expand: slice_offsets {slice_offsets} do not fit y {tuple(y.shape)}, "
            f"b_stack {tuple(b_stack.shape)} and {n} shrink columns"
        )
    if b_stack.dtype != dtype or not b_stack.is_contiguous() or not y.is_floating_point():
        raise ValueError(f"lora_expand: b_stack must be contiguous {dtype} (the shrink's dtype), got {b_stack.dtype}")


def _check_md(num_tokens: int, num_slots: int, md: LoRAMetadata, op: str) -> None:
    if md.num_tokens != num_tokens or md.num_slots > num_slots:
        raise ValueError(
            f"{op}: metadata for {md.num_tokens} tokens and {md.num_slots} slots does not fit "
            f"{num_tokens} tokens and a stack of {num_slots} slots"
        )
