"""Turns a SchedulerOutput into one flattened forward pass, then samples."""

import ctypes
import os
import sys
import time

import numpy as np
import torch

from tiffin import kernels
from tiffin.engine.config import EngineConfig
from tiffin.engine.cpu_threads import ThreadTuner, usable_cpus
from tiffin.engine.grammar import fill_bitmask
from tiffin.engine.lora_slots import LoRASlots
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.loader import build_model
from tiffin.engine.parallel import Parallel, Step, TensorParallel
from tiffin.engine.sampler import Sampler, SamplerOutput
from tiffin.engine.scheduler import SchedulerOutput

CPU_KV_CACHE_CAP = 4 << 30  # bytes; like vLLM's CPU backend default


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        eos_token_ids: set[int],
        parallel: Parallel | None = None,
    ):
        """With `tensor_parallel_size` > 1 this is rank 0, which starts the other ranks' workers (`parallel`: a
        worker's own rank)."""
        self.config, self.model_config = config, model_config
        self.device = config.torch_device if parallel is None else parallel.device
        if parallel is None and config.tensor_parallel_size > 1:
            parallel = Parallel.start(config, model_config, max_model_len, self.device)
        self.parallel, tp = parallel, TensorParallel() if parallel is None else parallel.tp
        self.thread_tuner = None
        if self.device.type == "cpu":
            _keep_freed_memory_mapped()
            # never more threads than the CPUs we may use; a lower count the user set stays the ceiling
            self.thread_tuner = ThreadTuner(min(torch.get_num_threads(), usable_cpus()))
        self.block_size = config.block_size
        self.backend = kernels.resolve_backend(config.kernel_backend, self.device)
        self.model = build_model(model_config, config.model, self.device, max_model_len, self.backend, tp)
        self.num_kv_heads = tp.kv_heads(model_config.num_kv_heads)
        self.lora_slots = (
            LoRASlots(self.model, config.max_loras, config.max_lora_rank, model_config.dtype, self.device, self.backend)
            if config.enable_lora
            else None
        )
        self.sampler = Sampler(eos_token_ids, config.seed)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_blocks = self._num_kv_blocks()
        if parallel is not None:
            self.num_blocks = parallel.agree_num_blocks(self.num_blocks)
        self._allocate_kv_cache()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        start = time.perf_counter()
        bitmask = fill_bitmask(sched.sampling_seqs, self.model_config.vocab_size)  # filled while the forward runs
        step = Step(*self._prepare(sched))
        if self.parallel is None:
            logits = self.run_model(step).float()
        else:  # the other ranks run the same step on their shards
            logits = self.parallel.run(step, self.lora_slots, self.run_model).float()
        out = self.sampler(logits, sched.sampling_seqs, bitmask)
        if self.thread_tuner is not None:
            self.thread_tuner.record(time.perf_counter() - start, len(step.input_ids))
        return out

    @torch.inference_mode()
    def run_model(self, step: Step) -> torch.Tensor | None:
        """The logits of the step's sampling tokens; with tensor parallelism on rank 0 only (None elsewhere)."""
        hidden = self.model(step.input_ids, step.positions, step.md)
        return self.model.compute_logits(hidden[step.logits_indices])

    def shutdown(self) -> None:
        """End the tensor-parallel workers, if any."""
        if self.parallel is not None:
            self.parallel.shutdown()

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
        to = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)
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

    def _bytes_per_block(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * self.num_kv_heads * mc.head_dim * mc.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        """`num_kv_blocks`, else what `kv_cache_memory` holds, else a default share of the device's memory;
        never more than max_num_seqs sequences of max_model_len could use."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        memory = self.config.kv_cache_memory
        if memory is None:
            memory = self._default_kv_memory()
        blocks = min(memory // self._bytes_per_block(), self.config.max_num_seqs * self.max_blocks_per_seq)
        if blocks < 1:
            raise ValueError(f"KV cache memory of {memory} bytes holds no block of {self._bytes_per_block()} bytes")
        return int(blocks)

    def _default_kv_memory(self) -> int:
        if self.device.type == "cuda":
            return self._profile_cuda_memory()
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(CPU_KV_CACHE_CAP, available // 4)

    def _profile_cuda_memory(self) -> int:
        """What `gpu_memory_utilization` of the GPU leaves after the weights and a forward of the largest step."""
        torch.cuda.reset_peak_memory_stats()
        tokens = min(self.config.max_num_batched_tokens, self.max_blocks_per_seq * self.block_size)
        self.num_blocks = self.max_blocks_per_seq
        self._allocate_kv_cache()
        from tiffin.engine.sampling_params import SamplingParams
        from tiffin.engine.sequence import Sequence  # a throwaway sequence only to shape the profiling batch

        seq = Sequence("profile", 0, [0] * tokens, SamplingParams(temperature=0), 1)
        seq.block_table = list(range(-(-tokens // self.block_size)))
        sched = SchedulerOutput()
        sched.add(seq, tokens)
        self.run_model(Step(*self._prepare(sched)))  # on every rank at once: no step to broadcast
        peak = torch.cuda.max_memory_allocated()
        del self.kv_cache
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(int(total * self.config.gpu_memory_utilization) - peak, 0)

    def _allocate_kv_cache(self) -> None:
        """Zeroed, so that slots never written hold finite values: masked-out attention weights multiply them."""
        mc = self.model_config
        shape = (2, mc.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
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
