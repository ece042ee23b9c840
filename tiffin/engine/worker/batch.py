"""A step's batch at the worker: a `SchedulerOutput` flattened into host arrays (`HostBatch`), then those
arrays on the device as the model takes them (`ModelInput`). The data flow of one step, in the design's terms:
`input_ids[T]`, `positions[T]`, `slot_mapping[T]`, `query_start_loc[B+1]`, `seq_lens[B]`,
`block_tables[B, max_blocks]`, `logits_indices[S]` (the last token of each sampling sequence, then the prompt rows
of the sequences that ask for prompt logprobs)."""

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.models.llava import MultiModalEmbeddings
from tiffin.engine.models.pooler import PoolingMetadata
from tiffin.engine.sampling_params import SamplingParams
from tiffin.kernels import AttentionMetadata
from tiffin.kernels.lora import LoRAMetadata
from tiffin.kernels.row_buckets import padded_tokens


@dataclass
class HostBatch:
    """Attention sees entries (`query_start_loc`, `seq_lens`, `block_tables`): a sequence each, except that a
    sequence verifying proposals is one entry per query token, each seeing the keys up to its own position, so
    that its rows run as decode rows in every attention kernel (the native CPU decode step included), with a
    plain decode's numerics."""

    input_ids: np.ndarray
    positions: np.ndarray  # [T]; M-RoPE's [3, T] in a step that schedules image tokens (`multimodal.mrope`)
    slots: np.ndarray  # the KV cache slot of each token; -1: a padding row, written nowhere
    query_start_loc: np.ndarray  # per attention entry
    seq_lens: np.ndarray  # per attention entry
    block_tables: np.ndarray  # per attention entry
    query_lens: np.ndarray  # tokens scheduled per sequence
    logits_indices: np.ndarray
    # the sliding-window layers' slots and tables, where they keep a KV group of their own (`worker.kv_groups`)
    window_slots: np.ndarray | None = None
    window_tables: np.ndarray | None = None


