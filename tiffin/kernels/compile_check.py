"""Compile every Triton kernel configuration the dispatchers can launch for real GPU targets, without a GPU.

    python -m tiffin.kernels.compile_check --arch 80,86,89,90,120

prints one row per (kernel, config, arch) with registers, shared memory and spilled bytes, and exits non-zero
if any compile fails, spills, or needs more shared memory than one block of that arch may have (a launch there
would fail). Dispatchers may pick tiles per arch (`triton_common.arch`): cases are generated per arch, so the
configuration checked for an arch is the one launched on it.

Code generation is Triton's own JIT path: each case's example launch arguments are specialized exactly as a
real launch would be (dtypes, 16-divisibility of pointers and ints), then compiled by `triton.compile` for
`GPUTarget("cuda", arch, 32)`. Registers and spills are read from the cubin with the wheel's cuobjdump (spills
are the per-thread stack/local bytes, Triton's `n_spills` x 4).

Registering a kernel: put its module in `tiffin/kernels/` (every module there is imported) and decorate a
generator of one arch's cases. Build the cases with the same code that builds real launches, on "meta" tensors,
so the check cannot drift from what the dispatcher runs:

    from tiffin.kernels.compile_check import CompileCase, register

    @register("awq_gemm")
    def _compile_cases(arch: int):
        for ...:
            yield CompileCase(kernel, "fp16 group=128 tile=64x64", args, kwargs)
"""

import argparse
import importlib
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_GENERATORS: dict[str, Callable[[int], Iterable["CompileCase"]]] = {}

# Shared memory one block may opt in to, bytes: the SM's carve-out less the 1 KB CUDA reserves per block
# (CUDA C++ Programming Guide, compute capabilities: 8.0 164 KB per SM, 8.6/8.9 100 KB, 9.0 228 KB, 12.0 100 KB).
SHARED_MEMORY_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 120: 99 * 1024}


@dataclass(frozen=True)
class CompileCase:
    kernel: object  # the @triton.jit function
    config: str  # what distinguishes this compile, for the table
    args: tuple  # example launch arguments (tensors may live on the "meta" device)
    kwargs: dict  # constexprs and launch options (num_warps, num_stages)


@dataclass(frozen=True)
class Result:
    kernel: str
    config: str
    arch: int
    registers: int = 0
    shared: int = 0
    spills: int = 0
    error: str = ""

    @property
    def over_shared(self) -> bool:
        return self.shared > SHARED_MEMORY_PER_BLOCK[self.arch]

    @property
    def ok(self) -> bool:
        return not self.error and self.spills == 0 and not self.over_shared

    @property
    def status(self) -> str:
        if self.error:
            return self.error
        problems = ["SPILLS"] * (self.spills > 0)
        problems += [f"SHARED > {SHARED_MEMORY_PER_BLOCK[self.arch]}"] * self.over_shared
        return " ".join(problems) or "ok"


def register(name: str) -> Callable:
    """Decorator: `name`'s cases for an arch come from the decorated generator, called with the arch."""

    def decorate(generate: Callable[[int], Iterable[CompileCase]]) -> Callable:
        if name in _GENERATORS:
            raise ValueError(f"compile_check: kernel {name!r} registered twice")
        _GENERATORS[name] = generate
        return generate

    return decorate


def collect(arch: int, kernels: Iterable[str] | None = None) -> list[tuple[str, CompileCase]]:
    """Import every kernel module, then every registered (name, case) for `arch` (of `kernels`; None: all)."""
    import tiffin.kernels

    for module in pkgutil.iter_modules(tiffin.kernels.__path__):
        if module.name != "compile_check":
            importlib.import_module(f"tiffin.kernels.{module.name}")
    unknown = set(kernels or ()) - set(_GENERATORS)
    if unknown:
        raise ValueError(f"compile_check: no kernel named {sorted(unknown)}; registered: {sorted(_GENERATORS)}")
    return [
        (name, case)
        for name, generate in _GENERATORS.items()
        if kernels is None or name in kernels
        for case in generate(arch)
    ]


