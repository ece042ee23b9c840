"""Sleep mode and weight reload of one model runner (each rank's, under tensor parallelism): its memory handed back
without ending the process, and weights swapped in place.

- `sleep(runner, 1)`: the KV pool, its host blocks, the decode graphs and the native decoder freed; the weights
  kept, on CUDA copied to host memory first. `sleep(runner, 2)`: the weights dropped too. `wake_up` rebuilds what
  sleep freed (`ModelRunner.build_caches`, as many blocks as before), level 2's weights read again from
  `runner.weights_path`.
- `load_weights(runner, path)`: the checkpoint at `path` (shapes checked by the engine first) replaces the weights.
  The old ones are dropped before the new ones load, so the peak is one copy of the weights, not two; a load that
  fails midway reloads the old checkpoint before raising.

Weights are swapped slot by slot (`weight_slots`): every tensor a module holds but the attention layers' KV views
and the LoRA slots, replaced in the module that holds it, so the model's modules (which LoRA slots and attention
layers are bound to) stay the same objects. What holds raw pointers into weights or KV (the native decoder, CUDA
graphs) is rebuilt.
On CPU memory freed goes back to the OS at once: the runner raises glibc's trim threshold (`model_runner`), so
the heap is trimmed explicitly."""

import copy as copy_module
import ctypes
import dataclasses
import functools
import sys
from collections.abc import Callable

import torch

from tiffin.engine.distributed.group import Command
from tiffin.engine.worker.cpu_decode import CpuDecoder

# an attention layer's views of the KV pool (`KVCacheSpec.allocate`) and a Linear's LoRA slots: kept, not weights
KEPT = frozenset({"k_cache", "v_cache", "k_scale", "v_scale", "adapters"})

Slots = dict[tuple[str, str], tuple[dict, str]]


def weight_slots(model: torch.nn.Module) -> Slots:
    """(module name, key) -> (the dict holding it, its key), for each value of `model`'s modules that holds tensors:
    parameters, buffers, and attributes holding tensors directly or in lists, tuples, dicts or dataclasses (a
    packed layout, quantized blocks); the same keys for two models built alike."""
    slots = {}
    for name, module in model.named_modules():
        public = {k: v for k, v in module.__dict__.items() if not k.startswith("_")}
        for held in (module._parameters, module._buffers, public):
            for key, value in held.items():
                if key not in KEPT and _holds_tensors(value):
                    slots[name, key] = (module.__dict__ if held is public else held), key
    return slots


def _holds_tensors(value) -> bool:
    return isinstance(value, torch.Tensor) or any(map(_holds_tensors, _parts(value)))


def _parts(value) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return list(vars(value).values()) if dataclasses.is_dataclass(value) and not isinstance(value, type) else []


def _map(value, to: Callable[[torch.Tensor], torch.Tensor], memo: dict):
    """`value` with each tensor replaced by `to(tensor)` (a Parameter kept a Parameter), the same structure around
    them; views of one storage alike (`memo`) map to one result, so that shared weights stay shared."""
    if isinstance(value, torch.Tensor):
        key = id(value) if value.is_mkldnn else (value.data_ptr(), value.dtype, value.shape, value.stride())
        if key not in memo:
            memo[key] = to(value.detach())
        moved = memo[key]
        return torch.nn.Parameter(moved, requires_grad=False) if isinstance(value, torch.nn.Parameter) else moved
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, to, memo) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, to, memo) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copy = copy_module.copy(value)
        for k, v in vars(value).items():
            object.__setattr__(copy, k, _map(v, to, memo))
        return copy
    return value


def _move(slots: Slots, to: Callable[[torch.Tensor], torch.Tensor]) -> Slots:
    """Each slot's tensors replaced by `to(tensor)`; returns the slots."""
    memo = {}
    for held, key in slots.values():
        held[key] = _map(held[key], to, memo)
    return slots


def sleep(runner, level: int) -> None:
    """Free the KV pool and what runs on it; at level 1 keep the weights (on CUDA in host memory), at level 2
    drop them."""
    runner.finish_offloads()
    runner.decode_graphs = runner.cpu_decoder = None
    runner.host_tier = runner.host_swap = []
    del runner.kv_cache, runner.kv_tensors
    for attn in runner.model.layers_kv():
        attn.k_cache = attn.v_cache = torch.empty(0)
        attn.k_scale = attn.v_scale = None
    if level == 2:
        _move(weight_slots(runner.model), _empty)
    elif runner.device.type == "cuda":
        runner.offloaded = _move(weight_slots(runner.model), lambda t: t.to("cpu").pin_memory())
    runner.sleep_level = level
    release_memory(runner.device)


def wake_up(runner) -> None:
    """Undo `sleep`: the weights back (read again after level 2), then the KV pool and what runs on it."""
    if runner.sleep_level == 2:
        _fill(runner.model, runner.build_model(runner.weights_path))
    elif runner.device.type == "cuda":
        _move(runner.offloaded, lambda t: t.to(runner.device))
        del runner.offloaded
    runner.build_caches(warm_up=False)
    runner.sleep_level = 0


def load_weights(runner, path: str) -> None:
    """Replace the weights with the checkpoint's at `path` (same architecture and shapes: the engine checked);
    the KV pool stays. A load that fails reloads the old weights, then raises."""
    runner.finish_offloads()
    runner.cpu_decoder = None
    if runner.device.type == "cuda":  # captured graphs read the weights where they were
        runner.decode_graphs = None
    _move(weight_slots(runner.model), _empty)
    release_memory(runner.device)
    try:
        _fill(runner.model, runner.build_model(path))
    except BaseException:
        _fill(runner.model, runner.build_model(runner.weights_path))
        raise
    finally:
        if runner.policy.native_decode:
            runner.cpu_decoder = CpuDecoder.build(runner.model, runner.block_size)
        if runner.decode_graphs is None and runner.policy.capture_graphs:
            runner.pad_decodes(runner.decode_graph_sizes())
    runner.weights_path = path


def _empty(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _fill(model: torch.nn.Module, fresh: torch.nn.Module) -> None:
    """Take the weights of `fresh` (built from a checkpoint as `model` was) into `model`'s modules."""
    slots, new = weight_slots(model), weight_slots(fresh)
    if slots.keys() != new.keys():  # a model built alike holds its tensors in the same places
        raise RuntimeError(f"the reloaded model holds its weights elsewhere: {sorted(slots.keys() ^ new.keys())[:4]}")
    for place, (held, key) in slots.items():
        src, src_key = new[place]
        held[key] = src[src_key]


def release_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA's cached blocks, and on the CPU glibc's free heap pages."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif (libc := _libc()) is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def on_every_rank(runner, name: str, *args) -> None:
    """`name(runner, *args)` (a function of this module) on this runner and, under tensor parallelism, on every
    rank's (`WorkerGroup.command`)."""
    run = functools.partial(globals()[name], runner, *args)
    if runner.group is None:
        return run()
    runner.group.command(Command(name, args), run)
