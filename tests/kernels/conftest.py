"""Fixtures the kernel tests share."""

import ctypes
import platform
import shutil
import subprocess

import pytest

from tiffin.kernels import cpu_native


@pytest.fixture(scope="session")
def avx2_library(tmp_path_factory):
    """The paged decode built for x86-64-v3 (AVX2 and FMA, no AVX-512): its 8-lane task, whatever this CPU runs."""
    if platform.machine() != "x86_64" or shutil.which("g++") is None:
        pytest.skip("x86-64 with g++ only")
    built = tmp_path_factory.mktemp("avx2") / "paged_decode.so"
    source = next(s for s in cpu_native.SOURCES if s.name == "cpu_paged_decode.cpp")
    flags = ["-O1", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    subprocess.run(["g++", *flags, str(source), "-o", str(built)], check=True)
    lib = ctypes.CDLL(str(built))
    lib.tiffin_paged_decode.argtypes, lib.tiffin_paged_decode.restype = cpu_native._DECODE_ARGS, None
    return lib
