"""Turns a SchedulerOutput into one flattened forward pass, then samples."""

import bisect
import ctypes
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiffin import kernels
from tiffin.engine.config import EngineConfig
from tiffin.engine.cpu_threads import ThreadSizer, usable_cpus
from tiffin.engine.grammar import fill_bitmask
from tiffin.engine.lora_slots import LoRASlots
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.loader import build_model
from tiffin.engine.parallel import Parallel, Step, TensorParallel
from tiffin.engine.sampler import Sampler, SamplerOutput
from tiffin.engine.scheduler import SchedulerOutput

CPU_KV_CACHE_CAP = 4 << 30  # bytes; like vLLM's CPU backend default
GiB = 1 << 30
MAX_GRAPH_BATCH = 512  # like vLLM: larger decode batches are compute-bound, launch overhead no longer shows


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Sizes decode steps are padded to (a CUDA graph each): 1, 2, 4, 8, then every 8, up to the first that holds
    min(max_num_seqs, 512) sequences."""
    top, sizes = min(max_num_seqs, MAX_GRAPH_BATCH), []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(size)
        if size >= top:
            return sizes


@dataclass
class HostBatch:
    """One step's flattened batch as host arrays (see the design's step data flow)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    counts: np.ndarray  # tokens scheduled per sequence
    logits_indices: np.ndarray


