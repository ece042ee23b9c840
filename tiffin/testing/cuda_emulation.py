"""CUDA emulated on the CPU, so that tests drive the engine's CUDA code paths (graph capture, warm-up, pinned
uploads, per-thread devices) with Triton kernels under `TRITON_INTERPRET=1`.

How a device is represented: every tensor's memory is CPU memory; a tensor is "on cuda:N" when its storage is
tagged N (a weak map keyed by the storage object, so a tag dies with its memory). Tags are set by a
`TorchFunctionMode` installed in every thread (tiffin.testing.emulated_devices): factories given a CUDA device (and
`torch.device("cuda")` contexts, which pass one) allocate on the CPU and tag; `.to`/`.cuda`/`.cpu` copy between
tagged and untagged memory; any other op's results take the device of its tensor arguments. The mode answers
`tensor.device` / `.is_cuda` / `.get_device()` with the tag, so the engine sees CUDA tensors and takes its CUDA
paths (and the native CPU kernels, which check `device.type`, stay out). `.pin_memory()` returns a copy marked
pinned.

What it enforces, each raising `EmulatedCudaError`:
- ops mixing tensors of two CUDA devices, or a host array with device tensors (host scalars pass as values, host
  index tensors as torch moves them);
- a Triton launch (`triton_common.Launch`) whose tensors are not all on the launching thread's current device
  (Triton launches on the thread's current device, whatever its pointers);
- inside a capture: host reads of device memory (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, ...), uploads
  from pageable memory (`torch.tensor(data, device=...)`, `.to(device)` / `copy_` from unpinned memory) and
  ops whose output shape depends on the data (nonzero, masked_select, unique, boolean indexing, ...);
- a replay that uses a tensor the capture did not allocate (outside its pool) and whose memory was freed since.

A capture (`torch.cuda.graph`; tiffin.testing.emulated_graphs) records, in its thread, every aten op (a
`TorchDispatchMode`) and Triton launch issued inside; `replay()` re-runs them on the very tensors captured, copying
fresh results into the captured outputs, as a CUDA graph replays kernels on fixed addresses. What the capture
allocated (its pool) the graph keeps; what it used from outside it keeps by address only (a weak reference to the
storage). Ops that only make views are not recorded (their outputs alias their inputs). Host-side ops captured are
replayed too, which a real graph would not do: they recompute what they computed, so results do not change. Not
modelled: streams (work runs when issued), the pool's reuse of memory freed within a capture (a graph here holds
every intermediate, so graph memory reads higher than on a GPU), bf16 (the interpreter's bf16 dots are wrong: test
in fp32/fp16). GEMMs launch tiles as wide as their outputs (up to 512 columns, `triton_common.EMULATED_WIDTH`): the
interpreter's time goes by program, not by element; the kernel tests check the tiles a GPU launches.

Tensor parallelism: `init_process_group("nccl")` joins with gloo (the collectives then run on the memory behind
the devices), and the worker processes a group starts run under an emulation of their own (the same settings),
whose graph replays `worker_replays()` reads once they have ended. A collective captured in a graph is replayed
with it, and replay waits for it, as a graph's stream does.

Counted, for tests to assert per step: `uploads` (host -> device copies) and `reads` (device -> host), each a
list of short descriptions; `launches` (the Triton kernels launched, by name); a graph's `kernels()` lists what
its replay would launch. `allocated(device)` and the peak are tracked from tagged storages, behind
`torch.cuda.memory_allocated` / `mem_get_info`.
"""

import contextlib
import dataclasses
import functools
import tempfile
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tiffin.testing.emulated_devices import DeviceMode
from tiffin.testing.emulated_graphs import (
    EmulatedCudaError,
    EmulatedEvent,
    EmulatedGraph,
    EmulatedNode,
    EmulatedStream,
    make_graph_context,
    no_modes,
    stream_context,
)

__all__ = ["CudaEmulation", "EmulatedCudaError"]

GiB = 1 << 30


