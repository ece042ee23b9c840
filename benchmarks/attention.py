"""Attention kernels on a CUDA GPU (never in CI; needs a GPU).

Decode: batch 1-256 x context 512-8192, one query token per request. Reports the Triton paged-attention
kernel's time, its achieved bandwidth (K/V bytes it must read, plus query and output) as GB/s and as a share of
the device's measured copy bandwidth, and the time of the torch path (K/V gathered through the block tables
into contiguous tensors, then SDPA) for comparison.
Prefill: fresh prompts (no cached prefix) of 512-8192 tokens, causal; TFLOP/s of the Triton kernel next to
torch SDPA on contiguous tensors (FlashAttention's ceiling, no paging).

    python benchmarks/attention.py [--dtype bfloat16] [--num-heads 32] [--num-kv-heads 8] [--head-dim 128]
                                 [--block-size 16] [--quick]
"""

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tiffin.kernels import AttentionMetadata, paged_attention, write_kv

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DECODE = {"batches": (1, 4, 16, 64, 256), "contexts": (512, 1024, 2048, 4096, 8192)}
PREFILL = ((1, 512), (8, 512), (1, 2048), (4, 2048), (1, 8192))  # (batch, tokens)
# --quick: one size of each, so that the tests see the benchmark run
QUICK_DECODE, QUICK_PREFILL = {"batches": (4,), "contexts": (512,)}, ((1, 512),)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy GB/s (bytes read + written), the practical ceiling for a memory-bound kernel."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def make_batch(query_lens, context_lens, args, dtype):
    """Scrambled block tables, caches filled by the real KV write, random queries."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    bs, kvh, hd = args.block_size, args.num_kv_heads, args.head_dim
    blocks = [-(-s // bs) for s in seq_lens]
    order = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    offsets = [0]
    for i, n in enumerate(blocks):
        tables[i, :n] = order[offsets[-1] : offsets[-1] + n]
        offsets.append(offsets[-1] + n)
    k_cache = torch.empty(sum(blocks), bs, kvh, hd, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    for i, s in enumerate(seq_lens):  # write every cached token through write_kv, as the engine would
        pos = torch.arange(s, device="cuda")
        slots = tables[i, pos // bs].long() * bs + pos % bs
        kv = torch.randn(2, s, kvh, hd, dtype=dtype, device="cuda")
        write_kv(kv[0], kv[1], k_cache, v_cache, slots, backend="triton")
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(starts[-1], args.num_heads, hd, dtype=dtype, device="cuda")
    return query, k_cache, v_cache, md


def bench_decode(args, dtype, copy_gbs: float, batches: tuple[int, ...], contexts: tuple[int, ...]) -> None:
    scale = args.head_dim**-0.5
    elt = torch.finfo(dtype).bits // 8
    print(
        f"\ndecode ({dtype}, {args.num_heads}/{args.num_kv_heads} heads, d={args.head_dim}, "
        f"block {args.block_size}); copy bandwidth {copy_gbs:.0f} GB/s"
    )
    print(f"{'batch':>5} {'context':>7} {'triton us':>10} {'GB/s':>7} {'% copy':>6} {'torch us':>9} {'speedup':>7}")
    for batch in batches:
        for context in contexts:
            query, k_cache, v_cache, md = make_batch([1] * batch, [context - 1] * batch, args, dtype)
            triton_ms = do_bench(lambda: paged_attention(query, k_cache, v_cache, md, scale, backend="triton"))
            torch_ms = do_bench(lambda: paged_attention(query, k_cache, v_cache, md, scale, backend="torch"))
            got = paged_attention(query, k_cache, v_cache, md, scale, backend="triton")
            want = paged_attention(query, k_cache, v_cache, md, scale, backend="torch")
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            nbytes = (2 * batch * context * args.num_kv_heads + 2 * batch * args.num_heads) * args.head_dim * elt
            gbs = nbytes / triton_ms / 1e6
            print(
                f"{batch:>5} {context:>7} {triton_ms * 1e3:>10.1f} {gbs:>7.0f} {100 * gbs / copy_gbs:>5.0f}% "
                f"{torch_ms * 1e3:>9.1f} {torch_ms / triton_ms:>6.1f}x"
            )
            del query, k_cache, v_cache, md


def bench_prefill(args, dtype, sizes: tuple[tuple[int, int], ...]) -> None:
    scale = args.head_dim**-0.5
    print(f"\nprefill ({dtype}, causal, no cached prefix)")
    print(f"{'batch':>5} {'tokens':>6} {'triton ms':>9} {'TFLOP/s':>7} {'SDPA ms':>8} {'SDPA TFLOP/s':>12}")
    for batch, length in sizes:
        query, k_cache, v_cache, md = make_batch([length] * batch, [0] * batch, args, dtype)
        # 2 matmuls (QK^T, PV) x 2 flops per multiply-add over the causal half of the score matrix
        flops = 4 * batch * length * (length + 1) / 2 * args.num_heads * args.head_dim
        triton_ms = do_bench(lambda: paged_attention(query, k_cache, v_cache, md, scale, backend="triton"))
        q = torch.randn(batch, args.num_heads, length, args.head_dim, dtype=dtype, device="cuda")
        k = torch.randn(batch, args.num_kv_heads, length, args.head_dim, dtype=dtype, device="cuda")
        sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
        print(
            f"{batch:>5} {length:>6} {triton_ms:>9.2f} {flops / triton_ms / 1e9:>7.0f} {sdpa_ms:>8.2f} "
            f"{flops / sdpa_ms / 1e9:>12.0f}"
        )
        del query, k_cache, v_cache, md, q, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one decode and one prefill size only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    print(torch.cuda.get_device_name())
    bench_decode(args, dtype, copy_bandwidth(), **(QUICK_DECODE if args.quick else DECODE))
    bench_prefill(args, dtype, QUICK_PREFILL if args.quick else PREFILL)


if __name__ == "__main__":
    main()
