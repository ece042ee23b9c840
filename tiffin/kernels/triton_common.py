"""What every Triton kernel module shares: the launch record, tile configs, the SM count, how far to split a
reduction across programs, buffer allocation, dtypes and dot options, and the quantized KV cache's codes and
scales (`kv_quant`) as the write and attention kernels compute them.

On CPU tensors the kernels run under Triton's interpreter when TRITON_INTERPRET=1 at call time (see `Launch`),
whatever the variable was at import. The interpreter's bf16 math is wrong, so there bf16 operands are upcast
to fp32 (`UPCAST`); fp16 keeps the GPU's exact code path (fp16 operands, fp32 accumulation).
"""

import contextlib
import dataclasses
import functools
import math
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction, _patch_lang

from tiffin.kernels import kv_quant

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 16  # ways one program's reduction may be split (split-K, split-KV)


@dataclass(frozen=True)
class Tile:
    """One program's work: a `block_m x block_n` output tile, reduced `block_k` at a time. Every tile a
    dispatcher picks for an arch compiles there without register spills and within its shared memory
    (compile_check verifies sm_80, sm_86, sm_89, sm_90)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def options(self) -> dict:
        """The tile as launch keywords: its constexprs and launch options."""
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


# Set by the CUDA emulation (tiffin.testing.cuda_emulation) for its model tests: under the interpreter a program
# costs by its operations, hardly by its elements (a decode GEMM of 512 columns: 1.9 s in 32-wide tiles, 0.22 s in
# one 512 wide). The kernel tests keep the tiles a GPU launches.
EMULATED_WIDTH = 0


def emulated_width(tile: Tile, n: int) -> Tile:
    """`tile`, or under the CUDA emulation one spanning `n` output columns (at most EMULATED_WIDTH)."""
    if not EMULATED_WIDTH or tile.block_n >= n:
        return tile
    return dataclasses.replace(tile, block_n=min(EMULATED_WIDTH, triton.next_power_of_2(n)))


@dataclass
class Launch:
    """One kernel launch, as built by the dispatcher; compile_check compiles the same objects."""

    kernel: object  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict  # constexprs and launch options (num_warps, num_stages)

    def __call__(self, device: torch.device) -> None:
        if _launched is not None:
            _launched.add(self.variant())
        if device.type == "cuda":
            self.kernel[self.grid](*self.args, **self.kwargs)
        elif device.type == "cpu" and knobs.runtime.interpret:
            with _interpreting(self.kernel.fn):
                _interpreted(self.kernel.fn)[self.grid](*self.args, **self.kwargs)
        else:
            raise ValueError(
                f"kernel_backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}"
            )

    def variant(self) -> tuple:
        """What selects the compiled binary: the kernel, its constexprs and options, and each argument as Triton
        specializes it (tensors: dtype and 16-byte alignment; ints: equal to 1, divisible by 16, 32-bit)."""
        return (self.kernel.fn.__qualname__, tuple(sorted(self.kwargs.items())), tuple(map(_specialized, self.args)))


def _specialized(arg) -> object:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    return type(arg).__name__


_launched: set | None = None


@contextlib.contextmanager
def recording_launches():
    """Collects `Launch.variant()` of every launch made inside: a variant not seen before is a Triton compile."""
    global _launched
    outer, _launched = _launched, set()
    try:
        yield _launched
    finally:
        if outer is not None:
            outer |= _launched
        _launched = outer


_patched_for_launch: set = set()  # the helpers whose call has patched triton.language in this launch


class _InterpretedHelper(InterpretedFunction):
    """A @triton.jit function run by the interpreter, as a kernel or as a helper a kernel calls."""

    def __call__(self, *args, **kwargs):
        """A helper's call from a kernel: the interpreter's own patches the language its module sees (a scan of the
        whole language) at every call; once a launch is enough, as nothing restores it until the end."""
        if self.fn not in _patched_for_launch:
            _patch_lang(self.fn)
            _patched_for_launch.add(self.fn)
        return self.rewrite()(*args, **kwargs)


_interpreted = functools.cache(_InterpretedHelper)  # one per function: its rewritten code is cached on it


@functools.lru_cache(maxsize=1)
def _language(modules_imported: int) -> tuple[dict, ...]:
    """triton.language's modules' namespaces, found again only once more modules are imported: the scan of
    sys.modules took 0.8 ms a launch, 8% of an emulated CUDA-graph test."""
    return tuple(vars(m) for name, m in list(sys.modules.items()) if name.split(".")[:2] == ["triton", "language"])


@contextlib.contextmanager
def _interpreting(fn):
    """Let an interpreted kernel call @triton.jit helpers: its own module's, this module's (the KV-cache codes)
    and triton.language's (tl.max, tl.sum, tl.cdiv, ...). Those are compiled-only JITFunctions when
    TRITON_INTERPRET was unset at import; swapping them for interpreted twins is what lets the variable be set at
    call time, in any import order. Every name is restored afterwards, including what the interpreter patches for
    nested calls and never restores, so compiled kernels in the same process see a clean triton.language. (Names
    the interpreter adds to a kernel's globals stay: its cached rewritten functions look them up there.)"""
    from triton.runtime.jit import JITFunction

    namespaces = [*_language(len(sys.modules)), fn.__globals__] + [globals()] * (fn.__globals__ is not globals())
    saved = [dict(ns) for ns in namespaces]
    for ns in namespaces:
        for name, obj in list(ns.items()):
            if isinstance(obj, JITFunction):
                ns[name] = _interpreted(obj.fn)
    try:
        yield
    finally:
        _patched_for_launch.clear()
        for ns, before in zip(namespaces, saved):
            ns.update(before)


@functools.cache
def arch(device: torch.device) -> int:
    """The compute capability (86 for 8.6) a dispatcher picks tiles for; the interpreter runs sm_80's."""
    if device.type != "cuda":
        return 80
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so that tests exercise the split paths
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(programs: int, steps: int, device: torch.device) -> int:
    """Ways to split each of `programs` programs' reduction so that about two waves of programs run; each
    split gets at least one of the reduction's `steps`."""
    sms = num_sms(device)
    if programs >= 2 * sms:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sms, programs), steps))