class CudaEmulation:
    """`with CudaEmulation(): ...` patches `torch.cuda` and Triton launches; see the module docstring."""

    def __init__(self, device_count: int = 2, total_memory: int = 16 * GiB, capability=(8, 0), sms: int = 4):
        # sms: what `triton_common.num_sms` tells the interpreter, so that split paths run alike
        self.device_count, self.total_memory, self.capability, self.sms = device_count, total_memory, capability, sms
        self._device_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> device index
        self._pinned: weakref.WeakSet = weakref.WeakSet()  # host storages made by pin_memory()
        self._allocated = [0] * device_count
        self._peak = [0] * device_count
        self._local = threading.local()  # current device, capture
        self._lock = threading.Lock()
        self.uploads: list[str] = []
        self.reads: list[str] = []
        self.launches: list[str] = []
        self.replays = 0  # graph replays, never reset
        self._patches: contextlib.ExitStack | None = None

    # -- counters ----------------------------------------------------------------------------------------------

    def reset_counts(self) -> None:
        self.uploads.clear()
        self.reads.clear()
        self.launches.clear()

    def allocated(self, device=None) -> int:
        return self._allocated[self.index(device)]

    # -- devices -----------------------------------------------------------------------------------------------

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device) -> None:
        self._local.device = self.index(device)

    def index(self, device) -> int:
        """The CUDA index `device` (int, str, torch.device, None: current) names."""
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise EmulatedCudaError(f"not a CUDA device: {device}")
            index = self.current_device() if device.index is None else device.index
        if not 0 <= index < self.device_count:
            raise EmulatedCudaError(f"invalid device ordinal {index} (emulating {self.device_count} devices)")
        return index

    def device_of(self, t: torch.Tensor) -> int | None:
        """The CUDA index `t` lives on, None for host memory."""
        with torch._C.DisableTorchFunction():
            if t.device.type != "cpu":  # meta tensors (compile checks) are nobody's
                return None
            return self._device_of.get(t.untyped_storage())

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage() in self._pinned

    def _tag(self, t: torch.Tensor, index: int) -> None:
        storage = t.untyped_storage()
        if storage in self._device_of:  # empty tensors too: each has a storage of its own
            return
        self._device_of[storage] = index
        nbytes = storage.nbytes()
        with self._lock:
            self._allocated[index] += nbytes
            self._peak[index] = max(self._peak[index], self._allocated[index])
        weakref.finalize(storage, self._free, index, nbytes)

    def _free(self, index: int, nbytes: int) -> None:
        with self._lock:
            self._allocated[index] -= nbytes

    # -- capture -----------------------------------------------------------------------------------------------

    @property
    def capturing(self) -> "EmulatedGraph | None":
        return getattr(self._local, "capture", None)

    def _check_capture(self, what: str) -> None:
        if self.capturing is not None:
            raise EmulatedCudaError(
                f"{what} inside a CUDA graph capture (operation not permitted when stream is capturing)"
            )

    # -- install -----------------------------------------------------------------------------------------------

    def __enter__(self) -> "CudaEmulation":
        from tiffin.engine.distributed import group as group_module
        from tiffin.kernels import kv_quant, triton_common, triton_lora

        self._patches = stack = contextlib.ExitStack()
        emu = self
        # device tensors cached by (size, device) outlive an emulation; the next one would see them as host memory
        # and an arch read under another emulation's capability would stay
        for cached in (kv_quant._hadamard, kv_quant._signs, triton_lora._offsets, triton_common.arch):
            cached.cache_clear()
            stack.callback(cached.cache_clear)

        def patch(owner, name, value):
            old = getattr(owner, name)
            setattr(owner, name, value)
            stack.callback(setattr, owner, name, old)

        cuda = torch.cuda
        fake = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "device_count": lambda: self.device_count,
            "current_device": self.current_device,
            "set_device": self.set_device,
            "device": _make_device_context(self),
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "mem_get_info": lambda device=None: (
                self.total_memory - self._allocated[self.index(device)],
                self.total_memory,
            ),
            "memory_allocated": lambda device=None: self._allocated[self.index(device)],
            "memory_reserved": lambda device=None: self._allocated[self.index(device)],
            "max_memory_allocated": lambda device=None: self._peak[self.index(device)],
            "max_memory_reserved": lambda device=None: self._peak[self.index(device)],
            "reset_peak_memory_stats": self._reset_peak,
            "get_device_capability": lambda device=None: self.capability,
            "get_device_name": lambda device=None: "emulated CUDA device",
            "get_device_properties": lambda device=None: SimpleNamespace(
                name="emulated CUDA device",
                multi_processor_count=self.sms,
                total_memory=self.total_memory,
                major=self.capability[0],
                minor=self.capability[1],
            ),
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "Stream": EmulatedStream,
            "Event": EmulatedEvent,
            "current_stream": lambda device=None: EmulatedStream(),
            "default_stream": lambda device=None: EmulatedStream(),
            "stream": stream_context,
            "CUDAGraph": lambda *args, **kwargs: EmulatedGraph(emu),
            "graph": make_graph_context(self),
            "graph_pool_handle": lambda: object(),
        }
        for name, value in fake.items():
            patch(cuda, name, value)
        patch(torch, "Generator", _Generator)

        original_launch = triton_common.Launch.__call__

        def launch(self_launch, device: torch.device) -> None:
            emu._launch(self_launch, lambda launch: original_launch(launch, torch.device("cpu")))

        patch(triton_common.Launch, "__call__", launch)
        # split-K tile counters are kept per device: ones from before this emulation are untagged host memory
        patch(triton_common, "_TILE_COUNTERS", {})
        patch(triton_common, "EMULATED_WIDTH", 512)

        # tensor parallelism: NCCL's collectives run by gloo on the memory behind the devices, and the worker
        # processes of a group under an emulation of their own (`worker_replays`)
        original_init = dist.init_process_group

        def init_process_group(backend=None, **kwargs):
            if backend == "nccl":
                backend, kwargs = "gloo", {k: v for k, v in kwargs.items() if k != "device_id"}
            return original_init(backend, **kwargs)

        patch(dist, "init_process_group", init_process_group)
        self._stats = stack.enter_context(tempfile.TemporaryDirectory(prefix="tiffin-emulated-workers-"))
        settings = dict(
            device_count=self.device_count, total_memory=self.total_memory, capability=self.capability, sms=self.sms
        )
        patch(group_module, "_worker", functools.partial(_emulated_worker, settings, self._stats))

        original_run = threading.Thread.run

        def run(thread):  # every thread sees CUDA tensors as the one that started the emulation does
            with DeviceMode(emu):
                original_run(thread)

        patch(threading.Thread, "run", run)
        stack.enter_context(DeviceMode(self))
        return self

    def __exit__(self, *exc) -> None:
        self._patches.close()

    def worker_replays(self) -> dict[int, int]:
        """Graph replays of each tensor-parallel worker that has ended (rank -> count)."""
        return {int(f.stem[4:]): int(f.read_text()) for f in Path(self._stats).glob("rank*")}

    def _reset_peak(self, device=None) -> None:
        index = self.index(device)
        self._peak[index] = self._allocated[index]

    def _launch(self, launch, run) -> None:
        """Triton launches on the current device: every tensor argument must be there."""
        current = self.current_device()
        for arg in launch.args:
            if isinstance(arg, torch.Tensor) and arg.numel():
                with no_modes():
                    where = self.device_of(arg)
                if where != current:
                    place = "host memory" if where is None else f"cuda:{where}"
                    raise EmulatedCudaError(
                        f"{launch.kernel.fn.__name__} launched on cuda:{current} (the thread's current device) "
                        f"with a tensor in {place}: an illegal memory access on a GPU"
                    )
        self.launches.append(launch.kernel.fn.__name__)
        if self.capturing is not None:
            again = lambda *args: run(dataclasses.replace(launch, args=args))
            again.__name__ = launch.kernel.fn.__name__  # what `EmulatedGraph.kernels` names it by
            self.capturing.nodes.append(EmulatedNode(again, launch.args, {}, None))
        with no_modes():
            run(launch)


