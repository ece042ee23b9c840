"""Triton paged attention (the GPU path of `paged_attention`; the KV-cache write: triton_write_kv): the tiles, the
launches and their argument checks here, the kernels themselves in triton_attention_kernels.

One attention kernel, two tile shapes. A program owns `BLOCK_M` query rows: `block_q` consecutive tokens of one
request times `heads` query heads that share one KV head (GQA without repeating K/V; a group larger than the
tile is spread over several programs). It walks the request's KV through its block table `BLOCK_N` tokens a
step with an online softmax, skipping the causal mask on steps every row fully sees. Non-causal calls
(`CAUSAL=False`, encoders) let every row see all of its request's keys: only the last step masks, at `seq_len`.
- Prefill tiles (`DECODE=False`, 64-128 rows) serve requests with several query tokens: chunked prefills with
  a cached prefix as well as fresh prompts. Each program finds its request by binary search over
  `query_start_loc`.
- Decode tiles (`DECODE=True`, 16 rows, one token) serve the requests with one query token, one program per
  request and KV head. A mixed batch launches both; each program skips the other kind's requests, so decode
  rows never pay for prefill-sized tiles. In decode-only batches where requests x KV heads cannot fill the GPU,
  each request's KV range is split across programs ("flash decoding") and a merge kernel combines the partial
  softmaxes. A one-token query is the last of its context and sees every key either way, so decode tiles are
  the one (causal) binary for both kinds of call.

Quantized caches (`kv_quant`: int8 or fp8 codes, a bf16 scale per token and KV head) are read in place: each
K/V tile's codes times its tokens' scales, in fp32, rounded to the query's dtype (the values the torch path
dequantizes), then the same math. fp8 codes are unpacked by bit arithmetic, not Triton's fp8 types, so every
format runs from sm_80 on; e4m3 and e5m2 share one binary (`KV_CODES="fp8"`, the format a runtime argument).
The write kernel quantizes per token and KV head, keys rotated first where head_dim is a power of two
(triton_common has the code arithmetic both share, and the rotation the fused rotary write shares too).

Host code never reads device tensors: grids come from the host-side ints in `AttentionMetadata`. Launch,
interpreter and tile plumbing: triton_common.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton

from tiffin.kernels import kv_quant
from tiffin.kernels import triton_common as tc
from tiffin.kernels.attention import AttentionMetadata
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.triton_attention_kernels import _merge_splits_kernel, _paged_attention_kernel

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
# fp32 queries on a quantized cache: d=256 spills on sm_80 and sm_90 at every tile tried (BLOCK_N 16 or 32, one or
# two stages, 8 or 16 warps: 3xTF32 operand halves beside the scaled codes); refused, the torch backend serves it
QUANTIZED_FP32_HEAD_DIMS = HEAD_DIMS[:-1]
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds


def attention_tile(
    head_dim: int, dtype: torch.dtype, decode: bool, arch: int = 80, quantized: bool = False, bounded: bool = False
):
    """`block_m` query rows (tokens x query heads of one KV head) per program, `block_n` KV tokens per
    inner-loop step; `block_k` is the QK dot's inner dimension, the padded head dim. `quantized`: the KV cache
    holds codes (`_quantized_tile`). `bounded` (a window or soft-cap, 16-bit queries on a model-dtype cache only:
    fp32 tiles and quantized caches' spilled with it) takes registers for the mask's bounds and the cap: decode
    tiles step at most 64 keys (d <= 32 spilled at 128 on sm_89)."""
    tile = _model_dtype_tile(head_dim, dtype, decode, arch)
    tile = _quantized_tile(tile, dtype, decode, arch) if quantized else tile
    return dataclasses.replace(tile, block_n=min(tile.block_n, 64)) if bounded else tile


def _quantized_tile(tile: tc.Tile, dtype: torch.dtype, decode: bool, arch: int) -> tc.Tile:
    """Codes are scaled in registers on their way to the dots (a model-dtype tile goes from global to shared memory
    and on to the dot untouched), which takes registers the model-dtype tiles do not have to spare. What
    compile_check found spill-free: 16-bit decode tiles with 8 warps at the head dims of `_WIDE_QUANTIZED_DECODE`
    (4 elsewhere: ptxas spills some of those at 8), in the model-dtype tile's stages except two on sm_120; prefill
    tiles in one stage except on
    sm_90 (227 KB of shared memory keeps the second out of registers), d=256 in 16-token KV steps where a block
    has 99 KB. fp32 tiles (already 8 warps) fit as they are, except d=256, refused (`QUANTIZED_FP32_HEAD_DIMS`)."""
    if dtype == torch.float32:
        return tile
    if decode:
        warps = 8 if tile.block_k in _WIDE_QUANTIZED_DECODE.get(arch, ()) else 4
        return dataclasses.replace(tile, num_warps=warps, num_stages=2 if arch == 120 else tile.num_stages)
    if arch == 90:
        return tile
    block_n = 16 if tile.block_k == 256 and arch in (86, 89, 120) else tile.block_n
    return dataclasses.replace(tile, block_n=block_n, num_stages=1)


_WIDE_QUANTIZED_DECODE = {80: (128, 256), 86: (256,), 89: (256,), 90: (32,), 120: (256,)}  # padded head dims


def _model_dtype_tile(head_dim: int, dtype: torch.dtype, decode: bool, arch: int) -> tc.Tile:
    d = pad_head_dim(head_dim)
    small_shared = arch in (86, 89, 120)  # 99 KB of shared memory per block (sm_80: 163 KB, sm_90: 227 KB)
    if dtype == torch.float32:  # 3xTF32 keeps hi/lo halves of each operand in registers: small tiles, 8 warps
        # a second stage of d=256 K/V tiles takes 100 KB: one stage there
        stages = 1 if small_shared and d > 128 else 2
        return tc.Tile(16 if decode or d > 128 else 32, 32, d, num_warps=8, num_stages=stages)
    if decode:  # memory-bound: 16 rows (the GQA group) is the smallest MMA; wide KV steps keep loads in flight
        block_m, block_n = 16, (128 if d <= 32 else 64 if d <= 128 else 32)
    else:
        block_m, block_n = (128, 64) if d <= 128 else (64, 32)
    # ptxas caps sm_86/89's two-stage d=64 decode pipeline at 64 registers and spills; three stages do not
    # (sm_120 likewise at d=128)
    stages = 3 if small_shared and decode and (d == 64 or (arch == 120 and d == 128)) else 2
    return tc.Tile(block_m, block_n, d, num_warps=4 if block_m * d < 8192 else 8, num_stages=stages)


def pad_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@implements("paged_attention", "triton")
def paged_attention_triton(
    query,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    scale: float,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    query_rotated=False,
    fresh_kv=None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    out = tc.empty(query.shape, query.dtype, query.device)
    if k_scale is not None and not query_rotated:  # against keys stored rotated (kv_quant)
        query = kv_quant.rotate(query).to(query.dtype)
    if query.shape[0]:
        kv = (k_cache, v_cache, md, scale, out)
        options = dict(causal=causal, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap)
        for launch in paged_attention_launches(query, *kv, **options):
            launch(query.device)
    return out


def paged_attention_launches(
    query,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    scale: float,
    out,
    splits: int | None = None,
    arch=None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    window: int = 0,
    softcap: float = 0.0,
) -> list[tc.Launch]:
    """The launches for one call: prefill tiles unless every request decodes, and decode tiles. Decode-only
    batches may split KV `splits` ways (None: the dispatcher's choice), adding the merge. Tiles are `arch`'s
    (None: the device's). `causal` reaches only the prefill tiles (decode tiles see every key anyway). A quantized
    cache comes with its scales `k_scale`/`v_scale`. `window` and `softcap` (0: off) are runtime arguments of
    the binaries built `BOUNDED`, which only calls with either launch (as runtime arguments in every kernel they
    made the fp32 tiles spill)."""
    _check_attention_args(query, k_cache, v_cache, md, k_scale, v_scale)
    if (window or softcap) and (query.dtype == torch.float32 or k_scale is not None):
        raise ValueError(
            "paged_attention: the Triton kernel applies a window or soft-cap to 16-bit queries on a model-dtype KV "
            f"cache only, not {query.dtype} queries on a {k_cache.dtype} cache (those tiles spill registers); use "
            "kernel_backend='torch', or a 16-bit dtype and kv_cache_dtype='auto'"
        )
    arch = tc.arch(query.device) if arch is None else arch
    kv = (_KVCache(k_cache, v_cache, k_scale, v_scale), md, scale, out, arch)
    bounds = dict(window=window, softcap=softcap)
    decode = _attention(query, *kv, decode=True, **bounds)
    if md.max_query_len > 1:
        prefill = _attention(query, *kv, decode=False, causal=causal, **bounds)
        return [prefill, decode]
    if splits is None:
        splits = tc.num_splits(math.prod(decode.grid), triton.cdiv(md.max_seq_len, MIN_SPLIT_TOKENS), query.device)
    if splits == 1:
        return [decode]
    num_tokens, num_heads, head_dim = query.shape
    d_pad = pad_head_dim(head_dim)
    part = tc.empty((splits, num_tokens, num_heads, d_pad), torch.float32, query.device)
    stats = tc.empty((splits, num_tokens, num_heads, 2), torch.float32, query.device)
    merge = tc.Launch(
        _merge_splits_kernel,
        (num_tokens, num_heads),
        (out, part, stats, splits, num_tokens, out.stride(0), out.stride(1)),
        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, MAX_SPLITS=tc.MAX_SPLITS),
    )
    return [_attention(query, *kv, True, splits, part, stats, **bounds), merge]


@dataclass(frozen=True)
class _KVCache:
    """The caches as the attention kernel reads them: fp8 codes as bytes, scales as their bf16 bits (int16); a
    model-dtype cache passes itself in the scales' places (never read: `KV_CODES=""`)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def args(self) -> tuple:
        if self.k_scale is None:
            return self.k, self.v, self.k, self.v
        codes = (tc.kv_code_view(self.k), tc.kv_code_view(self.v))
        return *codes, self.k_scale.view(torch.int16), self.v_scale.view(torch.int16)

    def options(self) -> tuple[str, int, float]:
        """(KV_CODES, fp8_shift, code_unit): "", "int8" or "fp8", and an fp8 format's unpacking
        (`triton_common.FP8_UNPACK`)."""
        codes = tc.kv_codes(self.k)
        if codes.startswith("fp8"):
            return "fp8", *tc.FP8_UNPACK[codes]
        return codes, 0, 1.0


def _attention(
    query,
    kv: _KVCache,
    md,
    scale,
    out,
    arch,
    decode,
    splits=1,
    part=None,
    stats=None,
    causal=True,
    window=0,
    softcap=0.0,
):
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv.k.shape[1:3]
    kv_codes, fp8_shift, code_unit = kv.options()
    scale_strides = kv.k_scale.stride()[:2] if kv.k_scale is not None else (0, 0)
    num_seqs, group = md.seq_lens.shape[0], num_heads // num_kv_heads
    bounded = bool(window or softcap)
    tile = attention_tile(head_dim, query.dtype, decode, arch, quantized=kv.k_scale is not None, bounded=bounded)
    heads = min(group, tile.block_m)
    block_q = 1 if decode else tile.block_m // heads
    num_tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    return tc.Launch(
        _paged_attention_kernel,
        (num_tiles, num_kv_heads * triton.cdiv(group, heads), splits),
        (
            query,
            *kv.args(),
            out,
            out if part is None else part,
            out if stats is None else stats,
            md.query_start_loc,
            md.seq_lens,
            md.block_tables,
            scale * math.log2(math.e),
            fp8_shift,
            code_unit,
            window,
            softcap * math.log2(math.e),
            num_seqs,
            num_tokens,
            num_heads,
            group,
            heads,
            block_q,
            block_size.bit_length() - 1,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            *kv.k.stride()[:3],
            *kv.v.stride()[:3],
            md.block_tables.stride(0),
            *scale_strides,
        ),
        dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=tile.block_k,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            DECODE=decode,
            SPLIT=splits > 1,
            CAUSAL=causal,
            BOUNDED=bounded,
            KV_CODES=kv_codes,
            **tc.dot_options(query),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        ),
    )


def _check_attention_args(query, k_cache, v_cache, md: AttentionMetadata, k_scale=None, v_scale=None) -> None:
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"paged_attention: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
            f"query {tuple(query.shape)}"
        )
    cache_dtype = query.dtype if k_scale is None else k_cache.dtype  # quantized: codes of any format, any query
    if query.dtype not in tc.DTYPES or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(
            f"paged_attention: query/cache dtypes must match and be one of {tc.DTYPES} (or the caches quantized, "
            f"with scales), got {query.dtype}/{k_cache.dtype}/{v_cache.dtype}"
        )
    if k_scale is not None:
        tc.check_kv_scales("paged_attention", k_cache, k_scale, v_scale)
        if query.dtype == torch.float32 and head_dim not in QUANTIZED_FP32_HEAD_DIMS:
            raise ValueError(
                f"paged_attention: kv_cache_dtype {tc.kv_codes(k_cache)} with float32 queries and head_dim "
                f"{head_dim} is not supported by the Triton kernel (head dims {QUANTIZED_FP32_HEAD_DIMS}); use "
                f"kernel_backend='torch' or a 16-bit dtype"
            )
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"paged_attention: head_dim {head_dim} not supported by the Triton kernel ({HEAD_DIMS})")
    if block_size & (block_size - 1):
        raise ValueError(f"paged_attention: block_size must be a power of two, got {block_size}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention: head_dim must be the contiguous dimension of query and caches")
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(md, name)
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"paged_attention: md.{name} must be int32 on {query.device}, got {t.dtype} on {t.device}")
    if md.block_tables.stride(1) != 1:
        raise ValueError("paged_attention: md.block_tables rows must be contiguous")


