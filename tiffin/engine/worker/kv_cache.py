"""The KV cache's size and storage.

Invariant: on CUDA the pool is sized after a profiling step (the largest batch on just its blocks, the sampler's
worst case at a decode step's most rows, the decode graphs captured) whose KV and graphs are freed first; one
max_model_len sequence fits or start fails naming the numbers. Every layer's K and V live in one zeroed tensor
with one block past the pool, which padded decode rows write (`cuda_graphs`). Host KV blocks are tensors of the
same shapes, sized by their settings alone: the swap region's in the pool's format (a resumed sequence continues on
the KV it left), the prefix cache's host tier's in `KVCacheSpec.for_tier`'s (int8 codes and scales for a wider
pool with `kv_offload_dtype` int8)."""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.worker import pipeline_stage
from tiffin.engine.worker.batch import synthetic_step
from tiffin.engine.worker.sampler import Sampler
from tiffin.kernels import kv_quant

CPU_KV_CACHE_CAP = 4 << 30  # bytes; like vLLM's CPU backend default
# blocks of a CPU pool written at load, the free queue's first: a virtual machine may back fresh memory only when it
# is first written, ~0.5-0.8 s over a block of every layer on this project's VMs, which a first chat paid otherwise
FIRST_BLOCKS_WRITTEN = 16
GiB = 1 << 30


@dataclass(frozen=True)
class MemoryProbe:
    """The device memory readings KV sizing takes; unit tests pass fakes to check the arithmetic with no GPU."""

    mem_get_info: Callable[[torch.device], tuple[int, int]]  # (free, total) bytes, other processes' use counted
    # reserved, not allocated: the caching allocator's blocks, fragmentation included, are what the device lacks
    memory_reserved: Callable[[torch.device], int]
    max_memory_reserved: Callable[[torch.device], int]
    reset_peak_memory_stats: Callable[[torch.device], None]
    synchronize: Callable[[torch.device], None]
    empty_cache: Callable[[], None]