def _emulated_worker(settings: dict, stats: str, *worker_args) -> None:
    """A tensor-parallel worker process (`group._worker`) under an emulation like its engine's; once it ends, its
    graph replays in `stats`/rank<N>."""
    from tiffin.engine.distributed.group import _worker

    with CudaEmulation(**settings) as emu:
        try:
            _worker(*worker_args)
        finally:
            (Path(stats) / f"rank{worker_args[1]}").write_text(str(emu.replays))


def _make_device_context(emu: CudaEmulation):
    class device:  # torch.cuda.device(index): the current device inside, restored after
        def __init__(self, device):
            self.index = -1 if device is None or (isinstance(device, int) and device < 0) else emu.index(device)

        def __enter__(self):
            self.previous = emu.current_device()
            if self.index >= 0:
                emu.set_device(self.index)

        def __exit__(self, *exc):
            emu.set_device(self.previous)

    return device


_TorchGenerator = torch.Generator  # the class itself: torch.Generator is patched while the emulation runs


class _Generator(_TorchGenerator):
    """A CUDA generator is a CPU one: device tensors are CPU memory."""

    def __new__(cls, device="cpu"):
        device = torch.device(device)
        return _TorchGenerator.__new__(cls, device="cpu" if device.type == "cuda" else device)

    def __init__(self, device="cpu"):
        pass
