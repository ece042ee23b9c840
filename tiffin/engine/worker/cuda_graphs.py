"""Decode-only steps padded to a few row counts, their inputs in persistent buffers, one CUDA graph per size. A
decode row is a plain decode's token or one of a verifying sequence's (speculative decoding), each its own
attention entry.
Under tensor parallelism every rank captures the same sizes, its all-reduces inside the graphs; rank 0 sends each
step's padded inputs (`padded`) and the ranks replay the same size together. A pipeline stage after the first
captures its layers on the previous stage's `(hidden, residual)` from a buffer of its own (`stage_input`), which
the step's receive fills.

Invariant: a graph's inputs live in `DecodeBuffers` and are filled in place, by the step's one upload; its
attention grid depends on the batch size alone (max_seq_len is max_model_len's), and so do its LoRA kernels'
(every slot, any group as large as the batch: `LoRAMetadata.graphed_over`). Padding rows run token 0 at position 0
into the dummy KV block past the pool, on the base model; their outputs are never read."""

import bisect
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.worker.batch import HostBatch, round16
from tiffin.kernels import AttentionMetadata
from tiffin.kernels.lora import LoRAMetadata, group_by_slot
from tiffin.kernels.quant import DENSE_MIN_TOKENS

MAX_GRAPH_BATCH = 512  # like vLLM: larger decode batches are compute-bound, launch overhead no longer shows


def decode_batch_sizes(max_rows: int, quantized: bool = False) -> list[int]:
    """Row counts decode steps are padded to (a CUDA graph each): 1, 2, 4, 8, then every 8, up to the first that
    holds min(max_rows, 512) rows. A quantized model's stop below DENSE_MIN_TOKENS: from there its GEMMs
    dequantize whole weights, which a graph would keep in its pool; those steps run eagerly, unpadded."""
    top, sizes = min(max_rows, MAX_GRAPH_BATCH), []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        if quantized and size >= DENSE_MIN_TOKENS:
            return sizes
        sizes.append(size)
        if size >= top:
            return sizes


