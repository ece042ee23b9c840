"""What every Triton kernel module shares: the launch record, tile configs, the SM count, how far to split a
reduction across programs, buffer allocation, dtypes and dot options.

On CPU tensors the kernels run under Triton's interpreter when TRITON_INTERPRET=1 at call time (see `Launch`),
whatever the variable was at import. The interpreter's bf16 math is wrong, so there bf16 operands are upcast
to fp32 (`UPCAST`); fp16 keeps the GPU's exact code path (fp16 operands, fp32 accumulation).
"""

import contextlib
import functools
import sys
from dataclasses import dataclass

import torch
import triton
from triton import knobs

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


@functools.cache
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@contextlib.contextmanager
def _interpreting(fn):
    """Let an interpreted kernel call @triton.jit helpers: its own module's and triton.language's (tl.max,
    tl.sum, tl.cdiv, ...). Those are compiled-only JITFunctions when TRITON_INTERPRET was unset at import;
    swapping them for interpreted twins is what lets the variable be set at call time, in any import order.
    Every name is restored afterwards, including what the interpreter patches for nested calls and never
    restores, so compiled kernels in the same process see a clean triton.language. (Names the interpreter adds
    to a kernel's globals stay: its cached rewritten functions look them up there.)"""
    from triton.runtime.jit import JITFunction

    language = [m for name, m in list(sys.modules.items()) if name.split(".")[:2] == ["triton", "language"]]
    namespaces = [vars(m) for m in language] + [fn.__globals__]
    saved = [dict(ns) for ns in namespaces]
    for ns in namespaces:
        for name, obj in list(ns.items()):
            if isinstance(obj, JITFunction):
                ns[name] = _interpreted(obj.fn)
    try:
        yield
    finally:
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
    None when one range writes `out` itself). `run_split_k` sums the partials."""
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


def run_split_k(launch: Launch, partial: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    launch(out.device)
    if partial is not None:
        out.copy_(partial.sum(0))
    return out


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
