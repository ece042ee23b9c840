"""The emulation's devices at the torch API (tiffin.testing.cuda_emulation has the whole picture): `DeviceMode`, the
`TorchFunctionMode` that tags what factories and ops make with the device of their arguments, answers `.device`,
`.is_cuda` and `.get_device()` from those tags, copies between host and device memory for `.to` / `.cuda` /
`.cpu` / `copy_`, counts uploads and host reads, and raises `EmulatedCudaError` on what a GPU would refuse (two
devices in one op, a host array beside device tensors, a host read or pageable upload inside a capture)."""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

from tiffin.testing.emulated_graphs import EmulatedCudaError, no_modes

_HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__"}
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray"}
# torch moves host index tensors to the device itself in indexing (a hidden copy, but no error)
_HOST_INDEX_OK = {"__getitem__", "__setitem__", "index_put", "index_put_"}


class DeviceMode(TorchFunctionMode):
    """Tags, answers and checks devices at the torch API (see the module docstring) for `emu`, the CudaEmulation
    that installs it (not imported here: cuda_emulation imports this module)."""

    def __init__(self, emu) -> None:
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        emu = self.emu
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name == "__get__" and isinstance(owner, type(torch.Tensor.device)):
            prop, t = owner.__name__, args[0]
            if prop in ("device", "is_cuda", "is_cpu"):
                where = emu.device_of(t)
                if prop == "device":
                    return func(*args) if where is None else torch.device("cuda", where)
                return (where is not None) == (prop == "is_cuda")
            return func(*args, **kwargs)
        if name == "get_device":
            where = emu.device_of(args[0])
            return -1 if where is None else where
        if name == "is_pinned":
            return emu.is_pinned(args[0])
        if name == "pin_memory":
            copy = args[0].clone()
            emu._pinned.add(copy.untyped_storage())
            return copy
        if name in ("to", "cuda", "cpu"):
            return self._to(func, name, args, kwargs)
        if name in _HOST_READS and args and isinstance(args[0], torch.Tensor):
            where = emu.device_of(args[0])
            if where is not None:
                emu._check_capture(f"host read .{name}() of a cuda:{where} tensor")
                emu.reads.append(f"{name} {tuple(args[0].shape)}")
            return func(*args, **kwargs)
        if name == "copy_":
            return self._copy(func, args, kwargs)
        if name == "__setitem__":
            dst, value = args[0], args[2]
            if isinstance(value, torch.Tensor) and value.dim():
                to, frm = emu.device_of(dst), emu.device_of(value)
                if to is not None:
                    self._upload_from(value, f"setitem {tuple(value.shape)}")
                elif frm is not None:
                    emu._check_capture(f"host read (setitem from a cuda:{frm} tensor)")
                    emu.reads.append(f"setitem {tuple(value.shape)}")
            return func(*args, **kwargs)

        if kwargs.get("pin_memory"):  # a factory allocating pinned host memory
            out = func(*args, **{**kwargs, "pin_memory": False})
            emu._pinned.add(out.untyped_storage())
            return out
        target = kwargs.get("device")
        if target is not None:
            target = torch.device(target) if not isinstance(target, int) else torch.device("cuda", target)
            if target.type == "cuda":
                index = emu.index(target)
                kwargs = {**kwargs, "device": "cpu"}
                if name in _DATA_FACTORIES:
                    data = args[0] if args else kwargs.get("data")
                    self._upload_from(data, f"torch.{name} to cuda:{index}")
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    emu._tag(out, index)
                return out
            return func(*args, **kwargs)  # explicitly on the host (or meta)

        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        places = [emu.device_of(t) for t in tensors]
        devices = {where for where in places if where is not None}
        if len(devices) > 1:
            raise EmulatedCudaError(f"{name}: tensors on devices {sorted(devices)} in one op")
        if devices and name not in _HOST_INDEX_OK:
            # host scalars (0-dim) pass as values; a host array in a device op is an error on a GPU
            host = [tuple(t.shape) for t, where in zip(tensors, places) if where is None and t.dim()]
            if host:
                raise EmulatedCudaError(f"{name}: host tensors of shapes {host} with cuda:{min(devices)} tensors")
        out = func(*args, **kwargs)
        if devices:
            index = devices.pop()
            tree_map_only(torch.Tensor, lambda t: emu._tag(t, index), out)
        return out

    def _upload_from(self, data, what: str) -> None:
        """A host -> device copy of `data` (a host tensor, an array or a list)."""
        emu = self.emu
        if isinstance(data, torch.Tensor) and emu.device_of(data) is not None:
            return
        pinned = isinstance(data, torch.Tensor) and emu.is_pinned(data)
        if not pinned:
            emu._check_capture(f"pageable upload ({what})")
        emu.uploads.append(f"{what}, {'pinned' if pinned else 'pageable'}")

    def _to(self, func, name, args, kwargs):
        emu, src = self.emu, args[0]
        if name == "cuda":
            device = args[1] if len(args) > 1 else kwargs.get("device")
            target, dtype, rest = torch.device("cuda", emu.index(device)), None, {}
        elif name == "cpu":
            target, dtype, rest = torch.device("cpu"), None, {}
        else:
            target, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                where = emu.device_of(args[1])
                target = None if where is None else torch.device("cuda", where)
                target = target or torch.device("cpu")
            rest = {k: v for k, v in kwargs.items() if k in ("memory_format",)}
        where = emu.device_of(src)
        if target is None or (target.type == "cpu" and where is None):
            out = func(*args, **kwargs) if name == "to" else src
            if where is not None:
                emu._tag(out, where)
            return out
        if target.type == "cuda":
            index = emu.index(target)
            if where == index:
                out = src if dtype in (None, src.dtype) else src.to(dtype=dtype, **rest)
                emu._tag(out, index)
                return out
            if where is None:
                self._upload_from(src, f"to cuda:{index} {tuple(src.shape)}")
            with no_modes():
                out = src.to(dtype=dtype or src.dtype, copy=True)
            emu._tag(out, index)
            return out
        emu._check_capture(f"host read .{name}() of a cuda:{where} tensor")
        emu.reads.append(f"{name} {tuple(src.shape)}")
        with no_modes():
            return src.to(dtype=dtype or src.dtype, copy=True)

    def _copy(self, func, args, kwargs):
        emu, (dst, src) = self.emu, args[:2]
        to, frm = emu.device_of(dst), emu.device_of(src) if isinstance(src, torch.Tensor) else None
        if to is not None and frm is None and isinstance(src, torch.Tensor):
            self._upload_from(src, f"copy_ {tuple(src.shape)}")
        elif to is None and frm is not None:
            emu._check_capture(f"host read (copy_ of a cuda:{frm} tensor)")
            emu.reads.append(f"copy_ {tuple(src.shape)}")
        return func(*args, **kwargs)