@dataclass
class DecodeBuffers:
    """Inputs of padded decode steps, filled in place every step: CUDA graphs read these very tensors."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor  # [sizes[-1], max_blocks_per_seq rounded up to 16]
    query_start_loc: torch.Tensor  # 0..sizes[-1]: one token per sequence


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
        parallel: Parallel | None = None,
    ):
        """With `tensor_parallel_size` > 1 this is rank 0, which starts the other ranks' workers (`parallel`: a
        worker's own rank)."""
        self.config, self.model_config = config, model_config
        self.device = config.torch_device if parallel is None else parallel.device
        if parallel is None and config.tensor_parallel_size > 1:
            parallel = Parallel.start(config, model_config, max_model_len, self.device)
        self.parallel, tp = parallel, TensorParallel() if parallel is None else parallel.tp
        self.thread_sizer = None
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device: cuda:1's tensors must not meet cuda:0's kernels
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            _keep_freed_memory_mapped()
            kernels.cpu_native.library()  # built (or found in the cache) now, not during the first request
        if self.device.type == "cpu" and parallel is None:  # tensor-parallel ranks keep their even split
            # never more threads than the CPUs we may use; a lower count the user set stays the ceiling
            self.thread_sizer = ThreadSizer(min(torch.get_num_threads(), usable_cpus()))
        self.block_size = config.block_size
        self.backend = kernels.resolve_backend(config.kernel_backend, self.device)
        self.model = build_model(model_config, config.model, self.device, max_model_len, self.backend, tp)
        self.num_kv_heads = tp.kv_heads(model_config.num_kv_heads)
        cpu_half = self.device.type == "cpu" and self.backend == "torch" and model_config.dtype != torch.float32
        # oneDNN's AMX kernels (`padded_tokens`); LoRA maps adapters per token
        self.pads_prefills = cpu_half and torch.cpu._is_amx_tile_supported() and not config.enable_lora
        self.lora_slots = (
            LoRASlots(self.model, config.max_loras, config.max_lora_rank, model_config.dtype, self.device, self.backend)
            if config.enable_lora
            else None
        )
        self.sampler = Sampler(eos_token_ids, config.seed)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_blocks = self._num_kv_blocks()
        if parallel is not None:
            self.num_blocks = parallel.agree_num_blocks(self.num_blocks)
        self._allocate_kv_cache()
        # CUDA only: the interpreter compiles nothing. Not with tensor parallelism yet: its steps are collective.
        if self.device.type == "cuda" and config.tensor_parallel_size == 1:
            self.warm_up()
        if self.pads_prefills:
            self._warm_padded_sizes()
        self.decode_sizes: list[int] = []  # padded decode batch sizes; empty: decode steps run unpadded
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Graphs pay where launches dominate: CUDA. The torch attention builds per-step host tensors (not
        # capturable); LoRA metadata is not in persistent buffers yet. CPU keeps unpadded steps (padding is work).
        if (
            self.device.type == "cuda"
            and self.backend == "triton"
            and not config.enforce_eager
            and not config.enable_lora
            and config.tensor_parallel_size == 1  # a step is broadcast to the other ranks, not replayed
        ):
            self.init_decode_batches(decode_batch_sizes(config.max_num_seqs))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        if self.thread_sizer is not None:
            self.thread_sizer.update()
        bitmask = fill_bitmask(sched.sampling_seqs, self.model_config.vocab_size)  # filled while the forward runs
        batch = self._host_batch(sched)
        size = self._decode_size(sched)
        if size:
            hidden = self._run_decode(size, batch)
            logits = self.model.compute_logits(hidden[self._to_device(batch.logits_indices, torch.int64)])
        elif self.parallel is None:
            logits = self.run_model(Step(*self._prepare(batch)))
        else:  # the other ranks run the same step on their shards
            logits = self.parallel.run(Step(*self._prepare(batch)), self.lora_slots, self.run_model)
        return self.sampler(logits, sched.sampling_seqs, bitmask)

    @torch.inference_mode()
    def run_model(self, step: Step) -> torch.Tensor | None:
        """The logits of the step's sampling tokens; with tensor parallelism on rank 0 only (None elsewhere)."""
        hidden = self.model(step.input_ids, step.positions, step.md)
        return self.model.compute_logits(hidden[step.logits_indices])

    def shutdown(self) -> None:
        """End the tensor-parallel workers, if any."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _host_batch(self, sched: SchedulerOutput) -> HostBatch:
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
        block_tables = np.zeros((len(seqs), _round16(max(len(s.block_table) for s in seqs))), dtype=np.int32)
        for i, seq in enumerate(seqs):
            block_tables[i, : len(seq.block_table)] = seq.block_table
        slots = block_tables[req, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        logits_indices = query_start_loc[1:][np.array(sched.sampling)] - 1
        input_ids = np.array(input_ids)
        if self.pads_prefills and counts.max() > 1:
            pad = padded_tokens(len(input_ids)) - len(input_ids)
            input_ids, positions = np.pad(input_ids, (0, pad)), np.pad(positions, (0, pad))
            slots = np.pad(slots, (0, pad), constant_values=-1)
        return HostBatch(input_ids, positions, slots, query_start_loc, seq_lens, block_tables, counts, logits_indices)

    def _prepare(self, b: HostBatch):
        to = self._to_device
        md = kernels.AttentionMetadata(
            slot_mapping=to(b.slots, torch.int64),
            query_start_loc=to(b.query_start_loc, torch.int32),
            seq_lens=to(b.seq_lens, torch.int32),
            block_tables=to(b.block_tables, torch.int32),
            query_start_loc_cpu=b.query_start_loc.tolist(),
            seq_lens_cpu=b.seq_lens.tolist(),
            max_query_len=int(b.counts.max()),
            max_seq_len=int(b.seq_lens.max()),
        )
        return to(b.input_ids, torch.int64), to(b.positions, torch.int64), md, to(b.logits_indices, torch.int64)

    def init_decode_batches(self, sizes: list[int]) -> None:
        """Pad decode-only steps of up to `sizes[-1]` sequences to the next of `sizes`, through persistent input
        buffers (`DecodeBuffers`); on CUDA, capture one graph per size. Padding rows run token 0 at position 0
        into the dummy KV block; their outputs are never read."""
        n, dummy = sizes[-1], self.num_blocks  # the block past the pool (`_allocate_kv_cache`)
        ints = lambda fill, shape, dtype: torch.full(shape, fill, dtype=dtype, device=self.device)  # noqa: E731
        self.decode_buffers = DecodeBuffers(
            input_ids=ints(0, (n,), torch.int64),
            positions=ints(0, (n,), torch.int64),
            slot_mapping=ints(dummy * self.block_size, (n,), torch.int64),
            seq_lens=ints(1, (n,), torch.int32),
            block_tables=ints(dummy, (n, _round16(self.max_blocks_per_seq)), torch.int32),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
        )
        self.decode_sizes = sizes
        if self.device.type == "cuda":
            self._capture_graphs()

    def _decode_size(self, sched: SchedulerOutput) -> int:
        """The padded size of a decode-only step, or 0 when it runs unpadded."""
        n = len(sched.seqs)
        if not self.decode_sizes or n > self.decode_sizes[-1] or max(sched.num_scheduled_tokens) > 1:
            return 0
        return self.decode_sizes[bisect.bisect_left(self.decode_sizes, n)]

    def _run_decode(self, size: int, b: HostBatch) -> torch.Tensor:
        """Fill the persistent buffers in place (stale block-table columns past this step's width are never
        read: no row's context reaches them), then replay the size's graph or, on CPU, run the same inputs."""
        buf, pad, width = self.decode_buffers, size - len(b.seq_lens), b.block_tables.shape[1]
        dummy = self.num_blocks
        stage = (
            lambda dst, a, fill: dst.copy_(  # noqa: E731
                self._host(np.concatenate([a, np.full((pad, *a.shape[1:]), fill, a.dtype)]), dst.dtype),
                non_blocking=True,
            )
        )
        stage(buf.input_ids[:size], b.input_ids, 0)
        stage(buf.positions[:size], b.positions, 0)
        stage(buf.slot_mapping[:size], b.slots, dummy * self.block_size)
        stage(buf.seq_lens[:size], b.seq_lens, 1)
        stage(buf.block_tables[:size, :width], b.block_tables, dummy)
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
            return hidden
        seq_lens = b.seq_lens.tolist() + [1] * pad
        return self.model(buf.input_ids[:size], buf.positions[:size], self._decode_metadata(size, seq_lens))

    def _decode_metadata(self, size: int, seq_lens: list[int]) -> kernels.AttentionMetadata:
        """Views of the persistent buffers. max_seq_len is max_model_len's, whatever the step's contexts: the
        attention grid (KV splits) then depends on the size alone, as a graph replay needs."""
        buf = self.decode_buffers
        return kernels.AttentionMetadata(
            slot_mapping=buf.slot_mapping[:size],
            query_start_loc=buf.query_start_loc[: size + 1],
            seq_lens=buf.seq_lens[:size],
            block_tables=buf.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=seq_lens,
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
        )

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Largest size first, so that the smaller graphs reuse its memory pool. Each size runs once eagerly
        first: Triton compiles and cuBLAS picks its kernels outside the capture."""
        buf, pool = self.decode_buffers, None
        for size in reversed(self.decode_sizes):
            md = self._decode_metadata(size, [1] * size)
            ids, pos = buf.input_ids[:size], buf.positions[:size]
            self.model(ids, pos, md)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, pos, md)
            pool = graph.pool()
            self.graphs[size] = graph, hidden

    def _host(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """`a` as a host tensor: pinned on CUDA, so that copies from it do not block the host (the caching host
        allocator keeps the pinned block until the copy is done); on CPU the array itself when it has the dtype."""
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        return t if self.device.type == "cpu" else t.pin_memory()

    def _to_device(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return self._host(a, dtype).to(self.device, non_blocking=True)

    def _bytes_per_block(self) -> int:
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * self.num_kv_heads * mc.head_dim * mc.dtype.itemsize

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
        from tiffin.engine.sequence import Sequence

        c, max_len = self.config, self.max_model_len
        tokens = min(c.max_num_batched_tokens, c.max_num_seqs * max_len)
        lengths = [max_len] * (tokens // max_len) + [tokens % max_len] * (tokens % max_len > 0)
        self.num_blocks = sum(-(-n // self.block_size) for n in lengths)
        sched = self._synthetic_step([(0, n) for n in lengths])
        probe.empty_cache()
        self._allocate_kv_cache()
        allocated = probe.memory_allocated(self.device)
        probe.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            self.run_model(Step(*self._prepare(self._host_batch(sched))))  # every rank at once: no broadcast
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

    def _synthetic_step(self, seqs: list[tuple[int, int]]) -> SchedulerOutput:
        """A step of throwaway sequences, one per (tokens already in the KV cache, tokens to compute), on
        consecutive blocks that wrap around the pool (profiling and warm-up read back only finite values)."""
        from tiffin.engine.sampling_params import SamplingParams
        from tiffin.engine.sequence import Sequence

        sched, block = SchedulerOutput(), 0
        for computed, new in seqs:
            seq = Sequence("synthetic", 0, [0] * (computed + new), SamplingParams(temperature=0), 1)
            seq.num_computed_tokens = computed
            blocks = -(-(computed + new) // self.block_size)
            seq.block_table = [(block + i) % self.num_blocks for i in range(blocks)]
            block += blocks
            sched.add(seq, new)
        return sched

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Launch every Triton kernel variant serving can, so that none compiles after the engine is ready.
        Variants follow a step's sizes: quantized GEMM tiles and split-K by token count (all counts below the
        dense branch, per distinct layer); attention by batch and token counts as Triton specializes them (1, a
        multiple of 16, other) and, for decode-only steps, KV splits, which follow the batch size and the longest
        context. LoRA kernels launch only with an adapter loaded and are not covered yet."""
        if self.backend != "triton":
            return
        from tiffin.kernels.quant import DENSE_MIN_TOKENS
        from tiffin.kernels.triton_attention import MIN_SPLIT_TOKENS
        from tiffin.kernels.triton_common import MAX_SPLITS, num_sms

        c = self.config
        most = min(c.max_num_seqs, c.max_num_batched_tokens)
        long = min(self.max_model_len - 1, MIN_SPLIT_TOKENS * MAX_SPLITS)  # context for the most KV splits
        # every batch size whose programs may not fill the GPU twice (KV splits vary), then one of each
        # specialization class; programs >= sequences, so larger batches never split
        sizes = sorted({*range(1, 2 * num_sms(self.device) + 1), 16, 17, 32, 33} & set(range(1, most + 1)))
        contexts = sorted({1, min(long, MIN_SPLIT_TOKENS + 1), long})  # no split, two, as many as fit
        steps = [[(1, 1)] * (d - 1) + [(ctx, 1)] for d in sizes for ctx in contexts]
        for tokens in (16, 17, 32, 33):  # prefill chunks, prefills after a cached prefix, mixed steps
            for seqs in (1, 2, 16):
                if seqs <= c.max_num_seqs and tokens <= c.max_num_batched_tokens and tokens // seqs > 1:
                    n, extra = divmod(tokens, seqs)
                    steps.append([(0, n + extra)] + [(0, n)] * (seqs - 1))
                    steps.append([(1, n + extra)] + [(1, 1)] * (seqs - 1))
        steps.append([(0, min(c.max_num_batched_tokens, self.max_model_len))])
        for step in steps:
            self.model(*self._prepare(self._host_batch(self._synthetic_step(step)))[:3])
        for layer in self._distinct_linears():
            if hasattr(layer, "qweight"):
                x = torch.zeros(DENSE_MIN_TOKENS, layer.input_size, dtype=self.model_config.dtype, device=self.device)
                for m in range(1, DENSE_MIN_TOKENS):
                    layer.method.apply(layer, x[:m])

    @torch.inference_mode()
    def _warm_padded_sizes(self) -> None:
        """Run each distinct projection at every `padded_tokens` size up to 1,024 rows, so that oneDNN has built
        their kernels before serving (~2 s on a ~40M model, 2 cores). Larger steps build theirs on first use,
        where the build costs less next to the step's work."""
        most = padded_tokens(min(self.config.max_num_batched_tokens, 1024))
        sizes = sorted({padded_tokens(n) for n in range(1, most + 1)})
        for layer in self._distinct_linears():
            x = torch.zeros(most, layer.input_size, dtype=self.model_config.dtype, device=self.device)
            for m in sizes:
                layer.method.apply(layer, x[:m])

    def _distinct_linears(self) -> list:
        """One projection layer (not the embedding) per distinct (method, input size, output size)."""
        from tiffin.engine.models.linear import Embedding, Linear

        layers = {}
        for layer in self.model.modules():
            if isinstance(layer, Linear) and not isinstance(layer, Embedding):
                layers.setdefault((type(layer.method), layer.input_size, layer.output_size), layer)
        return list(layers.values())

    def _allocate_kv_cache(self) -> None:
        """`num_blocks` blocks and the dummy one, zeroed, so that slots never written hold finite values:
        masked-out attention weights multiply them."""
        mc = self.model_config
        # one block past the pool: padded decode rows write there (`init_decode_batches`)
        shape = (2, mc.num_layers, self.num_blocks + 1, self.block_size, self.num_kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=mc.dtype, device=self.device)
        for i, attn in enumerate(self.model.layers_kv()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]


def padded_tokens(tokens: int) -> int:
    """A prefill step's token count rounded up to one of 8 sizes per power of two (at most 1/8 more), kept as is up
    to 64. On a CPU with AMX, oneDNN builds a kernel for each new row count of a bf16 linear (~2 ms for a 300-row
    576x1536 projection, ~25 ms a step on a ~40M model) and reuses it after; prompts come in every length, so
    without this nearly every prefill would pay it. Without AMX (AMD Zen 4) the build costs ~0.5 ms, less than the
    padding rows: those CPUs run prefills unpadded. Decode-only steps stay unpadded: their sizes recur. The padding
    rows belong to no sequence: slot -1, not written to the KV cache, not attended to, not sampled."""
    if tokens <= 64:
        return tokens
    step = 1 << (tokens.bit_length() - 4)
    return -(-tokens // step) * step


def _round16(width: int) -> int:
    """Block tables are this wide: their row stride is a kernel argument, which Triton specializes by
    divisibility by 16, so a width that varied by step would compile new kernel variants while serving."""
    return -(-width // 16) * 16


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
