"""Turns a SchedulerOutput into one flattened forward pass, then samples: prepare -> forward -> sample.

Invariant: only the model runner builds tensors whose shape changes per step; the model sees the flattened
batch and its metadata, never requests."""

import ctypes
import dataclasses
import functools
import sys
from typing import NamedTuple

import numpy as np
import torch

from tiffin import kernels
from tiffin.engine.config import EngineConfig
from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.distributed.group import WorkerGroup
from tiffin.engine.distributed.join import world_size
from tiffin.engine.distributed.pipeline import UNSTAGED
from tiffin.engine.distributed.tensor_parallel import UNSHARDED
from tiffin.engine.lora.slots import LoRASlots
from tiffin.engine.models.config import ModelConfig, cpu_gemm_native
from tiffin.engine.models.loader import build_model
from tiffin.engine.models.pooler import PoolingMetadata
from tiffin.engine.multimodal.encoder import EncoderRunner, prefills_images
from tiffin.engine.multimodal.mrope import mrope_positions
from tiffin.engine.structured.backend import fill_bitmask
from tiffin.engine.worker import graphed_decode, kv_cache, kv_groups, pipeline_stage, tp_worker
from tiffin.engine.worker.batch import HostBatch, ModelInput, Upload, host_batch, pad_indices
from tiffin.engine.worker.cpu_decode import CpuDecoder
from tiffin.engine.worker.cpu_threads import ThreadSizer, usable_cpus
from tiffin.engine.worker.cuda_graphs import DecodeGraphs
from tiffin.engine.worker.graphed_decode import GraphedDecode, graph_refusal
from tiffin.engine.worker.kv_copies import KVBlockCopies
from tiffin.engine.worker.policy import choose_policy
from tiffin.engine.worker.prompt_logprobs import prompt_logprobs
from tiffin.engine.worker.sampler import Sampler, SamplerOutput
from tiffin.engine.worker.warm_up import warm_padded_sizes, warm_up_triton
from tiffin.quant.base import prepacks_for_onednn


def _on_device(method):
    """`method` under the runner's device whichever thread calls it: Triton launches on the calling thread's current
    device, not on its tensors' (the engine thread of `AsyncLLMEngine` is not the one that built the runner, and its
    current device is cuda:0 whatever `device` says)."""

    @functools.wraps(method)
    def on_device(self, *args):
        if self.device.type != "cuda":
            return method(self, *args)
        with torch.cuda.device(self.device):
            return method(self, *args)

    return on_device


class StepInFlight(NamedTuple):
    """A step `start_step` began: what `finish_step` samples it with. `logits` None under pipeline parallelism
    (the last stage sends `num_logits` rows when asked) or when no row samples."""

    scheduler_output: SchedulerOutput
    rows: list
    bitmask: object
    sampling: object
    logits: torch.Tensor | None
    pooled: torch.Tensor | None
    num_logits: int


