"""Quantized CPU linears on the bf16 path (`block_gemm` at two activation levels from `cpu_native.bf16_min_rows()`
rows; FP8 at every size) against torch's oneDNN bf16 linear on the same shapes. Weights of 8-bit and 4-bit BLOCKS,
Q4_K-like SUPER_MINS and FP8, bf16 activations (fp32 on a CPU without a bf16 GEMM: AVX2 only, where the peer is
torch's fp32 linear); each cell `median (min)` ms of --reps calls, the formats' calls alternated, then each format's
time over the dense one's (medians).

    python benchmarks/block_gemm.py [--rows 16,64,256,512] [--shapes 576x1536,1536x576,2048x2048,8960x1536]
                                    [--formats q8,q4,q4k,fp8] [--reps 30] [--threads 2] [--clock wall|thread]

--clock thread times the calling thread's CPU time (with --threads 1 only): steadier than the wall clock on a
machine other processes share. TIFFIN_CPU_AMX=0 keeps tiffin off AMX tiles (AMD Zen 4's AVX-512 BF16 path);
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 does the same for oneDNN.
"""

import argparse
import os
import statistics
import time

import torch

import tiffin  # noqa: F401, I001  (before torch's first op: it sets torch's OpenMP defaults)
from tiffin.kernels import block_gemm as bg
from tiffin.kernels import cpu_native

FORMATS = ("q8", "q4", "q4k", "fp8")


def make(fmt: str, n: int, k: int) -> bg.BlockWeights | None:
    """Random `n x k` weights of `fmt` at two activation levels (None: K not whole super-blocks for q4k)."""
    g = torch.Generator().manual_seed(n * 7 + k)
    scales = lambda top: torch.rand(n, k // 32, generator=g) / top  # noqa: E731
    if fmt in ("q8", "q4"):
        bits = 8 if fmt == "q8" else 4
        codes = torch.randint(0, 1 << bits, (n, k), generator=g)
        return bg.pack_codes(codes, scales(100 if bits == 8 else 10), -scales(1), bits, levels=2)
    if fmt == "q4k":
        if k % 256:
            return None
        sub = lambda: torch.randint(0, 64, (n, k // 32), generator=g).to(torch.uint8)  # noqa: E731
        d = lambda: (torch.rand(n, k // 256, generator=g) / 100).half()  # noqa: E731
        return bg.pack_super(torch.randint(0, 16, (n, k), generator=g), sub(), sub(), d(), d(), 4, levels=2)
    codes = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    return bg.pack_fp8(codes, scales(100))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16,64,256,512", help="activation rows M, comma-separated")
    p.add_argument("--shapes", default="576x1536,1536x576,2048x2048,8960x1536", help="N x K (outputs x inputs)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", default="wall", choices=["wall", "thread"])
    a = p.parse_args()
    formats = a.formats.split(",")
    if unknown := set(formats) - set(FORMATS):
        p.error(f"unknown formats {sorted(unknown)}")
    if a.clock == "thread" and a.threads != 1:
        p.error("--clock thread times one thread: use --threads 1")
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    amx = cpu_native.library() is not None and cpu_native.library().tiffin_bf16_gemm_built() == 2
    path = "AMX tiles" if amx else "AVX-512 BF16" if cpu_native.bf16_min_rows() else "integer dot products"
    dense = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"  # an AVX2-only CPU: no bf16 GEMM
    print(f"tiffin {path}, bf16 from {cpu_native.bf16_min_rows()} rows; "
          f"{a.threads} threads; {a.clock} clock, median (min) of {a.reps} ms; "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}\n")  # fmt: skip
    print("| N x K | M | " + " | ".join([*formats, f"torch {dense}", *(f"{f} / {dense}" for f in formats)]) + " |")
    print("|---" * (3 + 2 * len(formats)) + "|")
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weights = {f: make(f, n, k) for f in formats}
        dense_weight = torch.randn(n, k)
        if dense == "bf16":
            dense_weight = torch.ops.mkldnn._reorder_linear_weight(dense_weight.bfloat16(), None)
        for m in map(int, a.rows.split(",")):
            cells = row(weights, dense_weight, m, k, a.reps, clock)
            print(f"| {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


def row(weights: dict, dense_weight: torch.Tensor, m: int, k: int, reps: int, clock) -> list[str]:
    """One table row's cells: each format's and torch's dense linear's `median (min)` ms (oneDNN's prepacked bf16
    where the CPU has a bf16 GEMM, else fp32 activations and weights), then each format over the dense one."""
    bf16 = dense_weight.dtype != torch.float32
    x = torch.randn(m, k).to(torch.bfloat16 if bf16 else torch.float32)
    calls = {f: (lambda w=w: bg.block_gemm(x, w)) for f, w in weights.items() if w is not None}
    calls["dense"] = (
        (lambda: torch.ops.mkldnn._linear_pointwise(x, dense_weight, None, "none", [], ""))
        if bf16
        else (lambda: torch.nn.functional.linear(x, dense_weight))
    )
    for call in calls.values():  # warm: the library built, buffers grown
        for _ in range(3):
            call()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    cell = lambda f: f"{med[f]:.3f} ({min(times[f]) * 1e3:.3f})" if f in med else "-"  # noqa: E731
    ratio = lambda f: f"{med[f] / med['dense']:.2f}" if f in med else "-"  # noqa: E731
    return [cell(f) for f in weights] + [cell("dense")] + [ratio(f) for f in weights]


if __name__ == "__main__":
    main()
