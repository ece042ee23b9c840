"""How a step's values cross to the other ranks: a fixed-size int64 header (the layout) and one int64 payload
holding every list and tensor, so that a step costs two broadcasts whatever it holds.

A value is an int, None, a list of ints, or an int32/int64 tensor of one or two dimensions."""

import torch

HEADER_FIELDS = 24  # value slots in the header: (kind, dim0, dim1) each
INT_KIND, LIST_KIND, NONE_KIND = 1, 2, 3
TENSOR_KINDS = {torch.int64: 4, torch.int32: 5}


def pack(values: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The header, (kind, dim0, dim1) per value (dim1 -1 for a 1-D tensor), and the payload."""
    header, parts = [], []
    for v in values:
        if v is None:
            header.append((NONE_KIND, 0, 0))
        elif isinstance(v, int):
            header.append((INT_KIND, v, 0))
        elif isinstance(v, list):
            header.append((LIST_KIND, len(v), 0))
            parts.append(torch.tensor(v, dtype=torch.int64))
        else:
            header.append((TENSOR_KINDS[v.dtype], v.shape[0], v.shape[1] if v.dim() == 2 else -1))
            parts.append(v.reshape(-1).to(torch.int64))
    if len(header) > HEADER_FIELDS:
        raise ValueError(f"a step has {len(header)} fields, the header holds {HEADER_FIELDS}")
    header += [(0, 0, 0)] * (HEADER_FIELDS - len(header))
    payload = torch.cat([p.to(device) for p in parts])
    return torch.tensor(header, dtype=torch.int64, device=device), payload


def payload_size(layout: list) -> int:
    """Payload elements of a header read back as `(kind, dim0, dim1)` rows."""
    return sum(_numel(*v) for v in layout)


def unpack(layout: list, payload: torch.Tensor) -> list:
    """The values `pack` was given, in order (empty header slots left out)."""
    dtypes = {kind: dtype for dtype, kind in TENSOR_KINDS.items()}
    host = payload.cpu()  # the lists are host-side values: one copy for all of them
    values, offset = [], 0
    for kind, d0, d1 in layout:
        if not kind:
            break
        n = _numel(kind, d0, d1)
        if kind == INT_KIND:
            values.append(d0)
        elif kind == LIST_KIND:
            values.append(host[offset : offset + n].tolist())
        elif kind == NONE_KIND:
            values.append(None)
        else:
            values.append(payload[offset : offset + n].view((d0, d1) if d1 >= 0 else (d0,)).to(dtypes[kind]))
        offset += n
    return values


def _numel(kind: int, d0: int, d1: int) -> int:
    if kind == LIST_KIND:
        return d0
    return d0 * max(d1, 1) if kind in TENSOR_KINDS.values() else 0