# looked up at each call, not bound at import: tests emulate torch.cuda (`tiffin.testing.cuda_emulation`)
CUDA_MEMORY = MemoryProbe(
    lambda device: torch.cuda.mem_get_info(device),
    lambda device: torch.cuda.memory_reserved(device),
    lambda device: torch.cuda.max_memory_reserved(device),
    lambda device: torch.cuda.reset_peak_memory_stats(device),
    lambda device: torch.cuda.synchronize(device),
    lambda: torch.cuda.empty_cache(),
)


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes measured by the profiling step."""

    total: int  # the device's memory
    free: int  # free after it, with the weights loaded and its KV released (CUDA context, other processes: used)
    peak: int  # what its forward and sampler pass reserved at most on top of what stays reserved
    graphs: int = 0  # what the decode graphs captured on its cache held (their pool stays reserved for good)

    def kv_blocks(self, utilization: float, bytes_per_block: int, max_blocks_per_seq: int) -> int:
        """Blocks of what `utilization` of the device leaves once what is in use and the largest step's
        activations are counted; ValueError naming the numbers when that is not one max_model_len sequence."""
        budget = int(self.total * utilization)
        in_use = self.total - self.free
        left = budget - in_use - self.peak - self.graphs
        blocks = max(left, 0) // bytes_per_block
        if blocks < max_blocks_per_seq:
            raise ValueError(
                f"max_model_len needs {max_blocks_per_seq} KV blocks ({max_blocks_per_seq * bytes_per_block / GiB:.2f} "
                f"GiB) for one sequence, but gpu_memory_utilization {utilization} of the device's "
                f"{self.total / GiB:.2f} GiB ({budget / GiB:.2f} GiB), less {in_use / GiB:.2f} GiB in use (weights, "
                f"CUDA context, other processes), {self.peak / GiB:.2f} GiB for the largest step's activations and "
                f"{self.graphs / GiB:.2f} GiB for the CUDA graphs, "
                f"leaves {left / GiB:.2f} GiB: lower max_model_len or max_num_batched_tokens, or raise "
                f"gpu_memory_utilization"
            )
        return blocks


@dataclass(frozen=True)
class KVCacheSpec:
    """One block's shape across every layer. A quantized cache (`kv_cache_dtype` int8 / fp8) stores codes of
    `dtype` and a scale per token and KV head (`tiffin.kernels.kv_quant`). Multi-head latent attention (DeepSeek,
    `ModelConfig.kv_latent_dim`) keeps one part, not K and V: a token's latent vector, one "KV head" of
    kv_lora_rank + qk_rope_head_dim that every query head reads as its key and (the first kv_lora_rank) value."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype
    parts: int = 2  # K and V; 1: a latent cache (MLA)

    @classmethod
    def of(cls, model_config: ModelConfig, block_size: int, num_kv_heads: int, kv_cache_dtype: str = "auto"):
        dtype = kv_quant.CACHE_DTYPES.get(kv_cache_dtype, model_config.dtype)
        if not model_config.kv_latent_dim:
            return cls(model_config.num_layers, block_size, num_kv_heads, model_config.head_dim, dtype)
        if dtype != model_config.dtype:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r}: {model_config.architecture}'s latent (MLA) KV cache is stored in "
                f"the model's dtype only; use kv_cache_dtype 'auto'"
            )
        return cls(model_config.num_layers, block_size, 1, model_config.kv_latent_dim, dtype, parts=1)

    def for_tier(self, kv_offload_dtype: str) -> "KVCacheSpec":
        """The host tier's blocks: int8 ones for `kv_offload_dtype` int8 where the pool stores wider values; else
        the pool's (a quantized pool's blocks go as they are: fp8 codes to int8 ones would lose bits, save none)."""
        if kv_offload_dtype == "int8" and self.parts == 1:
            raise ValueError("kv_offload_dtype 'int8' does not store a latent (MLA) KV cache; use 'auto'")
        return replace(self, dtype=torch.int8) if kv_offload_dtype == "int8" and not self.quantized else self

    @property
    def quantized(self) -> bool:
        return self.dtype in kv_quant.CODE_MAX

    @property
    def bytes_per_token(self) -> int:
        """K and V (or the latent) of one token in every layer, scales included."""
        head = self.head_dim * self.dtype.itemsize + (kv_quant.SCALE_DTYPE.itemsize if self.quantized else 0)
        return self.parts * self.num_layers * self.num_kv_heads * head

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def allocate(self, num_blocks: int, device: torch.device, layers_kv: list) -> list[torch.Tensor]:
        """`num_blocks` blocks and the dummy one, zeroed so that slots never written hold finite values (masked-out
        attention weights multiply them); each attention layer gets its K and V views (and its scales' views, or
        None; a latent cache's K and V views are one tensor). Returns the pool's tensors, each `[parts, num_layers,
        num_blocks + 1, block_size, ...]`: the cache, then
        the scales of a quantized one. On CPU the zeros are the operating system's (calloc): pages take memory once
        written, so the pool costs what requests use, FIRST_BLOCKS_WRITTEN of it from the start."""
        tensors = [_zeros(shape, dtype, device) for shape, dtype in self._shapes(num_blocks + 1)]
        if device.type == "cpu":
            for tensor in tensors:
                tensor[:, :, :FIRST_BLOCKS_WRITTEN].zero_()
        for i, attn in enumerate(layers_kv):
            attn.k_cache = tensors[0][0, i]
            attn.v_cache = tensors[0][1, i] if self.parts == 2 else attn.k_cache
            attn.k_scale, attn.v_scale = (tensors[1][0, i], tensors[1][1, i]) if self.quantized else (None, None)
        return tensors

    def allocate_host(self, num_blocks: int, pin: bool) -> list[torch.Tensor]:
        """Host blocks matching `allocate`'s tensors (the same shapes with `num_blocks` on dim 2, no dummy block),
        pinned for asynchronous copies when `pin` (CUDA); on CPU the operating system's zeros, as the pool's; none
        for no block."""
        if not num_blocks:
            return []
        if pin:
            return [torch.zeros(shape, dtype=dtype, pin_memory=True) for shape, dtype in self._shapes(num_blocks)]
        return [_zeros(shape, dtype, torch.device("cpu")) for shape, dtype in self._shapes(num_blocks)]

    def _shapes(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The pool's tensors for `num_blocks` blocks: the cache, then a quantized one's scales."""
        shape = (self.parts, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [(shape, self.dtype)] + [(shape[:-1], kv_quant.SCALE_DTYPE)] * self.quantized


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def num_host_blocks(
    config: EngineConfig, spec: KVCacheSpec, tier_spec: KVCacheSpec, prefix_caching: bool
) -> tuple[int, int]:
    """Host blocks of the prefix cache's tier (`kv_offload_memory` of `tier_spec`'s; none without prefix caching)
    and of the swap region (`swap_space` of `spec`'s, with preemption_mode swap), each a rank's share under tensor
    parallelism."""
    tier = config.kv_offload_memory // tier_spec.bytes_per_block if prefix_caching else 0
    swap = int(config.swap_space * GiB) // spec.bytes_per_block if config.preemption_mode == "swap" else 0
    return tier, swap


def num_kv_blocks(
    config: EngineConfig,
    spec: KVCacheSpec,
    max_blocks_per_seq: int,
    profile: Callable,
    pooling_only: bool = False,
    draft_bytes_per_block: int = 0,
) -> int:
    """`num_kv_blocks`, else what `kv_cache_memory` holds, else what `gpu_memory_utilization` of the GPU leaves
    (`profile()` measures the largest step; a default share of RAM on CPU); never more than max_num_seqs
    sequences of max_model_len use, nor, for a model that only pools (its sequences hold blocks for one step),
    more than one step's max_num_batched_tokens can fill (a partial block per sequence). A draft model's pool of
    as many blocks (`draft_bytes_per_block` each) shares the memory, as vLLM sizes them together."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    most = config.max_num_seqs * max_blocks_per_seq
    if pooling_only:
        most = min(most, -(-config.max_num_batched_tokens // spec.block_size) + config.max_num_seqs)
    bytes_per_block = spec.bytes_per_block + draft_bytes_per_block
    if config.kv_cache_memory is None and config.torch_device.type == "cuda":
        kv_blocks = profile().kv_blocks(config.gpu_memory_utilization, bytes_per_block, max_blocks_per_seq)
        return min(kv_blocks, most)
    memory = config.kv_cache_memory
    if memory is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = min(CPU_KV_CACHE_CAP, available // 4)
    blocks = min(memory // bytes_per_block, most)
    if blocks < 1:
        raise ValueError(f"KV cache memory of {memory} bytes holds no block of {bytes_per_block} bytes")
    return int(blocks)


def profile_memory(runner, probe: MemoryProbe, draft=None) -> MemoryProfile:
    """Runs `runner`'s largest step on a KV cache of just the blocks it needs: a forward of
    max_num_batched_tokens tokens (sequences of at most max_model_len, at most max_num_seqs of them), then a
    sampler pass over the most rows a decode step samples (`max_decode_rows`: a verifying step's are a sequence's
    proposals and one more) with every filter, penalty, seeded draw and 20 logprobs on (the sampler's worst
    case). When the runner captures CUDA graphs, they are captured on that cache too and what they hold
    measured, then dropped; so are a `draft` runner's (loaded, not started). That cache is released before free
    memory is read, so the real pool is sized from what stays in use. A vision-language model's step also runs the
    tower on as many images as its tokens hold placeholders of, and its encoder cache's bound counts as in use."""
    c, max_len, block_size = runner.config, runner.max_model_len, runner.block_size
    tokens = min(c.max_num_batched_tokens, c.max_num_seqs * max_len)
    lengths = [max_len] * (tokens // max_len) + [tokens % max_len] * (tokens % max_len > 0)
    runner.num_blocks = sum(-(-n // block_size) for n in lengths)
    scheduler_output = synthetic_step([(0, n) for n in lengths], block_size, runner.num_blocks)
    encoder, vision = runner.encoder, runner.model_config.multimodal
    if encoder is not None:
        profile = getattr(vision, "profile_pixels", None)  # the largest image, where images vary in size
        pixels = torch.zeros(3, *vision.processor.crop_size) if profile is None else profile()
        per_prompt = getattr(vision, "max_images_per_prompt", None)  # a dual encoder's one: a step's are its seqs'
        encoder.add_profile_images(
            scheduler_output, vision.tokens_per_image, pixels, per_prompt and per_prompt * c.max_num_seqs
        )
    probe.empty_cache()
    runner.allocate_kv_cache()
    reserved = probe.memory_reserved(runner.device)
    probe.reset_peak_memory_stats(runner.device)
    with torch.inference_mode():
        # a step holds its inputs and logits while it samples: so does this one (every rank at once: no broadcast)
        inputs = runner.prepare(scheduler_output)
        logits = runner.run_model(inputs)
        if runner.pp.size > 1 and runner.group.rank == 0:  # the logits the last stage sent, as after a step
            logits = pipeline_stage.receive_logits(runner, len(inputs.logits_indices))
        worst = dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20, min_tokens=2)
        worst |= dict(repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
        seqs = [
            Sequence("profile", i, [0], SamplingParams(**worst, seed=i if i % 2 else None), 1)
            for i in range(runner.max_decode_rows())
        ]
        for seq in seqs:
            seq.append_token(0)  # an output token: the penalties count outputs
        # the sampled logits come from the lm_head over those rows, as a decode step of that many computes them:
        # a quantized lm_head dequantizes its whole weight there from DENSE_MIN_TOKENS rows on
        model = runner.model_config
        rows = torch.zeros(len(seqs), model.hidden_size, dtype=model.dtype, device=runner.device)
        sampled = runner.model.compute_logits(rows) if model.task == "generate" and runner.pp.last else None
        if sampled is None:  # a pooling model, a tensor-parallel rank but the first, a pipeline stage but the last
            sampled = torch.zeros(len(seqs), model.vocab_size, device=runner.device)
        Sampler(runner.sampler.eos_token_ids)(sampled, seqs)  # not the engine's: its seeded stream stays unread
        del inputs, logits, rows, sampled
    probe.synchronize(runner.device)
    peak = probe.max_memory_reserved(runner.device) - reserved
    if encoder is not None:  # the cache fills up to its bound while serving
        encoder.reset()
        peak += runner.config.encoder_cache_bytes
    graphs = _graph_bytes(runner, probe)
    if draft is not None:  # its graphs, on a pool as small
        draft.num_blocks = runner.num_blocks
        draft.allocate_kv_cache()
        graphs += _graph_bytes(draft, probe)
        _release_kv(draft)
    _release_kv(runner)
    probe.empty_cache()
    free, total = probe.mem_get_info(runner.device)
    return MemoryProfile(total, free, peak, graphs)


def _graph_bytes(runner, probe: MemoryProbe) -> int:
    """What `runner`'s decode graphs, captured on its current cache and dropped, hold (0 when it captures none)."""
    if not runner.policy.capture_graphs:
        return 0
    before = probe.memory_reserved(runner.device)
    decode = runner.new_decode_graphs(runner.decode_graph_sizes())
    decode.capture(runner.model)
    probe.synchronize(runner.device)
    return probe.memory_reserved(runner.device) - before


def _release_kv(runner) -> None:
    del runner.kv_cache, runner.kv_tensors
    for attn in runner.model.layers_kv():
        attn.k_cache = attn.v_cache = torch.empty(0)
        attn.k_scale = attn.v_scale = None