class ModelRunner(KVBlockCopies, GraphedDecode):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        eos_token_ids: set[int],
        group: WorkerGroup | None = None,
        draft: "ModelRunner | None" = None,
        start: bool = True,
    ):
        """With `tensor_parallel_size` or `pipeline_parallel_size` > 1 this is rank 0, which starts the other ranks'
        workers (`group`: a worker's own, given to the runner of its rank). Loads the model, then, if `start`,
        starts the runner (`start`, with `draft`)."""
        self.config, self.model_config, self.max_model_len = config, model_config, max_model_len
        self.device = config.torch_device if group is None else group.device
        self.backend = kernels.resolve_backend(config.kernel_backend, self.device)
        native, dtype = kernels.cpu_native.library() is not None, model_config.dtype
        # fp32 is timed on CPU alone (`prepacks_for_onednn`) and at one rank: each rank would time the choice for
        # itself, and their policies must agree (the logits' gather is collective); 16-bit types where the CPU has
        # their GEMM (else torch's fallback, which builds nothing per size)
        onednn = self.device.type == "cpu" and (
            cpu_gemm_native(dtype) if dtype != torch.float32 else world_size(config) == 1 and prepacks_for_onednn(dtype)
        )
        self.policy = choose_policy(self.device, dtype, self.backend, onednn, config, native)
        refusal = graph_refusal(model_config)
        if refusal is not None and self.policy.capture_graphs:
            graphed_decode.logger.info("no CUDA graphs: %s", refusal)
            self.policy = dataclasses.replace(self.policy, capture_graphs=False)
        if group is None and world_size(config) > 1:
            group = tp_worker.start(config, model_config, max_model_len, self.device, ModelRunner)
        self.group = group
        tp, self.pp = (UNSHARDED, UNSTAGED) if group is None else (group.tp, group.pp)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device: cuda:1's tensors must not meet cuda:0's kernels (for the
            # start-up work here; steps set it themselves, `execute`)
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            _keep_freed_memory_mapped()
        # never more threads than the CPUs we may use; a lower count the user set stays the ceiling
        self.thread_sizer = (
            ThreadSizer(min(torch.get_num_threads(), usable_cpus())) if self.policy.size_threads else None
        )
        self.block_size = config.block_size
        self.tp, self.weights_path = tp, config.model  # where `sleep.wake_up` reloads weights dropped at level 2
        self.sleep_level = 0  # tiffin.engine.worker.sleep
        self.model = self.build_model(config.model)
        self.lora_slots = None
        if config.enable_lora and not getattr(self.model, "supports_lora", True):
            raise ValueError(f"{model_config.architecture}: LoRA adapters are not supported yet (enable_lora)")
        if config.enable_lora:
            whole = pipeline_stage.whole_model_layers(self) if self.pp.size > 1 and group.rank == 0 else None
            lora_args = config.max_loras, config.max_lora_rank, model_config.dtype, self.device, self.backend
            self.lora_slots = LoRASlots(self.model, *lora_args, group is not None, whole)
        self.sampler = Sampler(eos_token_ids, config.seed)
        multimodal = model_config.multimodal is not None
        # under tensor or pipeline parallelism rank 0 alone encodes images (`VisionLanguageModel`) and sends the
        # embeddings
        encodes = multimodal and tp.rank == 0 and self.pp.first
        self.encoder = EncoderRunner(self.model, config.encoder_cache_bytes, self.device) if encodes else None
        self.cpu_decoder: CpuDecoder | None = None  # built after sizing; the profiling step runs without it
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        kv_spec = kv_cache.KVCacheSpec.of(
            model_config, self.block_size, tp.kv_heads(model_config.num_kv_heads), config.kv_cache_dtype
        )
        self.kv_spec = dataclasses.replace(kv_spec, num_layers=len(self.model.layers_kv()))  # a pipeline stage's
        # the sliding-window layers' KV group (None: one pool of every layer) and its pool's blocks (0: not sized)
        self.window_group = kv_groups.window_group(self.model.layers_kv(), config)
        self.window_blocks = 0
        self.pending_offloads: list = []  # CUDA: (event, staged blocks, host pool, host ids), `finish_offloads`
        if start:
            self.start(draft=draft)

    def start(self, num_blocks: int | None = None, draft: "ModelRunner | None" = None) -> None:
        """Size the KV pool (`num_blocks`, else `kv_cache.num_kv_blocks`), allocate it and the host blocks, warm
        up, capture the decode graphs. A `draft` runner, its model loaded but not started, shares the pool's
        memory: its weights are in use when the profile reads free memory, its decode graphs are profiled with
        the target's, each block costs its KV too, and it starts on as many blocks. Its activations are not: a
        draft no larger than the target (whose worst step and sampler pass are) peaks lower, and never during the
        target's steps."""
        config, model_config, group = self.config, self.model_config, self.group
        if num_blocks is None:
            num_blocks = kv_cache.num_kv_blocks(
                config,
                self.kv_spec,
                self.max_blocks_per_seq,
                lambda: kv_cache.profile_memory(self, kv_cache.CUDA_MEMORY, draft),
                pooling_only=model_config.task != "generate",
                draft_bytes_per_block=0 if draft is None else draft.kv_spec.bytes_per_block,
            )
        self.num_blocks = num_blocks if group is None else group.agree_min(num_blocks)
        if self.window_group is not None:  # that memory split between the two groups
            cap = kv_groups.window_pool_cap(self.window_group, config)
            most = config.max_num_seqs * self.max_blocks_per_seq
            split = kv_groups.split_pool(self.num_blocks, self.kv_spec.num_layers, self.window_group, cap, most)
            self.num_blocks, self.window_blocks = split
        self.build_caches()
        if draft is not None:
            draft.start(self.num_blocks)

    def build_caches(self, warm_up: bool = True) -> None:
        """What runs on the weights, for `num_blocks` blocks: the KV pool and host blocks, the native decoder,
        warm-ups (`warm_up`: what they build, compiled kernels and oneDNN primitives, outlives a sleep), the decode
        graphs (`start`; `sleep.wake_up` again)."""
        config, model_config = self.config, self.model_config
        self.allocate_kv_cache()
        prefix_caching = config.enable_prefix_caching and model_config.causal
        self.tier_spec = self.kv_spec.for_tier(config.kv_offload_dtype)
        self.num_host_blocks = kv_cache.num_host_blocks(config, self.kv_spec, self.tier_spec, prefix_caching)
        if self.pp.size > 1:  # the stages' layer counts differ
            self.num_host_blocks = tuple(map(self.group.agree_min, self.num_host_blocks))
        pin = self.device.type == "cuda"
        self.host_tier = self.tier_spec.allocate_host(self.num_host_blocks[0], pin)
        self.host_swap = self.kv_spec.allocate_host(self.num_host_blocks[1], pin)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.cpu_decoder = CpuDecoder.build(self.model, self.block_size) if self.policy.native_decode else None
        if self.policy.warm_up_triton and warm_up:
            warm_up_triton(self)
        if self.policy.pad_rows and warm_up:
            threads = [torch.get_num_threads()] if self.thread_sizer is None else self.thread_sizer.counts()
            warm_padded_sizes(self.model, model_config, config.max_num_batched_tokens, self.max_decode_rows(), threads)
        self.decode_graphs: DecodeGraphs | None = None  # None: decode steps run unpadded
        if self.policy.capture_graphs:
            self.pad_decodes(self.decode_graph_sizes())

    def build_model(self, path: str) -> torch.nn.Module:
        """The model with the weights of the checkpoint at `path` (this rank's shard)."""
        quant_backend = self.config.cpu_quant_compute if self.policy.int8_quantized else self.backend
        return build_model(
            self.model_config, path, self.device, self.max_model_len, self.backend, self.tp, quant_backend, self.pp
        )

    def execute(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        """One step."""
        return self.finish_step(self.start_step(scheduler_output))

    @_on_device
    @torch.inference_mode()
    def start_step(self, scheduler_output: SchedulerOutput) -> "StepInFlight":
        """A step up to its logits: the forward, or under pipeline parallelism the first stage's part of it (the
        other stages compute theirs meanwhile; `finish_step` receives the logits)."""
        if self.thread_sizer is not None:
            self.thread_sizer.update()
        self.copy_blocks(scheduler_output.copies)
        rows = [row for seq in scheduler_output.sampling_seqs for row in seq.sampling_rows()]  # one per logits row
        bitmask = fill_bitmask(rows, self.model_config.vocab_size)  # filled while the forward runs
        # the step's host arrays (the batch's, the sampler's) go to the device in one pinned copy
        upload = Upload(self.device)
        sampling = self.sampler.stage(rows, upload, self.model_config.vocab_size)
        graphs = self.decode_graphs is not None and not scheduler_output.pooling_seqs
        graphs = graphs and not (self.encoder is not None and prefills_images(scheduler_output))
        size = self.decode_graphs.size_for(scheduler_output) if graphs else 0
        pooled, num_logits = None, len(rows) + sum(n for _, _, n in scheduler_output.prompt_rows)
        if size:
            logits = self.graphed_step(scheduler_output, upload, size)
        elif self.group is None:
            logits, pooled = self.run_model(self.prepare(scheduler_output, upload))
        else:  # the other ranks run the same step on their shards
            inputs = self.prepare(scheduler_output, upload)
            logits, pooled = tp_worker.run(
                self.group, inputs, self.lora_slots, scheduler_output.copies, lambda: self.run_model(inputs)
            )
        return StepInFlight(scheduler_output, rows, bitmask, sampling, logits, pooled, num_logits)

    @_on_device
    @torch.inference_mode()
    def finish_step(self, step: "StepInFlight") -> SamplerOutput:
        """Sample a step `start_step` began (under pipeline parallelism, the steps in the order they began)."""
        scheduler_output, rows = step.scheduler_output, step.rows
        logits = pipeline_stage.receive_logits(self, step.num_logits) if self.pp.size > 1 else step.logits
        # logits rows: the sampling rows, then the prompt rows (`worker.prompt_logprobs`)
        prompt = prompt_logprobs(logits[len(rows) :], scheduler_output) if scheduler_output.prompt_rows else []
        out = self.sampler(logits[: len(rows)], rows, step.bitmask, step.sampling) if rows else SamplerOutput([], [])
        out.prompt_logprobs = prompt
        out.pooled = [] if step.pooled is None else self.finish_pooling(step.pooled, scheduler_output.pooling_seqs)
        return out

    @torch.inference_mode()
    def run_model(self, inputs: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the step's sampling tokens (None when none samples) and the pooled rows of its pooling
        sequences (None when none pools); with tensor parallelism on rank 0 only (None elsewhere)."""
        if self.pp.size > 1:
            return pipeline_stage.run_stage(self, inputs)
        if self.cpu_decoder is not None and inputs.attn.max_query_len == 1 and inputs.mm is None:
            hidden = self.cpu_decoder(inputs.input_ids, inputs.positions, inputs.attn)
        else:
            images = {} if inputs.mm is None else {"mm": inputs.mm}
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.lora, **images)
        # the same test on every rank: the logits' gather is a collective
        rows = len(inputs.logits_indices)
        if not (rows and self.model_config.task == "generate"):
            logits = None
        elif self.policy.pad_rows:  # the padding rows' logits cut before anything reads them
            logits = self.model.compute_logits(hidden[pad_indices(inputs.logits_indices)])
            logits = None if logits is None else logits[:rows]
        else:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits, None if inputs.pooling is None else self.model.pool(hidden, inputs.pooling)

    def finish_pooling(self, pooled: torch.Tensor, seqs: list) -> list[list[float]]:
        """Each pooling sequence's result as its params ask: an embedding cut to its `dimensions`, then normalized
        (by default as the model was trained); a classifier's scores as they are."""
        normalize_by_default = self.model_config.pooler.normalize
        results = []
        for row, params in zip(pooled.cpu(), (s.pooling_params for s in seqs)):
            if params.task == "embed":
                row = row[: params.dimensions]
                if normalize_by_default if params.normalize is None else params.normalize:
                    row = torch.nn.functional.normalize(row, dim=0)
            results.append(row.tolist())
        return results

    def shutdown(self) -> None:
        """Complete the pending offloads; end the tensor-parallel workers, if any."""
        self.finish_offloads()
        if self.group is not None:
            self.group.shutdown()

    def host_batch(self, scheduler_output: SchedulerOutput, pad: bool = True) -> HostBatch:
        """The step's host arrays, padded to a row bucket where the policy says (and `pad`); M-RoPE's positions
        for a model that takes them (`multimodal.mrope`)."""
        # the native decoder reads a sequence per row, and its int8 kernels keep nothing per row count
        native = self.cpu_decoder is not None and max(scheduler_output.num_scheduled_tokens) == 1
        pad = pad and self.policy.pad_rows and not native
        b = host_batch(scheduler_output, self.block_size, pad, self.window_pool if self.window_group else 0)
        if getattr(self.model, "uses_mrope", False):
            b.positions = mrope_positions(b.positions, scheduler_output, b.query_lens)
        return b

    def prepare(self, scheduler_output: SchedulerOutput, upload: Upload | None = None) -> ModelInput:
        """`scheduler_output` as the model takes it on the device, sent with what `upload` holds already;
        installs the step's adapters."""
        b = self.host_batch(scheduler_output)
        upload = upload or Upload(self.device)
        arrays = (
            (b.input_ids, np.int64),
            (b.positions, np.int64),
            (b.slots, np.int64),
            (b.query_start_loc, np.int32),
            (b.seq_lens, np.int32),
            (b.block_tables, np.int32),
            (b.logits_indices, np.int64),
        )
        if b.window_tables is not None:
            arrays += ((b.window_slots, np.int64), (b.window_tables, np.int32))
        parts = [upload.add(a.astype(dtype, copy=False)) for a, dtype in arrays]
        pooling_parts, starts = None, np.cumsum(b.query_lens) - b.query_lens
        if scheduler_output.pooling_seqs:
            pools = np.array([s.pooling_params is not None for s in scheduler_output.seqs])
            host = PoolingMetadata.host_arrays(starts[pools], b.query_lens[pools])
            pooling_parts = [upload.add(a) for a in host]
        lora = None
        if self.lora_slots is not None:  # padding rows run on the base model, as a sequence of their own
            loras = [s.lora for s in scheduler_output.seqs] + [None]
            padding = len(b.input_ids) - int(b.query_start_loc[-1])
            lora = self.lora_slots.stage(loras, [*b.query_lens, padding], upload.add)
        upload.send()
        input_ids, positions, slots, query_start_loc, seq_lens, block_tables, logits_indices, *window = map(
            upload.get, parts
        )
        attn = kernels.AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_start_loc_cpu=b.query_start_loc.tolist(),
            seq_lens_cpu=b.seq_lens.tolist(),
            max_query_len=int(np.diff(b.query_start_loc).max()),
            max_seq_len=int(b.seq_lens.max()),
        )
        if window:
            attn.sliding = dataclasses.replace(attn, slot_mapping=window[0], block_tables=window[1])
        pooling = None if pooling_parts is None else PoolingMetadata(*map(upload.get, pooling_parts))
        mm = None if self.encoder is None else self.encoder.step_embeddings(scheduler_output, starts)
        return ModelInput(input_ids, positions, attn, logits_indices, lora and lora(upload.get), pooling, mm)

    def allocate_kv_cache(self) -> None:
        """`kv_tensors`: every tensor of the pool, blocks on dim 2 (`KVCacheSpec.allocate`; each group's, `kv_groups`);
        `kv_cache` the first."""
        layers, group = self.model.layers_kv(), self.window_group
        if group is None:
            self.kv_tensors = self.kv_spec.allocate(self.num_blocks, self.device, layers)
        else:
            args = self.kv_spec, self.num_blocks, self.window_pool, self.device, layers, group
            self.kv_tensors = kv_groups.allocate(*args)
        self.kv_cache = self.kv_tensors[0]

    @property
    def kv_window(self) -> tuple[int, int] | None:
        """(the window, the window group's blocks) where the sliding-window layers keep a KV group; else None."""
        return None if self.window_group is None else (self.window_group.window, self.window_blocks)

    @property
    def window_pool(self) -> int:
        """The window group's blocks: as many as the global group's until `start` splits the pool (profiling)."""
        return self.window_blocks or self.num_blocks


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
