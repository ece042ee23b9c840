"""Native CPU kernels (`kernels/csrc/*.cpp`), compiled on first use by the host's C++ compiler for this CPU
(`-march=native`: AVX-512 where the CPU has it) and cached under ~/.cache/tiffin/native, keyed by the source,
the compiler and the CPU's flags. The library is plain C ABI called through ctypes with tensors' data
pointers, so building it needs no torch headers (a second or two, not a torch extension's minute). Without a
compiler, or with TIFFIN_CPU_NATIVE=0, `library()` is None and the torch implementations run (logged once)."""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tiffin.cache import default_cache_dir

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}
ACT_DTYPE_CODES = {**DTYPE_CODES, torch.float16: 1}  # the quantized GEMMs read and write fp16 too
# a quantized KV cache's codes (kv_quant); a model-dtype cache has its dtype's code
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 3, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_DECODE_ARGS = [_i32, _ptr, _i64, _ptr, _i64, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64]
_DECODE_ARGS += [_i32, _i32, _i32, _i32, ctypes.c_float, _i32, ctypes.c_float, _i32]
_WRITE_KV_ARGS = [_i32, _ptr, _i64, _ptr, _i64, _i64, _i32, _i32, _ptr, _i32, _ptr, _ptr, _ptr, _ptr, _i32]
_RMS_NORM_ARGS = [_i32, _ptr, _i64, _ptr, _ptr, _i64, _i32, ctypes.c_float, _i32]
_ROTARY_ARGS = [_i32, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32]
_ARGMAX_ARGS = [_i32, _ptr, _i64, _ptr, _i64, _i64, _i32]
_BLOCK_GEMM_ARGS = [_i32, _ptr, _i64, _i64, _i64, _ptr, _i32, _ptr, _i64, _i32, _i32]
_QUANTIZE_ACTS_ARGS = [_i32, _ptr, _i64, _i64, _i64, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _i32]
_DEQUANTIZE_ROWS_ARGS = [_ptr, _i64, _ptr, _i64, _ptr]
_DECODE_LAYERS_ARGS = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i32]
_PREFILL_ARGS = [_i32, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _i32, ctypes.c_float]
_PREFILL_ARGS += [_i32, _i32, ctypes.c_float, _i32]
_PAGED_PREFILL_ARGS = [_i32, _ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr]
_PAGED_PREFILL_ARGS += [_i32, ctypes.c_float, _i32, _i32, ctypes.c_float, _i32]


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("TIFFIN_CPU_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.warning("no C++ compiler (c++, g++ or $CXX) found: CPU attention runs the slower torch path")
        return None
    try:
        path = _build(compiler)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("building the native CPU kernels failed, the torch path runs instead: %s", detail)
        return None
    lib = ctypes.CDLL(str(path))
    lib.tiffin_paged_decode.argtypes, lib.tiffin_paged_decode.restype = _DECODE_ARGS, None
    lib.tiffin_write_kv.argtypes, lib.tiffin_write_kv.restype = _WRITE_KV_ARGS, None
    lib.tiffin_rms_norm.argtypes, lib.tiffin_rms_norm.restype = _RMS_NORM_ARGS, None
    lib.tiffin_rotary.argtypes, lib.tiffin_rotary.restype = _ROTARY_ARGS, None
    lib.tiffin_argmax.argtypes, lib.tiffin_argmax.restype = _ARGMAX_ARGS, None
    lib.tiffin_block_gemm.argtypes, lib.tiffin_block_gemm.restype = _BLOCK_GEMM_ARGS, _i32
    lib.tiffin_quantize_acts.argtypes, lib.tiffin_quantize_acts.restype = _QUANTIZE_ACTS_ARGS, None
    lib.tiffin_decode_layers.argtypes, lib.tiffin_decode_layers.restype = _DECODE_LAYERS_ARGS, None
    lib.tiffin_dequantize_rows.argtypes, lib.tiffin_dequantize_rows.restype = _DEQUANTIZE_ROWS_ARGS, None
    lib.tiffin_prefill_attention.argtypes, lib.tiffin_prefill_attention.restype = _PREFILL_ARGS, None
    lib.tiffin_prefill_paged.argtypes, lib.tiffin_prefill_paged.restype = _PAGED_PREFILL_ARGS, None
    lib.tiffin_prefill_supported.argtypes, lib.tiffin_prefill_supported.restype = [_i32, _i32], _i32
    lib.tiffin_bf16_min_rows.argtypes, lib.tiffin_bf16_min_rows.restype = [], ctypes.c_int64
    lib.tiffin_w8a8_min_rows.argtypes, lib.tiffin_w8a8_min_rows.restype = [], ctypes.c_int64
    lib.tiffin_w8a8_built.argtypes, lib.tiffin_w8a8_built.restype = [], _i32
    lib.tiffin_quant_kernels.argtypes, lib.tiffin_quant_kernels.restype = [], ctypes.c_char_p
    logger.info("native CPU kernels for quantized layers: %s", lib.tiffin_quant_kernels().decode())
    return lib


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text() for source in [*SOURCES, *HEADERS]]
    key = hashlib.sha256(b"\0".join(s.encode() for s in [*texts, version, *FLAGS, _cpu_flags()]))
    path = default_cache_dir() / "native" / f"cpu_ops-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, renamed: racing builds are fine
            built = Path(tmp) / path.name
            command = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)]
            subprocess.run(command, capture_output=True, text=True, check=True)
            os.replace(built, path)
    return path