def compile_case(name: str, case: CompileCase, arch: int) -> Result:
    """Compile one case for sm_`arch` the way `JITFunction.run` would, and read its resource usage."""
    try:
        compiled = compile_for(case, arch)
        registers, spills = _resource_usage(compiled.asm["cubin"])
    except Exception as e:  # report every failure in the table rather than stop at the first
        return Result(name, case.config, arch, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return Result(name, case.config, arch, registers, compiled.metadata.shared, spills)


def compile_for(case: CompileCase, arch: int):
    """`case` compiled for sm_`arch` as `JITFunction.run` would: Triton's compiled kernel, whose `asm` holds each
    stage's code ("ttir", "ttgir", "ptx", "cubin")."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(case.kernel, JITFunction):
        raise TypeError("not a JITFunction (is TRITON_INTERPRET set?)")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(case.kernel.signature, case.kernel.params, backend)
    bound, specialization, options = binder(*case.args, **case.kwargs)
    options, signature, constexprs, attrs = case.kernel._pack_args(backend, case.kwargs, bound, specialization, options)
    return compile(ASTSource(case.kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text))
    if "REG" not in usage:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return int(usage["REG"]), int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0))


_CASES: list[tuple[str, CompileCase, int]] = []  # filled before the worker pool forks


def _compile_indexed(index: int) -> Result:
    return compile_case(*_CASES[index])


def run(
    archs: Iterable[int], jobs: int = 0, kernels: Iterable[str] | None = None, split_archs: bool = False
) -> list[Result]:
    """Compile every registered case (of `kernels`; None: all) for every arch (`split_archs`: for one of them,
    `one_arch_each`), `jobs` processes at a time (0: one per CPU)."""
    cases = [(name, case, arch) for arch in archs for name, case in collect(arch, kernels)]
    _CASES[:] = one_arch_each(cases) if split_archs else cases
    work = range(len(_CASES))
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [_compile_indexed(job) for job in work]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_compile_indexed, work, chunksize=1)


def one_arch_each(cases: list[tuple[str, CompileCase, int]]) -> list[tuple[str, CompileCase, int]]:
    """Each (kernel, config) of `cases` on one of the archs it is a case of, picked by a hash of the two: every
    configuration compiled once, the archs sharing them (a cold compile is ~1 s a case on 2 cores)."""
    archs_of = defaultdict(list)
    for name, case, arch in cases:
        archs_of[name, case.config].append(arch)

    def picked(name: str, config: str) -> int:
        archs = archs_of[name, config]
        return archs[zlib.crc32(f"{name} {config}".encode()) % len(archs)]

    return [(name, case, arch) for name, case, arch in cases if arch == picked(name, case.config)]


def format_table(results: list[Result]) -> str:
    rows = [("kernel", "config", "arch", "regs", "shared", "spills", "status")]
    for r in results:
        rows.append((r.kernel, r.config, f"sm_{r.arch}", str(r.registers), str(r.shared), str(r.spills), r.status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,86,89,90,120", help="comma-separated compute capabilities")
    parser.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: one per CPU)")
    parser.add_argument("--kernels", help="comma-separated registered kernel names (default: all)")
    parser.add_argument("--split-archs", action="store_true", help="each configuration for one of the archs only")
    args = parser.parse_args(argv)
    try:
        archs = [int(a) for a in args.arch.split(",")]
    except ValueError:
        parser.error(f"--arch must be comma-separated integers, got {args.arch!r}")
    if unknown := [a for a in archs if a not in SHARED_MEMORY_PER_BLOCK]:
        parser.error(f"--arch {unknown}: known archs are {sorted(SHARED_MEMORY_PER_BLOCK)}")
    # Triton 3.9 warns once per process that its fp-fusion default will change; the check mirrors the default.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    results = run(archs, args.jobs, args.kernels and args.kernels.split(","), args.split_archs)
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} compiled without spills within shared memory")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    # Kernels must be JIT functions to compile; the interpreter setting only matters when running them.
    os.environ.pop("TRITON_INTERPRET", None)
    from tiffin.kernels import compile_check  # the registry kernels add to, not this __main__ copy

    sys.exit(compile_check.main())
