"""How a step's values cross to the other ranks: a fixed-size int64 header (the layout) and one int64 payload
holding every list and tensor, so that a step costs two broadcasts whatever it holds.

A value is an int, None, a list of ints, or an int32/int64 tensor of one or two dimensions. A value keeps its
side at every rank: lists and host tensors arrive on the host, device tensors on the device. The payload holds
the host-side values first, so that rank 0 sends them with the header in one copy from one pinned buffer (a copy
each would be a launch each, and from pageable memory would stall the host), and a receiving rank reads back
only them, in one copy, leaving the device tensors on the device."""

import numpy as np
import torch

HEADER_FIELDS = 24  # value slots in the header: (kind, dim0, dim1) each
INT_KIND, LIST_KIND, NONE_KIND = 1, 2, 3
TENSOR_KINDS = {torch.int64: 4, torch.int32: 5}  # on the device
HOST_TENSOR_KINDS = {torch.int64: 6, torch.int32: 7}  # on the host
HOST_KINDS = {LIST_KIND, *HOST_TENSOR_KINDS.values()}
DTYPES = {kind: dtype for kinds in (TENSOR_KINDS, HOST_TENSOR_KINDS) for dtype, kind in kinds.items()}


def pack(values: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The header, (kind, dim0, dim1) per value (dim1 -1 for a 1-D tensor), and the payload: the host-side values,
    then the device tensors, each in the order given. On CUDA one host -> device copy; on CPU none."""
    layout, host, on_device = [], [], []
    for v in values:
        if v is None:
            layout.append((NONE_KIND, 0, 0))
        elif isinstance(v, int):
            layout.append((INT_KIND, v, 0))
        elif isinstance(v, list):
            layout.append((LIST_KIND, len(v), 0))
            host.append(v)
        elif v.device.type == "cpu":
            layout.append((HOST_TENSOR_KINDS[v.dtype], *_dims(v)))
            host.append(v.reshape(-1).numpy())
        else:
            layout.append((TENSOR_KINDS[v.dtype], *_dims(v)))
            on_device.append(v.reshape(-1))
    if len(layout) > HEADER_FIELDS:
        raise ValueError(f"a step has {len(layout)} fields, the header holds {HEADER_FIELDS}")
    layout += [(0, 0, 0)] * (HEADER_FIELDS - len(layout))
    host_size = sum(map(len, host))
    host.append(np.zeros(_even(host_size) - host_size, np.int64))
    sent = _send([np.array(layout).reshape(-1), *host], device)
    header, host_part = sent[: HEADER_FIELDS * 3], sent[HEADER_FIELDS * 3 :]
    device_parts = [torch.nn.functional.pad(v, (0, _even(len(v)) - len(v))) for v in on_device]
    return header, torch.cat([host_part, *device_parts]) if on_device else host_part  # cat promotes int32


def payload_size(layout: list) -> int:
    """Payload elements of a header read back as `(kind, dim0, dim1)` rows."""
    host = sum(_numel(*v) for v in layout if v[0] in HOST_KINDS)
    return _even(host) + sum(_even(_numel(*v)) for v in layout if v[0] not in HOST_KINDS)


def unpack(layout: list, payload: torch.Tensor) -> list:
    """The values `pack` was given, in order (empty header slots left out): device tensors as views of `payload`,
    the host-side values from one copy of its first part."""
    layout = [row for row in layout if row[0]]
    host_size = sum(_numel(*row) for row in layout if row[0] in HOST_KINDS)
    host = payload[:host_size].cpu() if host_size else torch.empty(0, dtype=torch.int64)
    values, offsets = [], {True: 0, False: _even(host_size)}  # next element of the host part, of the device part
    for kind, d0, d1 in layout:
        on_host, n = kind in HOST_KINDS, _numel(kind, d0, d1)
        part, start = (host, offsets[True]) if on_host else (payload, offsets[False])
        offsets[on_host] += n if on_host else _even(n)
        if kind == INT_KIND:
            values.append(d0)
        elif kind == NONE_KIND:
            values.append(None)
        elif kind == LIST_KIND:
            values.append(part[start : start + n].tolist())
        else:
            values.append(part[start : start + n].view((d0, d1) if d1 >= 0 else (d0,)).to(DTYPES[kind]))
    return values


def _send(parts: list, device: torch.device) -> torch.Tensor:
    """`parts` (arrays or lists of ints) end to end as one int64 tensor on `device`: on CUDA one non-blocking copy
    from a pinned buffer."""
    sizes = [len(p) for p in parts]
    buffer = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    view, offset = buffer.numpy(), 0
    for part, size in zip(parts, sizes):
        view[offset : offset + size] = part
        offset += size
    return buffer if device.type == "cpu" else buffer.to(device, non_blocking=True)


def _even(n: int) -> int:
    """Elements a part takes in the payload: whole pairs, so that each device tensor starts 16-byte aligned, as
    Triton specializes kernels by their pointers' divisibility by 16 (`Upload` keeps its parts so too)."""
    return n + n % 2


def _dims(t: torch.Tensor) -> tuple[int, int]:
    return t.shape[0], t.shape[1] if t.dim() == 2 else -1


def _numel(kind: int, d0: int, d1: int) -> int:
    if kind == LIST_KIND:
        return d0
    return d0 * max(d1, 1) if kind in DTYPES else 0
