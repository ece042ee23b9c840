"""A GGUF file's header, checked and read byte by byte: the `gguf` package's constants, none of its reader.

The `gguf` package's reader trusts what the header declares: it loops once per declared metadata entry, array
element and tensor, building numpy views as it goes, so an absurd count or length makes it run (and allocate)
until memory runs out; and it slices the file once per array element (SmolLM2's vocabulary and merges: ~147k
slices, ~1 s). `check_header` walks the layout (GGUF v2/v3, either byte order: magic, version, tensor and metadata
counts, the metadata entries, the tensor infos, the aligned data) reading the fixed-size fields with `struct`,
and refuses with a ValueError naming the field at the first declaration the file cannot hold. What it returns is
the file's metadata (scalars, strings as bytes, arrays by type and length: their items are never read) and its
tensors' places.

Invariant kept: a file that passes declares nothing beyond its own bytes. Every count, string and array length
fits in what is left of the file, every tensor has at most GGML_MAX_DIMS dimensions, a known type and whole
blocks per row, and its data lies inside the file at an aligned offset, so reading it takes work and memory at
most proportional to the file's size.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType
from gguf import GGMLQuantizationType as QType

VERSIONS = (2, 3)  # those the `gguf` package writes and llama.cpp reads
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp reads no tensor of more
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# the fewest bytes one metadata entry (key length, value type, a 1-byte value) and one tensor info (name
# length, n_dims, type, offset) take: a count above what is left over these is refused before any loop
MIN_ENTRY_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


class Array(NamedTuple):
    """An array value, known by its items' type and count."""

    item_type: int
    length: int

    def __repr__(self) -> str:
        return f"an array of {self.length} items"


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # ggml's order, innermost first
    qtype: QType
    start: int  # the byte its data starts at in the file
    n_bytes: int


@dataclass(frozen=True)
class Header:
    byte_order: str  # struct's: "<", or ">" for a big-endian file
    fields: dict[str, int | float | bool | bytes | Array]  # strings as bytes: decoded where they are read
    tensors: list[TensorInfo]


def check_header(path: Path) -> Header:
    """The GGUF header at `path`; ValueError, naming the field, unless every declaration lies within the file
    (see the module's invariant). Reads the metadata and the tensor infos, never an array's items or the data."""
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path.name}: GGUF header: {size} bytes are too few for one (truncated?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Header(buf, path.name).check()


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

    def scalar(self, code: str, what: str) -> int | float | bool:  # `code`: struct's
        fmt = self.order + code
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def text(self, what: str) -> str:
        n = self.scalar("Q", f"the length of {what}")
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode()
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start} is not UTF-8") from None

    def count(self, n: int, min_bytes: int, what: str) -> None:
        left = len(self.buf) - self.pos
        if n * min_bytes > left:
            raise self.fail(f"{what} is {n}: the {left} bytes left in the file cannot hold that many (truncated?)")

    def check(self) -> Header:
        if self.buf[:4] != b"GGUF":
            raise self.fail(f"magic missing: the file starts {self.buf[:4]!r}, not b'GGUF'")
        if struct.unpack_from("<I", self.buf, 4)[0] & 0xFFFF == 0:
            self.order = ">"  # the reader's test for a file of the other byte order
        self.pos = 4
        version = self.scalar("I", "version")
        if version not in VERSIONS:
            raise self.fail(f"version {version} is not supported ({', '.join(map(str, VERSIONS))})")
        tensor_count = self.scalar("Q", "tensor_count")
        kv_count = self.scalar("Q", "kv_count")
        self.count(kv_count, MIN_ENTRY_BYTES, "kv_count")
        fields = {}
        for i in range(kv_count):
            key = self.text(f"the key of metadata entry {i}")
            if key in fields:
                raise self.fail(f"metadata key {key!r} appears twice")
            value_type = self.scalar("I", f"{key}'s value type")
            fields[key] = self.alignment(value_type) if key == "general.alignment" else self.value(value_type, key)
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        self.count(tensor_count, MIN_TENSOR_INFO_BYTES, "tensor_count")
        tensors, names = [], set()
        for i in range(tensor_count):
            tensors.append(self.tensor_info(i))
            if tensors[-1][0] in names:
                raise self.fail(f"tensor {tensors[-1][0]!r} appears twice")
            names.add(tensors[-1][0])
        data_start = -(-self.pos // alignment) * alignment
        infos = [self.tensor_data(*tensor, data_start, alignment) for tensor in tensors]
        return Header(self.order, fields, infos)

    def alignment(self, value_type: int) -> int:
        if value_type != GGUFValueType.UINT32:
            raise self.fail(f"general.alignment has value type {value_type}, not UINT32")
        alignment = self.scalar("I", "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment} is not a power of two")
        return alignment

    def value(self, value_type: int, key: str) -> int | float | bool | bytes | Array:
        if value_type in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[value_type], f"{key}'s value")
        if value_type == GGUFValueType.STRING:
            n = self.scalar("Q", f"the length of {key}'s string")
            start = self.take(n, f"{key}'s string")
            return self.buf[start : start + n]
        if value_type != GGUFValueType.ARRAY:
            raise self.fail(f"{key}: unknown value type {value_type}")
        item_type = self.scalar("I", f"{key}'s item type")
        n = self.scalar("Q", f"{key}'s array length")
        if item_type in SCALAR_FORMATS:
            self.take(n * struct.calcsize(SCALAR_FORMATS[item_type]), f"{key}'s {n} items")
        elif item_type == GGUFValueType.STRING:
            self.count(n, 8, f"{key}'s array length")
            for _ in range(n):
                self.take(self.scalar("Q", f"the length of an item of {key}"), f"an item of {key}")
        else:  # llama.cpp reads no nested arrays either
            raise self.fail(f"{key}: arrays of value type {item_type} are not supported")
        return Array(item_type, n)

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], QType, int]:
        name = self.text(f"the name of tensor {i}")
        n_dims = self.scalar("I", f"tensor {name!r}'s n_dims")
        if n_dims > MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions (n_dims); at most {MAX_DIMS}")
        fmt = f"{self.order}{n_dims}Q"
        dims = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), f"tensor {name!r}'s dimensions"))
        raw_type = self.scalar("I", f"tensor {name!r}'s type")
        try:
            qtype = QType(raw_type)
        except ValueError:
            qtype = None
        if qtype not in GGML_QUANT_SIZES:
            raise self.fail(f"tensor {name!r} has unknown type {raw_type}")
        return name, dims, qtype, self.scalar("Q", f"tensor {name!r}'s offset")

    def tensor_data(
        self, name: str, dims: tuple[int, ...], qtype: QType, offset: int, data_start: int, alignment: int
    ) -> TensorInfo:
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
        return TensorInfo(name, dims, qtype, start, n_bytes)
