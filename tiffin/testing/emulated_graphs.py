"""The CUDA emulation's graphs, streams and events, and what a capture refuses; how a capture records and
replays is told in tiffin.testing.cuda_emulation, which installs them in `torch.cuda`."""

import contextlib
import time
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

aten = torch.ops.aten


class EmulatedCudaError(RuntimeError):
    """What real CUDA would fail with (or silently compute wrong): named, so that a test can expect it."""


@contextlib.contextmanager
def no_modes() -> Iterator[None]:
    """Plain CPU tensors (the interpreter's view, and the emulation's own bookkeeping)."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


# outputs whose shape depends on the data: a graph cannot hold them (and they sync the host)
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.bincount.default,
    aten.nonzero_static.default,
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
_DATA_DEPENDENT.discard(aten.nonzero_static.default)  # its size is given
_NOT_REPLAYED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}


class EmulatedStream:
    """Work runs when issued on the CPU: streams and events only keep their interfaces."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or EmulatedEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class EmulatedEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.time = None

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "EmulatedEvent") -> float:
        return (end.time - self.time) * 1000


@contextlib.contextmanager
def stream_context(stream):
    yield


class EmulatedNode:
    """One recorded op: an aten op, or a Triton launch (`func` then runs it on `args`, and `out` is None)."""

    __slots__ = ("func", "args", "kwargs", "out")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out

    def replay(self) -> None:
        resolve = lambda tree: tree_map_only(OutsideTensor, OutsideTensor.get, tree)
        fresh = self.func(*resolve(self.args), **resolve(self.kwargs))
        for leaf in tree_flatten(fresh)[0]:  # a collective's Work: the graph's stream waits on it
            if isinstance(leaf, torch.ScriptObject):
                torch._C._distributed_c10d.Work.unbox(leaf).wait()
        for captured, new in zip(tree_flatten(resolve(self.out))[0], tree_flatten(fresh)[0]):
            if isinstance(captured, torch.Tensor) and captured is not new and captured.data_ptr() != new.data_ptr():
                captured.copy_(new)


class OutsideTensor:
    """A tensor a capture read or wrote but did not allocate: the graph keeps its address, not its memory. Replay
    rebuilds it from its storage while that lives and raises once it is freed (a GPU would read or write memory
    reused since, as a graph does with a tensor a later step frees)."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset")

    def __init__(self, t: torch.Tensor):
        self.storage = weakref.ref(t.untyped_storage())
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.shape, t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        storage = self.storage()
        if storage is None:
            raise EmulatedCudaError(
                f"graph replay uses a {self.dtype} {tuple(self.size)} tensor allocated outside its capture and freed "
                f"since: on a GPU, memory reused by others"
            )
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


class EmulatedGraph:
    """`torch.cuda.CUDAGraph`: the ops and launches of its capture, replayed on the same tensors."""

    def __init__(self, emu):
        self.emu, self.nodes, self.captured = emu, [], False
        self.inside: set = set()  # storages allocated by the capture: its pool, which the graph keeps

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        if self.emu.capturing is not None:
            raise EmulatedCudaError("a capture is already under way in this thread")
        self.emu._local.capture = self
        self._mode = CaptureMode(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        self._mode.__exit__(None, None, None)
        del self._mode  # it refers to this graph: no cycle keeps the captured tensors alive past the graph
        self.emu._local.capture = None
        self.captured = True
        with no_modes():
            weaken = lambda tree: tree_map_only(
                torch.Tensor, lambda t: t if t.untyped_storage() in self.inside else OutsideTensor(t), tree
            )
            for node in self.nodes:
                node.args, node.kwargs, node.out = weaken(node.args), weaken(node.kwargs), weaken(node.out)

    def replay(self) -> None:
        if not self.captured:
            raise EmulatedCudaError("replay of a graph never captured")
        self.emu.replays += 1
        with no_modes(), torch.inference_mode():  # captured tensors may be inference tensors
            for node in self.nodes:
                node.replay()

    def kernels(self) -> list[str]:
        """What a GPU would launch on replay, in order: each recorded aten op (`aten.mm.default`) and Triton kernel
        (its function's name)."""
        return [str(n.func) if isinstance(n.func, torch._ops.OpOverload) else n.func.__name__ for n in self.nodes]

    def pool(self) -> object:
        return self

    def reset(self) -> None:
        self.nodes, self.captured = [], False


def make_graph_context(emu):
    @contextlib.contextmanager
    def graph(cuda_graph: EmulatedGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        cuda_graph.capture_begin(pool)
        try:
            yield cuda_graph
        finally:
            cuda_graph.capture_end()

    return graph


class CaptureMode(TorchDispatchMode):
    """Records the aten ops of a capture; refuses what a graph cannot hold."""

    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT or (
            func is aten.index.Tensor and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        ):
            raise EmulatedCudaError(f"{func} inside a CUDA graph capture: its result depends on device data")
        out = func(*args, **kwargs)
        inputs = _storages((args, kwargs))
        self.graph.inside.update(_storages(out) - inputs)
        # a collective writes its tensors in place, though its schema does not say so
        if func not in _NOT_REPLAYED and (func.namespace == "c10d" or not _only_views(func, inputs, out)):
            self.graph.nodes.append(EmulatedNode(func, args, kwargs, out))
        return out


def _storages(tree) -> set:
    return {t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


def _only_views(func, inputs: set, out) -> bool:
    """Whether the op only made views of its inputs' storages (view, slice, t; `to` or `reshape` when they copied
    nothing, as composite ops reach here unexpanded in inference mode), writing nothing."""
    if any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
        return False
    outs = _storages(out)
    return bool(outs) and outs <= inputs