@dataclass
class DecodeBuffers:
    """Inputs of padded decode steps, filled in place every step: CUDA graphs read these very tensors."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor  # [sizes[-1], max_blocks_per_seq rounded up to 16]
    query_start_loc: torch.Tensor  # 0..sizes[-1]: one token per attention entry
    lora_tokens: torch.Tensor | None  # [sizes[-1]] the tokens with an adapter, by slot (`group_by_slot`)
    lora_starts: torch.Tensor | None  # [max_loras]
    lora_counts: torch.Tensor | None  # [max_loras]; None: no LoRA
    stage_input: torch.Tensor | None  # [2 * sizes[-1] * hidden size]: a later pipeline stage's; None: the first's
    # the sliding-window layers' slots and tables where they keep a KV group of their own (`worker.kv_groups`)
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None


class DecodeGraphs:
    """Pads decode-only steps of up to `sizes[-1]` sequences to the next of `sizes`; on CUDA, replays the size's
    graph (`capture`), elsewhere runs the same padded inputs eagerly (how the tests run this path on CPU)."""

    def __init__(
        self,
        sizes: list[int],
        device: torch.device,
        block_size: int,
        dummy_block: int,
        max_blocks: int,
        max_loras: int = 0,
        window_dummy: int | None = None,
        stage_input: tuple[int, torch.dtype] | None = None,
    ):
        """`max_loras`: the LoRA slots (0: no LoRA). `window_dummy`: the window group's dummy block, where the
        sliding-window layers keep a KV group of their own (None: one pool). `stage_input`: the hidden size and
        dtype of the `(hidden, residual)` a pipeline stage after the first takes (None: the model embeds the
        tokens)."""
        self.sizes, self.device, self.block_size, self.dummy = sizes, device, block_size, dummy_block
        self.window_dummy = window_dummy
        self.max_seq_len, self.max_loras = max_blocks * block_size, max_loras
        self.hidden_size = None if stage_input is None else stage_input[0]
        n = sizes[-1]
        ints = lambda fill, shape, dtype: torch.full(shape, fill, dtype=dtype, device=device)
        lora = lambda length, dtype: ints(0, (length,), dtype) if max_loras else None
        self.buffers = DecodeBuffers(
            input_ids=ints(0, (n,), torch.int64),
            positions=ints(0, (n,), torch.int64),
            slot_mapping=ints(dummy_block * block_size, (n,), torch.int64),
            seq_lens=ints(1, (n,), torch.int32),
            block_tables=ints(dummy_block, (n, round16(max_blocks)), torch.int32),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            lora_tokens=lora(n, torch.int64),
            lora_starts=lora(max_loras, torch.int32),
            lora_counts=lora(max_loras, torch.int32),
            stage_input=None if stage_input is None else ints(0, (2 * n * stage_input[0],), stage_input[1]),
        )
        if window_dummy is not None:
            self.buffers.window_slot_mapping = ints(window_dummy * block_size, (n,), torch.int64)
            self.buffers.window_block_tables = ints(window_dummy, (n, round16(max_blocks)), torch.int32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | tuple]] = {}  # size -> graph, output

    def size_for(self, scheduler_output: SchedulerOutput) -> int:
        """The padded size of a step whose every query token is a decode row (`HostBatch`'s entries: plain
        decodes and verifying ones, a row per proposal and one more), or 0 when it runs unpadded (a prefill)."""
        counts = scheduler_output.num_scheduled_tokens
        if any(n > 1 and not seq.spec_token_ids for seq, n in zip(scheduler_output.seqs, counts)):
            return 0
        rows = sum(counts)
        return self.sizes[bisect.bisect_left(self.sizes, rows)] if rows <= self.sizes[-1] else 0

    def padded(self, size: int, b: HostBatch, row_slots: np.ndarray | None = None) -> list[np.ndarray]:
        """The step's inputs padded to `size` rows, one array per buffer they fill, in `DecodeBuffers` order (the
        LoRA grouping only with LoRA). `row_slots`: each row's LoRA slot (-1: none; None: no sequence has
        one). Stale block-table columns past this step's width, and LoRA tokens past the groups' end, are never
        read: no row's context reaches them, no slot's count."""
        pad = size - len(b.seq_lens)
        padded = lambda a, fill, dtype: np.concatenate([a, np.full((pad, *a.shape[1:]), fill, a.dtype)]).astype(dtype)
        arrays = [
            padded(b.input_ids, 0, np.int64),
            padded(b.positions, 0, np.int64),
            padded(b.slots, self.dummy * self.block_size, np.int64),
            padded(b.seq_lens, 1, np.int32),
            padded(b.block_tables, self.dummy, np.int32),
        ]
        if self.max_loras:
            token_slots = np.full(size, -1, np.int64)
            if row_slots is not None:
                token_slots[: len(row_slots)] = row_slots
            arrays += group_by_slot(token_slots, self.max_loras)
        if self.window_dummy is not None:
            arrays.append(padded(b.window_slots, self.window_dummy * self.block_size, np.int64))
            arrays.append(padded(b.window_tables, self.window_dummy, np.int32))
        return arrays

    def write(self, parts: list[torch.Tensor]) -> None:
        """Copy `parts` (`padded`'s arrays on the device) into the leading corner of their buffers."""
        buf = self.buffers
        buffers = [buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables]
        if self.max_loras:
            buffers += [buf.lora_tokens, buf.lora_starts, buf.lora_counts]
        if self.window_dummy is not None:
            buffers += [buf.window_slot_mapping, buf.window_block_tables]
        for buffer, part in zip(buffers, parts):
            buffer[tuple(slice(0, n) for n in part.shape)].copy_(part)

    def run(self, size: int, model: Callable) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Replay the size's graph on the buffers (filled by `write`), or run `model` on them (the torch attention
        then reads the step's seq_lens on the host): what the model returns (a stage before the last: its `(hidden,
        residual)`)."""
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
            return hidden
        buf = self.buffers
        metadata = self.metadata(size, buf.seq_lens[:size].tolist())
        return model(buf.input_ids[:size], buf.positions[:size], metadata, self.lora(size), *self._staged(size))

    def stage_input(self, size: int) -> torch.Tensor:
        """The size's `(hidden, residual)` input buffer, [2, size, hidden size], contiguous: a receive fills it."""
        return self.buffers.stage_input[: 2 * size * self.hidden_size].view(2, size, self.hidden_size)

    def _staged(self, size: int) -> tuple:
        """The model's arguments past the LoRA metadata: a later pipeline stage's input, as views of its buffer."""
        return () if self.hidden_size is None else (self.stage_input(size).unbind(0),)

    def metadata(self, size: int, seq_lens: list[int]) -> AttentionMetadata:
        """Views of the buffers. max_seq_len is max_model_len's, whatever the step's contexts: the attention grid
        (KV splits) then depends on the size alone, as a graph replay needs."""
        buf = self.buffers
        md = AttentionMetadata(
            slot_mapping=buf.slot_mapping[:size],
            query_start_loc=buf.query_start_loc[: size + 1],
            seq_lens=buf.seq_lens[:size],
            block_tables=buf.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=seq_lens,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        if self.window_dummy is not None:
            windows = dict(slot_mapping=buf.window_slot_mapping[:size], block_tables=buf.window_block_tables[:size])
            md.sliding = dataclasses.replace(md, **windows)
        return md

    def lora(self, size: int) -> LoRAMetadata | None:
        """Views of the LoRA buffers (None without LoRA)."""
        buf = self.buffers
        if buf.lora_tokens is None:
            return None
        return LoRAMetadata.graphed_over(buf.lora_tokens[:size], buf.lora_starts, buf.lora_counts)

    @torch.inference_mode()
    def capture(self, model: Callable) -> None:
        """Largest size first, so that the smaller graphs reuse its memory pool. Each size runs once eagerly
        first: Triton compiles and cuBLAS picks its kernels outside the capture."""
        buf, pool = self.buffers, None
        for size in reversed(self.sizes):
            attn_metadata, lora = self.metadata(size, [1] * size), self.lora(size)
            args = buf.input_ids[:size], buf.positions[:size], attn_metadata, lora, *self._staged(size)
            model(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = model(*args)
            pool = graph.pool()
            self.graphs[size] = graph, hidden