def split_k(
    out: torch.Tensor, k: int, block_k: int, programs: int, splits: int | None = None
) -> tuple[int, torch.Tensor | None]:
    """Cut the K of a GEMM with `programs` output tiles into `splits` ranges of whole `block_k` steps (None:
    `num_splits`' choice) -> (K rows per range, the fp32 `[splits, *out.shape]` partials the ranges write, or
    None when one range writes `out` itself). The kernel sums the partials itself (`reduce_split_k`)."""
    if splits is None:
        splits = num_splits(programs, k // block_k, out.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    return k_per_split, empty((splits, *out.shape), torch.float32, out.device) if splits > 1 else None


_TILE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, at least `tiles`, on `device`, shared by every split-K launch that reduces in the
    kernel (each program of a tile counts itself in; the last resets the counter to 0). Launches on one stream run
    one after another, so sharing is safe; allocated once (grown by powers of two), before any graph capture: the
    eager pass that precedes a capture makes the same launch."""
    counters = _TILE_COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(1024, triton.next_power_of_2(tiles)), dtype=torch.int32, device=device)
        _TILE_COUNTERS[device] = counters
    return counters


@triton.jit
def reduce_split_k(acc, partial_ptrs, out_ptrs, mask, counter_ptr, split, splits, stride_split):
    """Split `split` of `splits` of one output tile: stores its fp32 `acc` as its partial (`partial_ptrs` is split
    0's tile, each next split's `stride_split` on) and counts itself in on the tile's counter (`tile_counters`). The
    last to arrive sums the tile's partials in split order (the result does not depend on who arrives last) into
    `out_ptrs` and resets the counter to 0 for the next launch, which a graph replay makes without a memset. So a
    split-K GEMM is one launch, where a separate sum and copy were two more kernels."""
    tl.store(partial_ptrs + split * stride_split, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the release below publishes it
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:  # the last split of this tile: the others' partials are visible
        total = tl.zeros_like(acc)
        for part in range(splits):
            total += tl.load(partial_ptrs + part * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr, 0)


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel fills (tests swap this for NaN-filled buffers to catch unwritten elements)."""
    return torch.empty(shape, dtype=dtype, device=device)


def dot_options(x: torch.Tensor) -> dict:
    """`tl.dot` settings for operands of x's dtype: bf16 is upcast under the interpreter (its bf16 math is wrong);
    fp32 keeps fp32 accuracy on tensor cores with 3xTF32 (plain TF32 has a 10-bit mantissa, and "ieee" runs on
    FMA units, which replicate operands across threads and spill); 16-bit dots ignore the precision."""
    return dict(
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        DOT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
    )


# ---- quantized KV caches (`kv_quant`) ----------------------------------------------------------------------
#
# The kernels reproduce `kv_quant.quantize` bit for bit and never use Triton's bf16 or fp8 types: every rounding is
# integer arithmetic on fp32 bits (or the exact fp32 round-to-nearest-even of `_RNE_MAGIC`), so the codes are the
# same on every arch from sm_80 on (`tl.float8e4nv` needs sm_89) and under the interpreter (whose bf16 is wrong).
# Caches of fp8 codes reach the kernels as uint8 views, scales as int16 views of their bf16 bits.

KV_CODES = {dtype: name for name, dtype in kv_quant.CACHE_DTYPES.items()}  # cache dtype -> the CODES constexpr
# An fp8 code read as fp16 bits: (code & 0x7F) << shift, sign at bit 15; then x unit is the value (exact). e5m2 is
# fp16's top byte; e4m3's 4-bit exponent (bias 7) in fp16's 5-bit field (bias 15) reads 2^-8 of its value.
FP8_UNPACK = {"fp8_e4m3": (7, 256.0), "fp8_e5m2": (8, 1.0)}
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + it) - it rounds fp32 |y| < 2^22 to an integer, half to even


