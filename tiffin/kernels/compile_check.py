"""Compile every Triton kernel configuration the dispatchers can launch for real GPU targets, without a GPU.

    python -m tiffin.kernels.compile_check --arch 80,90

prints one row per (kernel, config, arch) with registers, shared memory and spilled bytes, and exits non-zero
if any compile fails or spills. Code generation is Triton's own JIT path: each case's example launch
arguments are specialized exactly as a real launch would be (dtypes, 16-divisibility of pointers and ints),
then compiled by `triton.compile` for `GPUTarget("cuda", arch, 32)`. Registers and spills are read from the
cubin with the wheel's cuobjdump (spills are the per-thread stack/local bytes, Triton's `n_spills` x 4).

Registering a kernel: put its module in `tiffin/kernels/` (every module there is imported) and decorate a
generator of cases. Build the cases with the same code that builds real launches, on "meta" tensors, so the
check cannot drift from what the dispatcher runs:

    from tiffin.kernels.compile_check import CompileCase, register

    @register("awq_gemm")
    def _compile_cases():
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_GENERATORS: dict[str, Callable[[], Iterable["CompileCase"]]] = {}


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
    def ok(self) -> bool:
        return not self.error and self.spills == 0


def register(name: str) -> Callable:
    """Decorator: `name`'s cases come from the decorated zero-argument generator."""

    def decorate(generate: Callable[[], Iterable[CompileCase]]) -> Callable:
        if name in _GENERATORS:
            raise ValueError(f"compile_check: kernel {name!r} registered twice")
        _GENERATORS[name] = generate
        return generate

    return decorate


def collect() -> list[tuple[str, CompileCase]]:
    """Import every kernel module, then every registered (name, case)."""
    import tiffin.kernels

    for module in pkgutil.iter_modules(tiffin.kernels.__path__):
        if module.name != "compile_check":
            importlib.import_module(f"tiffin.kernels.{module.name}")
    return [(name, case) for name, generate in _GENERATORS.items() for case in generate()]


def compile_case(name: str, case: CompileCase, arch: int) -> Result:
    """Compile one case for sm_`arch` the way `JITFunction.run` would, and read its resource usage."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(case.kernel, JITFunction):
        return Result(name, case.config, arch, error="not a JITFunction (is TRITON_INTERPRET set?)")
    target = GPUTarget("cuda", arch, 32)
    try:
        backend = make_backend(target)
        binder = create_function_from_signature(case.kernel.signature, case.kernel.params, backend)
        bound, specialization, options = binder(*case.args, **case.kwargs)
        options, signature, constexprs, attrs = case.kernel._pack_args(
            backend, case.kwargs, bound, specialization, options
        )
        compiled = compile(
            ASTSource(case.kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
        registers, spills = _resource_usage(compiled.asm["cubin"])
    except Exception as e:  # report every failure in the table rather than stop at the first
        return Result(name, case.config, arch, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return Result(name, case.config, arch, registers, compiled.metadata.shared, spills)


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


_CASES: list[tuple[str, CompileCase]] = []  # filled before the worker pool forks


def _compile_indexed(job: tuple[int, int]) -> Result:
    index, arch = job
    return compile_case(*_CASES[index], arch)


def run(archs: Iterable[int], jobs: int = 0) -> list[Result]:
    """Compile every registered case for every arch, `jobs` processes at a time (0: one per CPU)."""
    _CASES[:] = collect()
    work = [(i, arch) for arch in archs for i in range(len(_CASES))]
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [_compile_indexed(job) for job in work]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_compile_indexed, work, chunksize=1)


def format_table(results: list[Result]) -> str:
    rows = [("kernel", "config", "arch", "regs", "shared", "spills", "status")]
    for r in results:
        status = "ok" if r.ok else (r.error or "SPILLS")
        rows.append((r.kernel, r.config, f"sm_{r.arch}", str(r.registers), str(r.shared), str(r.spills), status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities, e.g. 80,90")
    parser.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: one per CPU)")
    args = parser.parse_args(argv)
    try:
        archs = [int(a) for a in args.arch.split(",")]
    except ValueError:
        parser.error(f"--arch must be comma-separated integers, got {args.arch!r}")
    # Triton 3.9 warns once per process that its fp-fusion default will change; the check mirrors the default.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    results = run(archs, args.jobs)
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} compiled without spills")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    # Kernels must be JIT functions to compile; the interpreter setting only matters when running them.
    os.environ.pop("TRITON_INTERPRET", None)
    from tiffin.kernels import compile_check  # the registry kernels add to, not this __main__ copy

    sys.exit(compile_check.main())