def _cpu_flags() -> str:
    """What -march=native compiles for: a cache shared by machines of different CPU kinds must not mix them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the native kernels run for these tensors (on the CPU, of one dtype they know, the library built)."""
    dtype = tensors[0].dtype
    return (
        all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and dtype in DTYPE_CODES
        and library() is not None
    )


def supports_cache(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernels read and write `k_cache` (of the query's dtype, or quantized) for `query`."""
    same = k_cache.dtype == query.dtype or k_cache.dtype in CACHE_DTYPE_CODES.keys() - DTYPE_CODES.keys()
    return same and k_cache.device.type == "cpu" and supports(query)


def write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping: torch.Tensor) -> None:
    """`kernels.write_kv`'s torch result, a quantized cache's codes and scales those of `kv_quant.quantize`, for
    `key`/`value` `[T, num_kv_heads, head_dim]` with each row's heads contiguous."""
    for x in (key, value):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError("write_kv needs each row's heads contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or slot_mapping.dtype != torch.int64:
        raise ValueError("write_kv needs contiguous caches and int64 slots")
    slots = slot_mapping.contiguous()
    scales = (data_ptr(k_scale), data_ptr(v_scale))
    library().tiffin_write_kv(
        DTYPE_CODES[key.dtype],
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        key.shape[0],
        key.shape[1],
        key.shape[2],
        slots.data_ptr(),
        CACHE_DTYPE_CODES[k_cache.dtype],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *scales,
        torch.get_num_threads(),
    )


def data_ptr(t: torch.Tensor | None) -> int | None:
    """`t`'s data pointer, NULL for None (an optional argument)."""
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`kernels.rms_norm_torch`'s result (same rounding) in one pass over `x` `[..., size]`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("rms_norm needs contiguous rows and weight")
    out = torch.empty(x.shape, dtype=x.dtype)
    args = (rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1])
    library().tiffin_rms_norm(DTYPE_CODES[x.dtype], *args, eps, torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`RotaryEmbedding`'s torch result (the same roundings) for `x` `[T, heads, head_dim]` in one pass; `cos`,
    `sin` are fp32 `[max_positions, head_dim // 2]`. Positions are not range-checked: the engine keeps every
    sequence within max_model_len, which the tables cover."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("rotary needs each row's heads contiguous")
    if positions.dtype != torch.int64 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError("rotary needs int64 positions and fp32 cos/sin tables")
    positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    args = (x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    library().tiffin_rotary(DTYPE_CODES[x.dtype], *args, x.shape[0], x.shape[1], x.shape[2], torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.max(-1).indices` (the first maximum; NaN above all) of `x` `[rows, size]`, int64."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("argmax needs 2-d rows with contiguous columns")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    args = (x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    library().tiffin_argmax(DTYPE_CODES[x.dtype], *args)
    return out


def paged_decode(
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """`out[rows[i]]` = attention of the one-token query `query[rows[i]]` `[num_heads, head_dim]` over the first
    `seq_lens[seqs[i]]` slots of block table `seqs[i]` (the last `window` of them where > 0), K/V read in place
    from the paged caches; scores soft-capped (`cap * tanh(s / cap)`) at `softcap` where > 0."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    for t in (query, out):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError("paged_decode needs each row's heads contiguous")
    tensors = (k_cache, v_cache, block_tables, seq_lens, rows, seqs)
    if not all(t.is_contiguous() for t in tensors) or not (k_scale is None or k_scale.is_contiguous()):
        raise ValueError("paged_decode needs contiguous caches, block tables, seq_lens, rows and seqs")
    if [t.dtype for t in tensors[2:]] != [torch.int32, torch.int32, torch.int64, torch.int64]:
        raise TypeError("paged_decode needs int32 block_tables and seq_lens, int64 rows and seqs")
    library().tiffin_paged_decode(
        DTYPE_CODES[query.dtype],
        query.data_ptr(),
        query.stride(0),
        out.data_ptr(),
        out.stride(0),
        CACHE_DTYPE_CODES[k_cache.dtype],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        data_ptr(k_scale),
        data_ptr(v_scale),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        rows.data_ptr(),
        seqs.data_ptr(),
        len(rows),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        window,
        softcap,
        torch.get_num_threads(),
    )


def supports_prefill(query: torch.Tensor) -> bool:
    """Whether `prefill_attention` runs for `query` `[T, num_heads, head_dim]`: fp32 or bf16, on a CPU with
    AVX512-BF16, at a head_dim it is built for."""
    return supports(query) and bool(library().tiffin_prefill_supported(DTYPE_CODES[query.dtype], query.shape[-1]))


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """SDPA of `query` `[n_q, num_heads, head_dim]` over `key`/`value` `[n_k, num_kv_heads, head_dim]` (the
    queries the last n_q positions where `causal`, each seeing its last `window` keys where > 0) -> `out` (new if
    None) `[n_q, num_heads, head_dim]`; scores soft-capped at `softcap` where > 0; bf16 in the CPU's bf16 dot
    products."""
    out = torch.empty(query.shape, dtype=query.dtype) if out is None else out
    for t in (query, key, value, out):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError("prefill_attention needs each row's heads contiguous")
    (n_q, heads, head_dim), (n_k, kv_heads, _) = query.shape, key.shape
    library().tiffin_prefill_attention(
        DTYPE_CODES[query.dtype],
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        out.data_ptr(),
        out.stride(0),
        n_q,
        n_k,
        heads,
        kv_heads,
        head_dim,
        scale,
        causal,
        window,
        softcap,
        torch.get_num_threads(),
    )
    return out


def paged_prefill(
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_table: torch.Tensor,
    length: int,
    scale: float,
    causal: bool = True,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """`prefill_attention` of `query` `[n_q, num_heads, head_dim]` into `out` over the first `length` slots of
    `block_table` (int32 block ids) in the paged caches, read in place: a quantized cache's codes dequantized and
    its keys rotated back as they are read, so the queries are not rotated."""
    _, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for t in (query, out):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError("paged_prefill needs each row's heads contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and block_table.is_contiguous()):
        raise ValueError("paged_prefill needs contiguous caches and block table")
    if block_table.dtype != torch.int32 or len(block_table) * block_size < length:
        raise ValueError("paged_prefill needs an int32 block table covering `length` slots")
    library().tiffin_prefill_paged(
        DTYPE_CODES[query.dtype],
        query.data_ptr(),
        query.stride(0),
        out.data_ptr(),
        out.stride(0),
        len(query),
        length,
        heads,
        kv_heads,
        head_dim,
        CACHE_DTYPE_CODES[k_cache.dtype],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        data_ptr(k_scale),
        data_ptr(v_scale),
        block_table.data_ptr(),
        block_size,
        scale,
        causal,
        window,
        softcap,
        torch.get_num_threads(),
    )


def bf16_min_rows() -> int | None:
    """The fewest activation rows `block_gemm` runs in bf16 dot products at two levels; None where it never does."""
    rows = library().tiffin_bf16_min_rows()
    return None if rows < 0 else rows


def w8a8_min_rows() -> int | None:
    """The fewest activation rows `block_gemm` runs per-token (W8A8) weights on int8 activations per token (the
    W8A8 GEMM, kernels/csrc/cpu_quant_w8a8.cpp); None where it is not built (no AVX-512 VNNI)."""
    rows = library().tiffin_w8a8_min_rows()
    return None if rows < 0 else rows


def w8a8_built() -> int:
    """The W8A8 GEMM's dot products: 2 AMX-INT8 tiles (from 6 rows, K a multiple of 64), 1 AVX-512 VNNI, 0 none."""
    return library().tiffin_w8a8_built()


class NativeWeights(ctypes.Structure):
    """A layer's weights in the block layout of `tiffin.kernels.block_gemm` (kernels/csrc/cpu_blocks.h's Weights):
    pointers into tensors the caller keeps alive."""

    _fields_ = [
        ("codes", _ptr),
        ("scales", _ptr),
        ("offsets", _ptr),
        ("n", _i64),
        ("bits", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("per_token", ctypes.c_int32),
    ]


def block_gemm(x: torch.Tensor, w: NativeWeights, y: torch.Tensor, levels: int) -> None:
    """`y [M, n]` (x's dtype, unit column stride) = `x [M, K]` (fp32, bf16 or fp16, contiguous; K a multiple of 32)
    against the weight rows `w`, on `levels` of int8 activation codes (see `kernels/csrc/cpu_quant.cpp`'s
    `tiffin_block_gemm` for the bf16 dot products)."""
    if x.dim() != 2 or not x.is_contiguous() or y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError("block_gemm needs contiguous 2-d x and rows of y of its dtype")
    code = ACT_DTYPE_CODES[x.dtype]
    args = (ctypes.byref(w), code, y.data_ptr(), y.stride(0), levels, torch.get_num_threads())
    if library().tiffin_block_gemm(code, x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], *args):
        raise ValueError(f"no block kernels for {w.bits}-bit codes of kind {w.kind}")


def dequantize_rows(w: NativeWeights, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Weight rows `rows` in the block layout of `tiffin.kernels.block_gemm` -> `[len(rows), k]` float32."""
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(len(rows), k, dtype=torch.float32)
    library().tiffin_dequantize_rows(ctypes.byref(w), k, rows.data_ptr(), len(rows), out.data_ptr())
    return out


def quantize_acts(x: torch.Tensor, levels: int = 1) -> tuple[torch.Tensor, ...]:
    """The int8 GEMM's quantized activations, for tests: codes `[M, K]` (and the second level's, zeros with one),
    the step of the activation integer a block `[M, K / 32]` and `step * sum(integer)` a block `[M, K / 32]` and a
    half-block `[M, K / 16]`."""
    m, k = x.shape
    q, q2 = torch.empty(m, k, dtype=torch.int8), torch.zeros(m, k, dtype=torch.int8)
    dx, sx = torch.empty(m, k // 32, dtype=torch.float32), torch.empty(m, k // 32, dtype=torch.float32)
    sxh = torch.empty(m, k // 16, dtype=torch.float32)
    args = (q.data_ptr(), q2.data_ptr(), dx.data_ptr(), sx.data_ptr(), sxh.data_ptr(), 1)
    library().tiffin_quantize_acts(ACT_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), m, k, levels, *args)
    return q, q2, dx, sx, sxh
