"""M-RoPE positions (Qwen2-VL): three position ids per token, temporal, height and width, as transformers'
`get_rope_index` computes them. A text token's three are equal: its index in the sequence plus the shift of the
images before it, each image of `rows` x `cols` tokens advancing the positions by max(rows, cols) rather than by its
token count (`image_shift`). An image's tokens, in row-major order of its grid, starting at position s (the shifted
index of its first token): (s, s + row, s + col).

Three equal ids rotate as one id does, so a step that schedules no image token (every decode step, a prefill chunk
of text) runs on one position per token, the shifted index: the native decode step, decode graphs and the fused
rotary kernels take it unchanged. Only a step that schedules image tokens carries positions [3, T]
(`layers.MRotaryEmbedding` turns them into per-token rotation tables)."""

import numpy as np

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.multimodal.inputs import ImageInput


def image_grid(image: ImageInput) -> tuple[int, int]:
    """The rows and columns of an image's tokens (`multimodal.patches`' layout)."""
    rows, cols = image.pixel_values.shape[:2]
    return rows, cols


def image_shift(image: ImageInput) -> int:
    """How far the positions after `image` lie behind its tokens' indices (0 or less)."""
    rows, cols = image_grid(image)
    return max(rows, cols) - rows * cols


def mrope_positions(positions: np.ndarray, scheduler_output: SchedulerOutput, query_lens: np.ndarray) -> np.ndarray:
    """The batch's `positions` (each token's index in its sequence, the rows after the scheduled ones padding) as
    M-RoPE takes them: [T] shifted, or [3, T] where the step schedules an image token."""
    out, pieces = positions.copy(), []  # pieces: (batch rows, image token indices, image start, grid columns)
    for seq, row, n in zip(scheduler_output.seqs, np.cumsum(query_lens) - query_lens, query_lens):
        if not seq.images:
            continue
        index = positions[row : row + n]
        ends = np.array([image.offset + image.length for image in seq.images])
        before = np.concatenate([[0], np.cumsum([image_shift(image) for image in seq.images])])
        out[row : row + n] = index + before[np.searchsorted(ends, index, side="right")]
        for image, shift in zip(seq.images, before):
            k = index - image.offset
            inside = np.flatnonzero((k >= 0) & (k < image.length))
            if len(inside):
                pieces.append((row + inside, k[inside], image.offset + shift, image_grid(image)[1]))
    if not pieces:
        return out
    three = np.repeat(out[None], 3, axis=0)
    for rows, k, start, cols in pieces:
        three[:, rows] = start + np.stack([np.zeros_like(k), k // cols, k % cols])
    return three
