"""Turns a SchedulerOutput into one flattened forward pass, then samples."""

import ctypes
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiffin import kernels
from tiffin.engine.config import EngineConfig
from tiffin.engine.cpu_threads import ThreadTuner, usable_cpus
from tiffin.engine.grammar import fill_bitmask
from tiffin.engine.lora_slots import LoRASlots
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.loader import build_model
from tiffin.engine.sampler import Sampler, SamplerOutput
from tiffin.engine.scheduler import SchedulerOutput

CPU_KV_CACHE_CAP = 4 << 30  # bytes; like vLLM's CPU backend default
GiB = 1 << 30


@dataclass(frozen=True)
class MemoryProbe:
    """The device memory readings KV sizing takes; unit tests pass fakes to check the arithmetic with no GPU."""

    mem_get_info: Callable[[torch.device], tuple[int, int]]  # (free, total) bytes, other processes' use counted
    memory_allocated: Callable[[torch.device], int]
    max_memory_allocated: Callable[[torch.device], int]
    reset_peak_memory_stats: Callable[[torch.device], None]
    synchronize: Callable[[torch.device], None]
    empty_cache: Callable[[], None]


CUDA_MEMORY = MemoryProbe(
    torch.cuda.mem_get_info,
    torch.cuda.memory_allocated,
    torch.cuda.max_memory_allocated,
    torch.cuda.reset_peak_memory_stats,
    torch.cuda.synchronize,
    torch.cuda.empty_cache,
)


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes measured by the profiling step."""

    total: int  # the device's memory
    free: int  # free after it, with the weights loaded and its KV released (CUDA context, other processes: used)
    peak: int  # what its forward and sampler pass allocated at most on top of what stays allocated

    def kv_blocks(self, utilization: float, bytes_per_block: int, max_blocks_per_seq: int) -> int:
        """Blocks of what `utilization` of the device leaves once what is in use and the largest step's
        activations are counted; ValueError naming the numbers when that is not one max_model_len sequence."""
        budget = int(self.total * utilization)
        in_use = self.total - self.free
        left = budget - in_use - self.peak
        blocks = max(left, 0) // bytes_per_block
        if blocks < max_blocks_per_seq:
            raise ValueError(
                f"max_model_len needs {max_blocks_per_seq} KV blocks ({max_blocks_per_seq * bytes_per_block / GiB:.2f} "
                f"GiB) for one sequence, but gpu_memory_utilization {utilization} of the device's "
                f"{self.total / GiB:.2f} GiB ({budget / GiB:.2f} GiB), less {in_use / GiB:.2f} GiB in use (weights, "
                f"CUDA context, other processes) and {self.peak / GiB:.2f} GiB for the largest step's activations, "
                f"leaves {left / GiB:.2f} GiB: lower max_model_len or max_num_batched_tokens, or raise "
                f"gpu_memory_utilization"
            )
        return blocks


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        eos_token_ids: set[int],
    ):
        self.config, self.model_config = config, model_config
        self.device = config.torch_device
        self.thread_tuner = None
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device: cuda:1's tensors must not meet cuda:0's kernels
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            _keep_freed_memory_mapped()
            # never more threads than the CPUs we may use; a lower count the user set stays the ceiling
            self.thread_tuner = ThreadTuner(min(torch.get_num_threads(), usable_cpus()))
        self.block_size = config.block_size
        self.backend = kernels.resolve_backend(config.kernel_backend, self.device)
        self.model = build_model(model_config, config.model, self.device, max_model_len, self.backend)
        self.lora_slots = (
            LoRASlots(self.model, config.max_loras, config.max_lora_rank, model_config.dtype, self.device, self.backend)
            if config.enable_lora
            else None
        )
        self.sampler = Sampler(eos_token_ids, config.seed)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        start = time.perf_counter()
        bitmask = fill_bitmask(sched.sampling_seqs, self.model_config.vocab_size)  # filled while the forward runs
        input_ids, positions, md, logits_indices = self._prepare(sched)
        hidden = self.model(input_ids, positions, md)
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        out = self.sampler(logits, sched.sampling_seqs, bitmask)
        if self.thread_tuner is not None:
            self.thread_tuner.record(time.perf_counter() - start, len(input_ids))
        return out

    def _prepare(self, sched: SchedulerOutput):
        seqs, counts = sched.seqs, np.array(sched.num_scheduled_tokens)
        starts = np.array([s.num_computed_tokens for s in seqs])
        seq_lens = starts + counts
        query_start_loc = np.concatenate([[0], np.cumsum(counts)])
        # token i of the batch belongs to request req[i] at position positions[i]
        req = np.repeat(np.arange(len(seqs)), counts)
        positions = np.arange(query_start_loc[-1]) - query_start_loc[req] + starts[req]
        if self.lora_slots is not None:
            self.lora_slots.prepare([s.lora for s in seqs], counts)
        input_ids = []
        for seq, start, count in zip(seqs, starts, counts):
            input_ids.extend(seq.token_ids[start : start + count])
        width = max(len(s.block_table) for s in seqs)
        block_tables = np.zeros((len(seqs), width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_table)] = seq.block_table
        slots = block_tables[req, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        to = self._to_device
        md = kernels.AttentionMetadata(
            slot_mapping=to(slots, torch.int64),
            query_start_loc=to(query_start_loc, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            block_tables=to(block_tables, torch.int32),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        sampling = np.array(sched.sampling)
        logits_indices = query_start_loc[1:][sampling] - 1
        return to(np.array(input_ids), torch.int64), to(positions, torch.int64), md, to(logits_indices, torch.int64)

    def _to_device(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """On CUDA through pinned memory, so that the copy does not block the host (the caching host allocator
        keeps the pinned block until the copy is done); on CPU the array itself when it has the dtype."""
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def _bytes_per_block(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * mc.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        """`num_kv_blocks`, else what `kv_cache_memory` holds, else what `gpu_memory_utilization` of the GPU
        leaves (a default share of RAM on CPU); never more than max_num_seqs sequences of max_model_len use."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        most = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.config.kv_cache_memory is None and self.device.type == "cuda":
            profile = self._profile_memory(CUDA_MEMORY)
            return min(
                profile.kv_blocks(self.config.gpu_memory_utilization, self._bytes_per_block(), self.max_blocks_per_seq),
                most,
            )
        memory = self.config.kv_cache_memory
        if memory is None:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            memory = min(CPU_KV_CACHE_CAP, available // 4)
        blocks = min(memory // self._bytes_per_block(), most)
        if blocks < 1:
            raise ValueError(f"KV cache memory of {memory} bytes holds no block of {self._bytes_per_block()} bytes")
        return int(blocks)

    def _profile_memory(self, probe: MemoryProbe) -> MemoryProfile:
        """Runs the largest step on a KV cache of just the blocks it needs: a forward of max_num_batched_tokens
        tokens (sequences of at most max_model_len, at most max_num_seqs of them), then a sampler pass over
        max_num_seqs rows of the vocabulary with every filter and logprobs on. That cache is released before
        free memory is read, so the real pool is sized from what stays in use."""
        from tiffin.engine.sampling_params import SamplingParams
        from tiffin.engine.sequence import Sequence  # throwaway sequences only to shape the profiling batch

        c, max_len = self.config, self.max_model_len
        tokens = min(c.max_num_batched_tokens, c.max_num_seqs * max_len)
        sched, self.num_blocks = SchedulerOutput(), 0
        for length in [max_len] * (tokens // max_len) + [tokens % max_len] * (tokens % max_len > 0):
            seq = Sequence("profile", 0, [0] * length, SamplingParams(temperature=0), 1)
            seq.block_table = list(range(self.num_blocks, self.num_blocks + -(-length // self.block_size)))
            self.num_blocks += len(seq.block_table)
            sched.add(seq, length)
        probe.empty_cache()
        self._allocate_kv_cache()
        allocated = probe.memory_allocated(self.device)
        probe.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            input_ids, positions, md, logits_indices = self._prepare(sched)
            self.model.compute_logits(self.model(input_ids, positions, md)[logits_indices]).float()
            del input_ids, positions, md, logits_indices
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=1)
            seqs = [Sequence("profile", i, [0], params, 1) for i in range(c.max_num_seqs)]
            self.sampler(torch.zeros(len(seqs), self.model_config.vocab_size, device=self.device), seqs)
        probe.synchronize(self.device)
        peak = probe.max_memory_allocated(self.device) - allocated
        del self.kv_cache
        for attn in self.model.layers_kv():
            attn.k_cache = attn.v_cache = torch.empty(0)
        probe.empty_cache()
        free, total = probe.mem_get_info(self.device)
        return MemoryProfile(total, free, peak)

    def _allocate_kv_cache(self) -> None:
        """Zeroed, so that slots never written hold finite values: masked-out attention weights multiply them."""
        mc = self.model_config
        shape = (2, mc.num_layers, self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=mc.dtype, device=self.device)
        for i, attn in enumerate(self.model.layers_kv()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]


def _keep_freed_memory_mapped() -> None:
    """glibc serves large allocations with fresh mmaps and unmaps them on free, so every step's activations
    page-fault in anew; raising its thresholds keeps freed memory for reuse (the effect vLLM's CPU backend
    gets by preloading tcmalloc)."""
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's maximum
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
