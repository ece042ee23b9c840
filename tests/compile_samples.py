"""A sample of `compile_check`'s cases compiled for real GPUs in a fresh interpreter (the interpreter's
TRITON_INTERPRET left out): what each kernel family's slow compile test asserts beside its full table."""

import os
import subprocess
import sys


def assert_sample_compiles(kernels: list[str], sample: list[str], archs: tuple[int, ...] = (80, 90)) -> None:
    """Every case of `kernels` named in `sample` compiles for each of `archs` without spills."""
    script = (
        "from tiffin.kernels import compile_check as cc\n"
        f"sample, kernels = {sample!r}, {kernels!r}\n"
        f"for arch in {archs!r}:\n"
        "    cases = [(n, c) for n, c in cc.collect(arch, kernels) if c.config in sample]\n"
        "    assert len(cases) == len(sample), [c.config for _, c in cases]\n"
        "    for name, case in cases:\n"
        "        r = cc.compile_case(name, case, arch)\n"
        "        print(r.config, arch, r.registers, r.shared, r.status)\n"
        "        assert r.ok, r\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