@register("paged_attention")
def _compile_cases(arch: int):
    """Every launch the dispatchers can make: each query dtype and head dim, on model-dtype caches and quantized
    ones (int8, fp8: e4m3 and e5m2 share the binary), the prefill tile causal and not, the decode tile with and
    without KV splits, the causal ones `BOUNDED` too (a window or soft-cap: 16-bit queries, model-dtype caches),
    and the merge. Block size, GQA ratio and batch shape
    are runtime arguments that do not change the binary."""
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        for codes, cache_dtype in (("", dtype), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            label = f" kv={codes}" if codes else ""
            for head_dim in QUANTIZED_FP32_HEAD_DIMS if codes and dtype == torch.float32 else HEAD_DIMS:
                seen = set()
                kinds = [(False, None, True, 0), (False, None, False, 0), (True, 1, True, 0), (True, 2, True, 0)]
                if dtype != torch.float32 and not codes:
                    kinds += [(False, None, True, 8), (True, 1, True, 8), (True, 2, True, 8)]
                for decode_only, splits, causal, window in kinds:
                    query, cache, _, md, scale, out = _example_inputs(dtype, head_dim, decode_only)
                    cache = cache.to(cache_dtype)
                    scales = tc.example_kv_scales(cache)
                    for launch in paged_attention_launches(
                        query, cache, cache, md, scale, out, splits, arch, causal, *scales, window=window
                    ):
                        kind = _launch_kind(launch)
                        if kind not in seen and not (codes and kind == "merge"):  # the merge reads no cache
                            seen.add(kind)
                            config = f"{name} d={head_dim}{label} {kind}"
                            yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)


