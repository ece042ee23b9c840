"""The tensor-parallel wire format (#25 defect 7): every kind of value round-trips on its own side (lists and host
tensors on the host, device tensors on the device); on CUDA (emulated) rank 0 sends a step in one pinned upload
and a receiving rank reads back the header and the host-side values only. On both sides a step's device tensors
start 16-byte aligned."""

import contextlib

import numpy as np
import pytest
import torch

from tiffin.engine.distributed import wire
from tiffin.engine.worker.batch import Upload
from tiffin.testing.cuda_emulation import CudaEmulation


@pytest.fixture
def emulation():
    with CudaEmulation() as emulation:
        yield emulation


def step_values(device: str) -> list:
    """A step's kinds as `tp_worker.run` sends them: flags and ints, None, lists (KV copies, the *_cpu attention
    fields, one empty), the LoRA slots as a host tensor, the batch's tensors on the device."""
    d = torch.device(device)
    return [
        True,
        7,
        None,
        [3, 1, 4, 1],
        [],
        [0, 5, 9],
        torch.tensor([2, -1, 0], dtype=torch.int32),
        torch.arange(6, dtype=torch.int64).view(2, 3),
        torch.arange(10, 19, device=d),
        torch.arange(8, dtype=torch.int32, device=d).view(2, 4) - 3,
        torch.tensor([1 << 40, -(1 << 40)], device=d),
        torch.tensor([5], dtype=torch.int32, device=d),
    ]


def cross(header: torch.Tensor, payload: torch.Tensor) -> list:
    """What a receiving rank does with the two broadcasts (`WorkerGroup.receive`)."""
    layout = header.view(-1, 3).tolist()
    assert wire.payload_size(layout) == payload.numel()
    return wire.unpack(layout, payload)


def assert_same(got: list, sent: list) -> None:
    assert len(got) == len(sent)
    for g, s in zip(got, sent):
        if isinstance(s, torch.Tensor):
            assert (g.dtype, g.shape, g.device) == (s.dtype, s.shape, s.device) and torch.equal(g.cpu(), s.cpu())
        else:
            assert g == s and isinstance(g, list) == isinstance(s, list) and (g is None) == (s is None)  # bools: ints


def test_every_kind_round_trips_on_cpu():
    values = step_values("cpu")
    assert_same(cross(*wire.pack(values, torch.device("cpu"))), values)


def test_every_kind_round_trips_on_its_side_on_cuda(emulation):
    values = step_values("cuda")
    header, payload = wire.pack(values, torch.device("cuda"))
    assert header.is_cuda and payload.is_cuda
    assert_same(cross(header, payload), values)


def test_rank_0_sends_a_step_in_one_pinned_upload(emulation):
    """Header, lists and host tensors in one pinned buffer, one copy. Before: the header and each list and host
    tensor a pageable copy of its own (6 here), every one a launch and a stall of the host."""
    values = step_values("cuda")
    emulation.reset_counts()
    wire.pack(values, torch.device("cuda"))
    assert len(emulation.uploads) == 1 and emulation.uploads[0].endswith("pinned"), emulation.uploads
    assert emulation.reads == []


def test_a_receiving_rank_reads_back_only_the_host_side_values(emulation):
    """The header, then the lists and host tensors in one copy (7 + 3 + 6 elements); the device tensors stay on
    the device. Before: the whole payload came back to the host (the device tensors too)."""
    header, payload = wire.pack(step_values("cuda"), torch.device("cuda"))
    emulation.reset_counts()
    cross(header, payload)
    assert emulation.reads == [f"tolist ({wire.HEADER_FIELDS}, 3)", "cpu (16,)"]
    assert emulation.uploads == []


def test_a_step_without_host_values_reads_back_the_header_only(emulation):
    values = [False, None, torch.arange(4, device="cuda"), []]
    header, payload = wire.pack(values, torch.device("cuda"))
    emulation.reset_counts()
    got = cross(header, payload)
    assert emulation.reads == [f"tolist ({wire.HEADER_FIELDS}, 3)"]
    assert_same(got, values)


def test_a_step_with_too_many_fields_is_refused():
    with pytest.raises(ValueError, match="25 fields, the header holds 24"):
        wire.pack([0] * 25, torch.device("cpu"))


def test_device_tensors_arrive_16_byte_aligned(emulation):
    """Triton specializes a kernel by its pointers' divisibility by 16: a receiving rank's step tensors at any
    8-byte offset into the payload would launch variants warm-up never did. Here an odd host part and an odd
    device tensor came before each (offsets 3 and 12 elements before whole pairs)."""
    d = torch.device("cuda")
    values = [[1, 2, 3], torch.arange(9, device=d), torch.arange(4, device=d), torch.arange(5, device=d).int()]
    values.append(torch.arange(2, device=d))
    header, payload = wire.pack(values, d)
    got = cross(header, payload)
    assert_same(got, values)
    assert [(t.data_ptr() - payload.data_ptr()) % 16 for t in got[1:] if t.dtype == torch.int64] == [0, 0, 0]


def test_a_steps_uploaded_arrays_start_16_byte_aligned(emulation):
    """The same on rank 0's side: each array of a step's one pinned upload (`Upload`) starts 16-byte aligned."""
    upload = Upload(torch.device("cuda"))
    parts = [upload.add(np.arange(n, dtype=dtype)) for n, dtype in ((3, np.int32), (5, np.int64), (1, np.int32))]
    upload.add(np.zeros((2, 3), np.int32))
    upload.send()
    got = [upload.get(p) for p in parts]
    assert [t.tolist() for t in got] == [[0, 1, 2], [0, 1, 2, 3, 4], [0]]
    assert [(t.data_ptr() - got[0].data_ptr()) % 16 for t in got] == [0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_image_embeddings_cross_bit_for_bit_as_int32(device, dtype):
    """A vision-language model's image embeddings cross as their bits viewed as int32 (`tp_worker.run`), widened
    to int64 in the payload and back: every bit pattern (negative zero, infinities, NaN payloads) arrives as sent."""
    rows = torch.randn(5, 8).to(dtype)
    rows[0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    rows.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[1, 0] = -1  # a NaN of all ones
    with CudaEmulation() if device == "cuda" else contextlib.nullcontext():
        sent = rows.to(device)
        got = cross(*wire.pack([sent.view(torch.int32)], torch.device(device)))[0].view(dtype)
        assert got.shape == rows.shape and torch.equal(got.cpu().view(torch.uint8), rows.view(torch.uint8))
