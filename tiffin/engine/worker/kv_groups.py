"""The sliding-window layers' KV cache group at the worker (`core.window_blocks` keeps its blocks): which layers
form it, how the pool's memory splits between the groups, and each group's tensors.

A model whose attention layers mix windows with global attention (`Attention.window` > 0 on some, 0 on others,
one window for all: Gemma 2/3) keeps two groups unless the engine runs what does not know them yet, where it keeps
one pool for every layer as before, saying which: tensor or pipeline parallelism, preemption by swap, the prefix
cache's host tier, speculative decoding. CUDA graphs take each group's tables and slots (`cuda_graphs`). A model
without windows keeps one pool, unchanged.

Memory: the pool is sized as one group of every layer (`kv_cache.num_kv_blocks`: N blocks), then split. The window
group gets at most `window_pool_cap` blocks (a window and two blocks for each of max_num_seqs sequences, and one
step's tokens: what the scheduler's sequences hold between their steps, as `core.window_blocks` frees them), the
global group the rest of the memory; with N at or below that cap, N blocks each (no saving, nothing short).
"""

import logging
from dataclasses import dataclass, replace

import torch

from tiffin.engine.config import EngineConfig
from tiffin.engine.worker.kv_cache import KVCacheSpec

logger = logging.getLogger("tiffin.kv_groups")


@dataclass(frozen=True)
class WindowGroup:
    layers: tuple[int, ...]  # the windowed layers' places in `model.layers_kv()`
    window: int


def window_group(layers_kv: list, config: EngineConfig) -> WindowGroup | None:
    """The windowed layers' group, or None: one group of every layer."""
    windows = [getattr(attn, "window", 0) for attn in layers_kv]
    local = tuple(i for i, window in enumerate(windows) if window)
    if not local or len(local) == len(windows) or len({windows[i] for i in local}) > 1:
        return None
    off = {
        "tensor or pipeline parallelism": config.tensor_parallel_size * config.pipeline_parallel_size > 1,
        "preemption_mode swap": config.preemption_mode == "swap",
        "kv_offload_memory": bool(config.kv_offload_memory),
        "speculative decoding": config.speculative_config is not None,
    }
    reasons = [name for name, on in off.items() if on]
    if reasons:
        logger.info("sliding-window layers keep KV for the whole context: not yet with %s", ", ".join(reasons))
        return None
    return WindowGroup(local, windows[local[0]])


def window_pool_cap(group: WindowGroup, config: EngineConfig) -> int:
    block_size = config.block_size
    per_seq = -(-(group.window - 1) // block_size) + 2
    return config.max_num_seqs * per_seq + -(-config.max_num_batched_tokens // block_size)


def split_pool(num_blocks: int, num_layers: int, group: WindowGroup, cap: int, most: int) -> tuple[int, int]:
    """(the global group's blocks, the window group's) in the memory of `num_blocks` blocks of `num_layers` layers:
    the window group at most `cap` blocks, the global one at most `most` (what max_num_seqs sequences of
    max_model_len use)."""
    if num_blocks <= cap:
        return num_blocks, num_blocks
    num_global = num_layers - len(group.layers)
    return min((num_blocks * num_layers - cap * len(group.layers)) // num_global, most), cap


def allocate(
    spec: KVCacheSpec, num_blocks: int, window_blocks: int, device: torch.device, layers_kv: list, group: WindowGroup
) -> list[torch.Tensor]:
    """Each group's tensors (`KVCacheSpec.allocate`): the global layers' on `num_blocks` blocks, then the windowed
    layers' on `window_blocks`."""
    local = [layers_kv[i] for i in group.layers]
    full = [attn for i, attn in enumerate(layers_kv) if i not in group.layers]
    tensors = replace(spec, num_layers=len(full)).allocate(num_blocks, device, full)
    return tensors + replace(spec, num_layers=len(local)).allocate(window_blocks, device, local)