def _launch_kind(launch: tc.Launch) -> str:
    if launch.kernel is _merge_splits_kernel:
        return "merge"
    bounded = " bounded" if launch.kwargs["BOUNDED"] else ""
    if launch.kwargs["DECODE"]:
        return ("decode split" if launch.kwargs["SPLIT"] else "decode") + bounded
    return ("prefill" if launch.kwargs["CAUSAL"] else "prefill non-causal") + bounded


def _example_inputs(dtype: torch.dtype, head_dim: int, decode: bool):
    """Shape-only ("meta") arguments for `paged_attention_launches`: only dtypes, constexprs and the
    16-divisibility of pointers and strides reach the compiler, and those match any engine batch."""
    num_kv_heads, group, block_size, num_blocks = 2, 4, 16, 8
    num_tokens = 2 if decode else 8
    meta = dict(device="meta")
    query = torch.empty(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, **meta)
    cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, **meta)
    starts = [0, 1, 2] if decode else [0, 3, 8]
    md = AttentionMetadata(
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, **meta),
        query_start_loc=torch.empty(3, dtype=torch.int32, **meta),
        seq_lens=torch.empty(2, dtype=torch.int32, **meta),
        block_tables=torch.empty(2, 4, dtype=torch.int32, **meta),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[40, 64],
        max_query_len=1 if decode else 5,
        max_seq_len=64,
    )
    return query, cache, cache, md, head_dim**-0.5, torch.empty_like(query)