def kv_codes(cache: torch.Tensor) -> str:
    """The cache's code format as the kernels' CODES constexpr: kv_quant's name ("int8", "fp8_e4m3",
    "fp8_e5m2"), or "" for a cache of model-dtype values."""
    return KV_CODES.get(cache.dtype, "")


def kv_code_view(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is passed for a cache: fp8 codes as their bytes (uint8), anything else as is."""
    return cache.view(torch.uint8) if kv_codes(cache).startswith("fp8") else cache


def check_kv_scales(op: str, cache, k_scale, v_scale) -> None:
    """Scales of a quantized cache as the kernels index them: contiguous bf16 `[num_blocks, block_size,
    num_kv_heads]`, the caches' codes int8 or fp8."""
    if not kv_quant.is_quantized(cache):
        raise ValueError(f"{op}: scales given for a {cache.dtype} cache (quantized caches are int8 or fp8)")
    for scales in (k_scale, v_scale):
        if scales.dtype != kv_quant.SCALE_DTYPE or scales.shape != cache.shape[:3] or not scales.is_contiguous():
            raise ValueError(
                f"{op}: KV scales must be contiguous {kv_quant.SCALE_DTYPE} {tuple(cache.shape[:3])}, got "
                f"{scales.dtype} {tuple(scales.shape)}"
            )


def example_kv_scales(cache: torch.Tensor) -> tuple:
    """Shape-only scales for a quantized example cache; (None, None) for a model-dtype one."""
    if not kv_quant.is_quantized(cache):
        return None, None
    return tuple(torch.empty(cache.shape[:3], dtype=kv_quant.SCALE_DTYPE, device=cache.device) for _ in "kv")


@triton.jit
def kv_scale(amax, CODES: tl.constexpr):
    """A (token, KV head)'s scale from its fp32 largest magnitude -> (the bf16 scale as fp32, its bf16 bits as int16),
    as `kv_quant.quantize`: amax / CODE_MAX correctly rounded (`div_rn`; `/` is approximate on GPUs), at least bf16's
    smallest normal, rounded to bf16 to nearest even (positive and finite: no NaN or sign cases)."""
    if CODES == "int8":
        code_max = 127.0
    elif CODES == "fp8_e4m3":
        code_max = 448.0
    else:
        code_max = 57344.0
    scale = tl.maximum(tl.math.div_rn(amax, code_max), 1.1754943508222875e-38)
    bits = scale.to(tl.int32, bitcast=True)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (high << 16).to(tl.float32, bitcast=True), high.to(tl.int16)


@triton.jit
def kv_quantize(x, scale, CODES: tl.constexpr):
    """fp32 values -> codes against the bf16 `scale` (fp32), as `kv_quant.quantize`: x / scale correctly rounded,
    then int8 rounded half to even (torch's `round`) and clamped to +-127, or fp8 clamped to +-CODE_MAX and rounded
    to nearest even (torch's cast), as uint8 bytes."""
    y = tl.math.div_rn(x, scale)
    if CODES == "int8":
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return ((y + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int8)
    elif CODES == "fp8_e4m3":
        return _fp8_bits(y, 3, 7, 448.0)
    else:
        return _fp8_bits(y, 2, 15, 57344.0)


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, CODE_MAX: tl.constexpr):
    """fp32 -> an fp8 code (MANT mantissa bits, exponent bias BIAS) rounded to nearest even and saturated at
    CODE_MAX, as its byte. Normal codes round the fp32 bits' mantissa in integer arithmetic and rebias the exponent;
    below the smallest normal, 2^(1 - BIAS), the code is the magnitude in units of the subnormal step, rounded (a
    carry into 1 << MANT is the smallest normal's code, so that case needs nothing)."""
    a = tl.minimum(tl.abs(y), CODE_MAX)
    bits = a.to(tl.int32, bitcast=True)
    shift: tl.constexpr = 23 - MANT
    normal = ((bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift) - ((127 - BIAS) << MANT)
    smallest_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    # capped so that the branch tl.where drops converts no out-of-range float
    step_units = tl.minimum(a, smallest_normal) * (2.0 ** (BIAS - 1 + MANT))
    code = tl.where(a < smallest_normal, ((step_units + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32), normal)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80  # -0.0 keeps its sign byte, as torch's cast
    return (code | sign).to(tl.uint8)


@triton.jit
def kv_code_values(codes, fp8_shift, CODES: tl.constexpr):
    """Codes as loaded (int8, or fp8 bytes as uint8) -> fp32 code values, exactly; an fp8 value still needs its
    format's `FP8_UNPACK` unit (the caller folds it into the scale). `CODES` is "int8" or "fp8" (either format:
    `fp8_shift` picks it at run time, so both share one binary)."""
    if CODES == "int8":
        return codes.to(tl.float32)
    else:
        u = codes.to(tl.int32)
        half = (((u & 0x7F) << fp8_shift) | ((u & 0x80) << 8)).to(tl.int16)
        return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def bf16_bits_to_float(bits):
    """Scales loaded as int16 bits -> fp32 (exact)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.constexpr_function
def _inv_sqrt(n):
    return math.sqrt(1 / n)  # as `kv_quant.rotate`'s fp64 scale


@triton.jit
def hadamard_halves(x1, x2, HALF: tl.constexpr):
    """A head's halves `x1`, `x2` `[HALF]` (2 * HALF a power of two) -> the halves of the head times the normalized
    Hadamard matrix, fp32, as `kv_quant.rotate(exact=True)`: butterflies in fp64 (their +-x sums exact), times fp64
    sqrt(1 / (2 * HALF)), rounded once. The top index bit's butterfly first: H_2n = [[H_n, H_n], [H_n, -H_n]]."""
    a, b = x1.to(tl.float64), x2.to(tl.float64)
    scale = tl.full([], _inv_sqrt(2 * HALF), tl.float64)
    lo, hi = _butterflies(a + b, HALF), _butterflies(a - b, HALF)
    return (lo * scale).to(tl.float32), (hi * scale).to(tl.float32)


@triton.jit
def _butterflies(x, N: tl.constexpr):
    """`x` `[N]` times the unnormalized Sylvester Hadamard matrix of size N (entries (-1)^popcount(i & j), one
    factor [[1, 1], [1, -1]] per index bit): a butterfly on the lowest bit moves its result to the highest, so
    log2(N) of them treat each bit once and end in the original order."""
    for bit in tl.static_range(16):
        if (1 << bit) < N:
            a, b = tl.split(tl.reshape(x, [N // 2, 2]))
            x = tl.reshape(tl.trans(tl.join(a + b, a - b)), [N])
    return x
