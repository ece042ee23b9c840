"""The CUDA emulation (`tiffin.testing.cuda_emulation`) itself: devices, copies and their counts, graphs replaying
what they captured, and each fault it must catch raising."""

import threading

import pytest
import torch
import triton
import triton.language as tl

from tiffin.kernels.triton_common import Launch
from tiffin.testing.cuda_emulation import EmulatedCudaError


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def add_one(x: torch.Tensor) -> None:
    Launch(_add_one, (1,), (x, x.numel()), dict(BLOCK=16))(x.device)


def test_devices_follow_tensors_and_threads(cuda_emulation):
    x = torch.zeros(4, device="cuda:1")
    assert x.device == torch.device("cuda", 1) and x.is_cuda and x.get_device() == 1
    assert (x + 1).device == x.device and x[1:].device == x.device and x.float().device == x.device
    with torch.device("cuda:0"):
        assert torch.ones(2).device == torch.device("cuda", 0)
    assert torch.ones(2).device.type == "cpu"
    with pytest.raises(EmulatedCudaError, match="devices"):
        torch.ones(4, device="cuda:0") + x
    with pytest.raises(EmulatedCudaError, match=r"host tensors of shapes \[\(4,\)\]"):
        torch.ones(4) + x
    assert (x + torch.tensor(2.0)).device == x.device  # a host scalar passes as a value
    assert x[torch.tensor([0, 2])].device == x.device  # host indices are moved by torch
    torch.cuda.set_device(1)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_device()))
    thread.start()
    thread.join()
    assert seen == [0] and torch.cuda.current_device() == 1  # the current device is per thread
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 1


def test_copies_are_counted_and_memory_tracked(cuda_emulation):
    emu = cuda_emulation
    before = emu.allocated(0)
    x = torch.arange(8.0).to("cuda")
    assert emu.uploads == ["to cuda:0 (8,), pageable"] and emu.allocated(0) == before + 32
    assert x.tolist() == list(range(8)) and x.cpu().device.type == "cpu" and len(emu.reads) == 2
    host = x.cpu()
    host += 1
    assert x[0].item() == 0  # .cpu() copied
    pinned = torch.ones(8).pin_memory()
    assert pinned.is_pinned() and not host.is_pinned()
    x.copy_(pinned, non_blocking=True)
    assert len(emu.uploads) == 2 and len(emu.reads) == 4  # tolist, cpu, cpu, item
    emu.reset_counts()
    y = x * 2  # device work: no traffic
    assert not emu.uploads and not emu.reads and y.device == x.device
    del x, y
    assert emu.allocated(0) == before
    free, total = torch.cuda.mem_get_info()
    assert free == total - before


def test_launch_on_another_device_than_its_tensors_raises(cuda_emulation):
    x = torch.zeros(4, device="cuda:1")
    with pytest.raises(EmulatedCudaError, match="launched on cuda:0 .* tensor in cuda:1"):
        add_one(x)
    with torch.cuda.device(1):
        add_one(x)
    assert x.tolist() == [1] * 4 and cuda_emulation.launches == ["_add_one"]
    with pytest.raises(EmulatedCudaError, match="host memory"):
        add_one(torch.zeros(4))


def test_graph_replays_ops_and_launches_on_the_captured_tensors(cuda_emulation):
    static_in = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hidden = static_in * 2
        add_one(hidden)
        out = hidden.sin()
    for value in (1.0, 3.0):
        static_in.copy_(torch.full((4,), value).pin_memory())
        graph.replay()
        assert torch.equal(out.cpu(), (torch.full((4,), value) * 2 + 1).sin())


@pytest.mark.parametrize(
    "fault, match",
    [
        (lambda x: x.sum().item(), "host read .item"),
        (lambda x: x.tolist(), "host read .tolist"),
        (lambda x: x.cpu(), "host read .cpu"),
        (lambda x: bool(x[0] > 0), "host read .__bool__"),
        (lambda x: torch.tensor([1, 2], device="cuda"), "pageable upload"),
        (lambda x: x.copy_(torch.ones(4)), "pageable upload"),
        (lambda x: torch.ones(4).to("cuda"), "pageable upload"),
        (lambda x: x.nonzero(), "nonzero"),
        (lambda x: x[x > 0], "index"),
        (lambda x: torch.masked_select(x, x > 0), "masked_select"),
        (lambda x: x.unique(), "unique"),
    ],
)
def test_capture_refuses_what_a_graph_cannot_hold(cuda_emulation, fault, match):
    x = torch.ones(4, device="cuda")
    with pytest.raises(EmulatedCudaError, match=match), torch.cuda.graph(torch.cuda.CUDAGraph()):
        fault(x)


def test_capture_allows_pinned_uploads(cuda_emulation):
    x, pinned = torch.zeros(4, device="cuda"), torch.ones(4).pin_memory()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        x.copy_(pinned, non_blocking=True)
    assert x.tolist() == [1] * 4


def test_replay_of_memory_freed_since_the_capture_raises(cuda_emulation):
    """A graph keeps addresses: what it read from outside its pool must outlive it (a cache that a later step
    replaces is freed, and a GPU replay reads whatever reuses that memory)."""
    persistent = torch.ones(4, device="cuda")
    cache = {"table": torch.arange(4.0, device="cuda")}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = persistent * cache["table"]
    graph.replay()
    assert out.tolist() == [0, 1, 2, 3]
    cache["table"] = torch.zeros(4, device="cuda")  # the captured one is freed
    with pytest.raises(EmulatedCudaError, match=r"float32 \(4,\) tensor allocated outside its capture and freed"):
        graph.replay()
