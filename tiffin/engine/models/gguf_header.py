"""A GGUF file's header checked byte by byte before the `gguf` package's reader parses it.

The reader trusts what the header declares: it loops once per declared metadata entry, array element and
tensor, building numpy views as it goes, so an absurd count or length makes it run (and allocate) until memory
runs out, and a truncated file fails deep inside numpy. `check_header` walks the same layout (GGUF v2/v3, either
byte order: magic, version, tensor and metadata counts, the metadata entries, the tensor infos, the aligned
data) reading only the fixed-size fields, and refuses with a ValueError naming the field at the first
declaration the file cannot hold.

Invariant kept: a file that passes declares nothing beyond its own bytes. Every count, string and array length
fits in what is left of the file, every tensor has at most GGML_MAX_DIMS dimensions, a known type and whole
blocks per row, and its data lies inside the file at an aligned offset, so the reader's work and memory are at
most proportional to the file's size.
"""

import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType
from gguf import GGMLQuantizationType as QType

VERSIONS = (2, 3)  # those the `gguf` package's reader parses
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp reads no tensor of more
SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
# the fewest bytes one metadata entry (key length, value type, a 1-byte value) and one tensor info (name
# length, n_dims, type, offset) take: a count above what is left over these is refused before any loop
MIN_ENTRY_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


def check_header(path: Path) -> None:
    """ValueError, naming the field, unless every declaration of the GGUF header at `path` lies within the file
    (see the module's invariant). Reads the fixed-size fields and the keys and tensor names, never the data."""
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path.name}: GGUF header: {size} bytes are too few for one (truncated?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _Header(buf, path.name).check()


class _Header:
    """A cursor over the mapped file: each read advances `pos` past the field, or refuses naming it."""

    def __init__(self, buf: mmap.mmap, name: str):
        self.buf, self.name, self.pos, self.order = buf, name, 0, "<"

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.name}: GGUF header: {message}")

    def take(self, n: int, what: str) -> int:
        """Skip `n` bytes of `what`; the offset they start at."""
        start, left = self.pos, len(self.buf) - self.pos
        if n > left:
            raise self.fail(f"{what} at byte {start} declares {n} bytes; the file has {left} left (truncated?)")
        self.pos += n
        return start

    def uint(self, code: str, what: str) -> int:
        fmt = self.order + code
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def text(self, what: str) -> str:
        n = self.uint("Q", f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode()
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start} is not UTF-8") from None

    def count(self, n: int, min_bytes: int, what: str) -> None:
        left = len(self.buf) - self.pos
        if n * min_bytes > left:
            raise self.fail(f"{what} is {n}: the {left} bytes left in the file cannot hold that many (truncated?)")

    def check(self) -> None:
        if self.buf[:4] != b"GGUF":
            raise self.fail(f"magic missing: the file starts {self.buf[:4]!r}, not b'GGUF'")
        if struct.unpack_from("<I", self.buf, 4)[0] & 0xFFFF == 0:
            self.order = ">"  # the reader's test for a file of the other byte order
        self.pos = 4
        version = self.uint("I", "version")
        if version not in VERSIONS:
            raise self.fail(f"version {version} is not supported ({', '.join(map(str, VERSIONS))})")
        tensor_count = self.uint("Q", "tensor_count")
        kv_count = self.uint("Q", "kv_count")
        self.count(kv_count, MIN_ENTRY_BYTES, "kv_count")
        alignment = GGUF_DEFAULT_ALIGNMENT
        keys = set()
        for i in range(kv_count):
            key = self.text(f"the key of metadata entry {i}")
            if key in keys:
                raise self.fail(f"metadata key {key!r} appears twice")
            keys.add(key)
            value_type = self.uint("I", f"{key}'s value type")
            if key == "general.alignment":
                alignment = self.alignment(value_type)
            else:
                self.value(value_type, key)
        self.count(tensor_count, MIN_TENSOR_INFO_BYTES, "tensor_count")
        tensors, names = [], set()
        for i in range(tensor_count):
            tensors.append(self.tensor_info(i))
            if tensors[-1][0] in names:
                raise self.fail(f"tensor {tensors[-1][0]!r} appears twice")
            names.add(tensors[-1][0])
        data_start = -(-self.pos // alignment) * alignment
        for name, dims, qtype, offset in tensors:
            self.tensor_data(name, dims, qtype, offset, data_start, alignment)

    def alignment(self, value_type: int) -> int:
        if value_type != GGUFValueType.UINT32:
            raise self.fail(f"general.alignment has value type {value_type}, not UINT32")
        alignment = self.uint("I", "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment} is not a power of two")
        return alignment

    def value(self, value_type: int, key: str) -> None:
        if value_type in SCALAR_SIZES:
            self.take(SCALAR_SIZES[value_type], f"{key}'s value")
        elif value_type == GGUFValueType.STRING:
            self.take(self.uint("Q", f"the length of {key}'s string"), f"{key}'s string")
        elif value_type == GGUFValueType.ARRAY:
            item_type = self.uint("I", f"{key}'s item type")
            n = self.uint("Q", f"{key}'s array length")
            if item_type in SCALAR_SIZES:
                self.take(n * SCALAR_SIZES[item_type], f"{key}'s {n} items")
            elif item_type == GGUFValueType.STRING:
                self.count(n, 8, f"{key}'s array length")
                for _ in range(n):
                    self.take(self.uint("Q", f"the length of an item of {key}"), f"an item of {key}")
            else:  # llama.cpp reads no nested arrays either
                raise self.fail(f"{key}: arrays of value type {item_type} are not supported")
        else:
            raise self.fail(f"{key}: unknown value type {value_type}")

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], QType, int]:
        name = self.text(f"the name of tensor {i}")
        n_dims = self.uint("I", f"tensor {name!r}'s n_dims")
        if n_dims > MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions (n_dims); at most {MAX_DIMS}")
        fmt = f"{self.order}{n_dims}Q"
        dims = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), f"tensor {name!r}'s dimensions"))
        raw_type = self.uint("I", f"tensor {name!r}'s type")
        try:
            qtype = QType(raw_type)
        except ValueError:
            qtype = None
        if qtype not in GGML_QUANT_SIZES:
            raise self.fail(f"tensor {name!r} has unknown type {raw_type}")
        return name, dims, qtype, self.uint("Q", f"tensor {name!r}'s offset")

    def tensor_data(
        self, name: str, dims: tuple[int, ...], qtype: QType, offset: int, data_start: int, alignment: int
    ) -> None:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise self.fail(f"tensor {name!r}: rows of {dims[0]} values are not whole {qtype.name} blocks of {block}")
        if offset % alignment:
            raise self.fail(f"tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}")
        elements = 1
        for d in dims:
            elements *= d
        n_bytes, start = elements // block * block_bytes, data_start + offset
        if start + n_bytes > len(self.buf):
            raise self.fail(
                f"tensor {name!r}: {n_bytes} bytes of data (shape {list(dims)}, {qtype.name}) at byte {start} run "
                f"past the end of the file ({len(self.buf)} bytes; truncated?)"
            )