class Upload:
    """One step's host arrays, copied to the device in one transfer from one pinned buffer (on CUDA: a copy from
    pageable memory makes the host wait for the device, and every copy is a launch). `add` an array, `send` once,
    then `get` each array as a device tensor viewing its part of the copy. On CPU `get` returns the arrays
    themselves, as tensors."""

    def __init__(self, device: torch.device):
        self.device, self._arrays, self._sent = device, [], None

    def add(self, a: np.ndarray) -> int:
        if self._sent is not None:
            raise RuntimeError("Upload.add after send")
        self._arrays.append(np.ascontiguousarray(a))
        return len(self._arrays) - 1

    def send(self) -> None:
        """Copy what was added; a second call does nothing."""
        if self._sent is not None:
            return
        if self.device.type == "cpu":
            self._sent = [torch.from_numpy(a) for a in self._arrays]
            return
        offsets, total = [], 0
        # each part 16-byte aligned: any dtype views its bytes, and Triton, which specializes a kernel by its
        # pointers' divisibility by 16, sees every step's tensors alike (no variant that warm-up did not launch)
        for a in self._arrays:
            offsets.append(total)
            total += -(-a.nbytes // 16) * 16
        host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=True)
        view = host.numpy()
        for a, offset in zip(self._arrays, offsets):
            view[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        device = host.to(self.device, non_blocking=True)
        self._sent = [
            device[offset : offset + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, offset in zip(self._arrays, offsets)
        ]

    def get(self, index: int) -> torch.Tensor:
        return self._sent[index]


class ModelInput(NamedTuple):
    """What one forward takes, on the device: also what rank 0 sends the other tensor-parallel ranks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    lora: LoRAMetadata | None = None
    pooling: PoolingMetadata | None = None  # rank 0's only: the other ranks do not pool
    mm: MultiModalEmbeddings | None = None  # the step's image embeddings (`multimodal.encoder`), if it has any


def host_batch(
    scheduler_output: SchedulerOutput, block_size: int, pad_rows: bool = False, window_pool: int = 0
) -> HostBatch:
    """`scheduler_output` flattened; with `pad_rows`, the step runs `padded_tokens` rows. `window_pool` > 0: the
    window group's blocks, whose tables and slots come too (a sequence without a window table, as synthetic ones,
    reads its block table's ids modulo that pool)."""
    seqs, query_lens = scheduler_output.seqs, np.array(scheduler_output.num_scheduled_tokens)
    starts = np.array([s.num_computed_tokens for s in seqs])
    seq_lens = starts + query_lens
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    # token i of the batch belongs to request req[i] at position positions[i]
    req = np.repeat(np.arange(len(seqs)), query_lens)
    positions = np.arange(query_start_loc[-1]) - query_start_loc[req] + starts[req]
    input_ids = np.array(
        list(chain.from_iterable(s.scheduled_token_ids(a, n) for s, a, n in zip(seqs, starts, query_lens)))
    )
    block_tables = _tables([s.block_table for s in seqs])
    slots = _slots(block_tables, req, positions, block_size)
    window_tables = window_slots = None
    if window_pool:
        window_tables = _tables([s.window_table or [b % window_pool for b in s.block_table] for s in seqs])
        window_slots = _slots(window_tables, req, positions, block_size)
    logits_indices = _logits_indices(scheduler_output, query_start_loc, starts)
    if any(s.spec_token_ids for s in seqs):  # one entry per query token of a verifying sequence
        verifying = np.array([bool(s.spec_token_ids) for s in seqs])
        entries = np.where(verifying, query_lens, 1)
        owner = np.repeat(np.arange(len(seqs)), entries)
        single = verifying[owner]
        query_start_loc = np.concatenate([[0], np.cumsum(np.where(single, 1, query_lens[owner]))])
        seq_lens = np.where(single, starts[owner] + _ranks(entries) + 1, seq_lens[owner])
        block_tables = block_tables[owner]
        window_tables = None if window_tables is None else window_tables[owner]
    if pad_rows:
        pad = padded_tokens(len(input_ids)) - len(input_ids)
        input_ids, positions = np.pad(input_ids, (0, pad)), np.pad(positions, (0, pad))
        slots = np.pad(slots, (0, pad), constant_values=-1)
        window_slots = None if window_slots is None else np.pad(window_slots, (0, pad), constant_values=-1)
    arrays = (input_ids, positions, slots, query_start_loc, seq_lens, block_tables, query_lens, logits_indices)
    return HostBatch(*arrays, window_slots, window_tables)


def _tables(tables: list[list[int]]) -> np.ndarray:
    """The tables as rows of one array `round16` wide, zero-padded."""
    out = np.zeros((len(tables), round16(max(map(len, tables)))), dtype=np.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


def _slots(tables: np.ndarray, req: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each token (token i of the batch: sequence `req[i]`'s position `positions[i]`)."""
    return tables[req, positions // block_size].astype(np.int64) * block_size + positions % block_size


def _logits_indices(scheduler_output: SchedulerOutput, query_start_loc: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The rows whose logits are sampled: each sampling sequence's last token, and before it one per proposal;
    then `prompt_rows`' (`starts`: each sequence's first position this step)."""
    sampling = np.array(scheduler_output.sampling)
    ends = query_start_loc[1:][sampling]
    counts = np.array([len(s.spec_token_ids) + 1 for s in scheduler_output.sampling_seqs], dtype=np.int64)
    if len(counts) == 0 or counts.max() == 1:
        indices = ends - 1
    else:
        indices = np.repeat(ends - counts, counts) + _ranks(counts)
    if not scheduler_output.prompt_rows:
        return indices
    seq, first, rows = np.array(scheduler_output.prompt_rows, dtype=np.int64).T
    prompt = np.repeat(query_start_loc[seq] + first - starts[seq], rows) + _ranks(rows)
    return np.concatenate([indices, prompt])


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., counts[0] - 1, 0, 1, ..., counts[1] - 1, ...: each item's place within its group."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def pad_indices(indices: torch.Tensor) -> torch.Tensor:
    """`indices` (the logits rows of a step) padded to `padded_tokens` with row 0's index."""
    return torch.nn.functional.pad(indices, (0, padded_tokens(len(indices)) - len(indices)))


def round16(width: int) -> int:
    """Block tables are this wide: their row stride is a kernel argument, which Triton specializes by
    divisibility by 16, so a width that varied by step would compile new kernel variants while serving."""
    return -(-width // 16) * 16


def synthetic_step(seqs: list[tuple[int, int]], block_size: int, num_blocks: int) -> SchedulerOutput:
    """A step of throwaway sequences, one per (tokens already in the KV cache, tokens to compute), on
    consecutive blocks that wrap around the pool (profiling and warm-up read back only finite values)."""
    scheduler_output, block = SchedulerOutput(), 0
    for computed, new in seqs:
        seq = Sequence("synthetic", 0, [0] * (computed + new), SamplingParams(temperature=0), 1)
        seq.num_computed_tokens = computed
        blocks = -(-(computed + new) // block_size)
        seq.block_table = [(block + i) % num_blocks for i in range(blocks)]
        block += blocks
        scheduler_output.add(seq, new)
    return scheduler_output
