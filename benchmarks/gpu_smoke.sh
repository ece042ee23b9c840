#!/usr/bin/env bash
# gpu_smoke.sh: tiffin on a real NVIDIA GPU (H100/H200/A100/L4) in one time-boxed run (default budget 525 s).
#
#   cd <tiffin repo root> && bash benchmarks/gpu_smoke.sh     # logs + summary.md under $OUT (./gpu-smoke-out)
#
# On a GPU machine without network access the machine's own python3 + CUDA torch are used as they are. Every
# path, pytest test and script option it names is checked by tests/benchmarks/test_gpu_smoke_paths.py, so that
# it cannot go stale silently.
#
# What it does (each step time-boxed; later steps are skipped, and listed as such, when the budget runs out):
#   setup  python: SMOKE_PYTHON if set; else a python3 whose torch sees CUDA, used as is when no package index
#          is reachable (tiffin imported from the repo through PYTHONPATH, nothing installed); else a venv in
#          $WORK (sharing the image's torch if it has a CUDA one, otherwise `pip install torch`, the CUDA build on
#          PyPI) plus `pip install -e '.[test]'`, and vLLM in a venv of its own in the background (SMOKE_VLLM=0: no).
#   models `python -m tiffin.tiny` and a random ~0.85B Llama (hidden 2048, 16 layers, 32/8 heads, inter 5632,
#          vocab 32000) via transformers from_config + save_pretrained in bf16 (tokenizer from tiffin.tiny).
#   (a)    greedy parity on the GPU, in parallel: tests/engine/test_engine_parity.py + test_engine.py + test_lora.py on
#          the default (Triton) path; test_engine_parity.py with TIFFIN_KERNEL_BACKEND=torch; the real AWQ/GPTQ
#          checkpoints (test_quant_fixtures.py) with TIFFIN_KERNEL_BACKEND=triton; and gpu_checks.py: the Triton
#          attention / AWQ-GPTQ / LoRA kernels on CUDA tensors against float64 references.
#   (b)    benchmarks/throughput.py on the 1B model at bf16: tiffin, vLLM (default mode: CUDA graphs; and the
#          script's own enforce_eager mode) when installed, transformers continuous batching (moved to the GPU).
#   (c)    benchmarks/attention.py (paged attention decode/prefill vs the torch path and SDPA), d=128 and d=64.
#   (d)    pytest on the kernel test modules without TRITON_INTERPRET (they set it themselves and run on CPU
#          tensors: the GPU analogue is gpu_checks.py), in the background on a few cores, low priority.
#   extra  step_anatomy.py: KV sizing vs gpu_memory_utilization; decode-step time split host/GPU at batch
#          1/32/256 with kernels per step (torch profiler); one 4096-token prefill. gpu_checks.py --what bench:
#          host cost per op, AWQ GEMM vs cuBLAS by M, LoRA Triton vs torch, bf16 parity vs transformers.
# Knobs: OUT, SMOKE_BUDGET_S (525), SMOKE_WORK (${TMPDIR:-/tmp}/tiffin-smoke), SMOKE_PYTHON, SMOKE_FRESH_VENV=1,
#        SMOKE_VLLM=0, SMOKE_7B=1 (also write and load a random 7B), SMOKE_DEVICE=cpu (plumbing test on a CPU box).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
ROOT=$(pwd)
if ! grep -qs '^name = "tiffin"' "$ROOT/pyproject.toml"; then echo "gpu_smoke.sh: run it from the tiffin repo root" >&2; exit 2; fi
OUT=${OUT:-$ROOT/gpu-smoke-out}
WORK=${SMOKE_WORK:-${TMPDIR:-/tmp}/tiffin-smoke}
BUDGET=${SMOKE_BUDGET_S:-525}
DEVICE=${SMOKE_DEVICE:-cuda}
LOG=$WORK/logs
mkdir -p "$OUT" "$LOG" "$WORK/py" "$WORK/models"
rm -f "$LOG"/*.log "$WORK/steps.tsv" "$WORK/pids" "$WORK/vllm.ready" "$OUT"/*.json "$OUT/summary.md" 2>/dev/null
: > "$WORK/steps.tsv"; : > "$WORK/pids"
START=$SECONDS

left() { echo $(( BUDGET - (SECONDS - START) )); }
note() { printf '[%4ds] %s\n' $((SECONDS - START)) "$*" | tee -a "$LOG/smoke.log"; }

# run_step NAME CAP_S CMD...: CMD under a timeout of min(CAP_S, budget left - 20 s), output to $LOG/NAME.log,
# "NAME<TAB>status<TAB>seconds" to steps.tsv; skipped when under 25 s would be left for it.
run_step() {
    local name=$1 cap=$2; shift 2
    local l t s rc status
    l=$(left); t=$(( cap < l - 20 ? cap : l - 20 ))
    if (( t < 25 )); then
        printf '%s\tskipped (budget)\t0\n' "$name" >> "$WORK/steps.tsv"; note "skip $name (budget)"; return 99
    fi
    note "start $name (timeout ${t}s)"
    s=$SECONDS
    if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' _ "$@"; fi   # a shell function: through bash
    timeout -k 10 "$t" "$@" > "$LOG/$name.log" 2>&1 &
    echo $! >> "$WORK/pids"
    wait $!; rc=$?
    status=ok
    if (( rc == 124 || rc == 137 )); then status="TIMEOUT(${t}s)"; elif (( rc != 0 )); then status="FAIL(rc=$rc)"; fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - s))" >> "$WORK/steps.tsv"
    note "end $name: $status after $((SECONDS - s))s"
    return $rc
}
BG=()
bg_step() { run_step "$@" & BG+=($!); }
wait_bg() { local p; for p in "${BG[@]}"; do wait "$p" 2>/dev/null; done; BG=(); }

finish() {
    local p
    for p in $(cat "$WORK/pids" 2>/dev/null); do kill -TERM "$p" 2>/dev/null; done
    [ -n "${PY:-}" ] && "$PY" "$WORK/py/summary.py" "$WORK" "$OUT" 2>>"$LOG/smoke.log" | tail -c 11000
    cp "$WORK/steps.tsv" "$LOG/" 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
    note "done in $((SECONDS - START))s; outputs in $OUT"
}
trap finish EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------------------------------------- scripts ----
cat > "$WORK/py/gpu_checks.py" <<'TIFFIN_SMOKE_PY_EOF'
"""tiffin GPU checks: Triton kernels on CUDA tensors (no interpreter) against float64 references, kernel
microbenchmarks against cuBLAS / the torch path, and host-side launch overhead.

    python gpu_checks.py --json out.json            # on a CUDA machine, from the repo root
    TRITON_INTERPRET=1 python gpu_checks.py --device cpu --quick   # smoke-test this script on CPU
"""
import argparse, json, math, sys, time, traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path("tests/kernels").resolve()))  # reuse the kernel tests' builders and references
import test_kernels_attention as tka  # noqa: E402
import test_kernels_lora as tkl  # noqa: E402
import test_quant_kernels as tkq  # noqa: E402
from tiffin.kernels import AttentionMetadata, paged_attention, write_kv  # noqa: E402
from tiffin.kernels.lora import LoRAMetadata, lora_apply, lora_expand, lora_shrink  # noqa: E402
from tiffin.kernels.quant import awq_dequantize, awq_gemm, gptq_dequantize, gptq_gemm  # noqa: E402

RESULTS = {"correctness": [], "bench": {}, "errors": []}
DEV = None


def to_dev(md: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(md.slot_mapping.to(DEV), md.query_start_loc.to(DEV), md.seq_lens.to(DEV),
                             md.block_tables.to(DEV), md.query_start_loc_cpu, md.seq_lens_cpu, md.max_query_len,
                             md.max_seq_len)


def record(kind, name, err, tol, extra=None):
    ok = bool(err <= tol) and not math.isnan(err)
    RESULTS["correctness"].append(dict(kind=kind, case=name, err=float(err), tol=tol, ok=ok, **(extra or {})))
    print(f"[{'ok ' if ok else 'BAD'}] {kind:9s} {name:55s} err={err:.2e} tol={tol:.0e}", flush=True)


def guarded(fn):
    def run(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # keep going: report every failure
            msg = f"{fn.__name__}{a}: {type(e).__name__}: {str(e)[:400]}"
            RESULTS["errors"].append(msg)
            print("[ERR]", msg, flush=True)
            traceback.print_exc()
    return run


# ---------------------------------------------------------------- attention -----------------------------
@guarded
def attention_case(name, query_lens, context_lens, num_kv_heads, group, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(sum(query_lens) + sum(context_lens) + head_dim)
    q, k, v, md = tka.make_batch(query_lens, context_lens, num_kv_heads * group, num_kv_heads, head_dim,
                                 block_size, dtype, gen)
    scale = head_dim**-0.5
    ref = tka.naive_attention(q, k, v, md, scale)
    qd, kd, vd, mdd = q.to(DEV), k.to(DEV), v.to(DEV), to_dev(md)
    for backend in ("triton", "torch"):
        out = paged_attention(qd, kd, vd, mdd, scale, backend=backend).cpu()
        err = float("nan") if out.isnan().any() else tka.rel_error(out, ref)
        record("attention", f"{backend} {name} {str(dtype)[6:]} d={head_dim} g={group} bs={block_size}", err,
               tka.TOLERANCE[dtype] * (2 if dtype == torch.bfloat16 else 1))


@guarded
def write_kv_case(dtype):
    gen = torch.Generator().manual_seed(1)
    kvh, d, bs, t = 8, 128, 16, 300
    k_cache = torch.randn(40, bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(40, bs, kvh, d, generator=gen).to(dtype)
    qkv = torch.randn(t, 32 * d + 2 * kvh * d, generator=gen).to(dtype)
    _, key, value = qkv.split([32 * d, kvh * d, kvh * d], dim=-1)
    key, value = key.view(t, kvh, d), value.view(t, kvh, d)
    slots = torch.randperm(40 * bs, generator=gen)[:t]
    slots[::7] = -1
    kw, vw = k_cache.clone(), v_cache.clone()
    tka.write_kv_torch(key, value, kw, vw, slots)
    kd, vd = k_cache.clone().to(DEV), v_cache.clone().to(DEV)
    write_kv(key.to(DEV), value.to(DEV), kd, vd, slots.to(DEV), backend="triton")
    same = torch.equal(kd.cpu(), kw) and torch.equal(vd.cpu(), vw)
    record("write_kv", f"triton {str(dtype)[6:]} strided qkv views, -1 slots", 0.0 if same else 1.0, 0.0)


def attention_suite(quick):
    """fp16 gets every shape; bf16 (the serving dtype) the production shapes; fp32 a few (3xTF32 path)."""
    edges = {
        "decode-split": ([1, 1, 1], [5, 300, 47], 2, 4, 128, 16),
        "long-decode": ([1], [300 if quick else 1200], 1, 8, 64, 16),
        "group32": ([1, 1], [9, 33], 1, 32, 64, 16),
        "prefill-multi-tile": ([130, 64], [0, 100], 1, 1, 128, 16),
        "d80": ([20, 1, 33], [40, 70, 0], 2, 2, 80, 16),
        "d16-g3": ([17, 1], [15, 62], 2, 3, 16, 16),
        "llama-8b-decode-64": ([1] * 64, [int(x) for x in np.linspace(10, 2000, 64)], 8, 4, 128, 16),
        "llama-8b-prefill-chunk": ([700, 1, 1, 300], [500, 900, 30, 0], 8, 4, 128, 16),
        "llama-1b-d64-mixed": ([300, 1, 1, 1], [0, 1000, 17, 3000], 8, 4, 64, 16),
        "d256-mixed": ([40, 1, 1], [60, 500, 3], 2, 2, 256, 16),  # fp32 d=256 needs 100 KB smem: > sm_86/89 limit
        "bs32-decode": ([1] * 8, [100, 200, 31, 33, 64, 65, 1, 1000], 8, 4, 128, 32),
        "bs64-qwen2-7b-g7": ([37, 1, 1], [90, 700, 12], 4, 7, 128, 64),
    }
    plan = {
        torch.float16: (tka.SHAPES, list(edges)),
        torch.bfloat16: ([(16, 128, 4), (32, 64, 8)], ["decode-split", "long-decode", "prefill-multi-tile",
                         "llama-8b-decode-64", "llama-8b-prefill-chunk", "llama-1b-d64-mixed", "bs32-decode",
                         "bs64-qwen2-7b-g7", "d256-mixed"]),
        torch.float32: ([(16, 64, 1)], ["decode-split", "d16-g3", "d256-mixed", "llama-8b-prefill-chunk"]),
    }
    if quick:
        plan = {torch.float16: (tka.SHAPES[:2], ["decode-split", "long-decode", "group32", "prefill-multi-tile",
                                                 "d80", "d16-g3"])}
    for dtype, (shapes, names) in plan.items():
        write_kv_case(dtype)
        for bs, d, g in shapes:
            gen = torch.Generator().manual_seed(bs + d + g)
            ql, cl = tka.random_lens(gen, 4)
            attention_case("mixed", ql, cl, 2 if g == 1 else 1, g, d, bs, dtype)
        for name in names:
            ql, cl, kvh, g, d, bs = edges[name]
            attention_case(name, ql, cl, kvh, g, d, bs, dtype)


# ---------------------------------------------------------------- quant ---------------------------------
@guarded
def quant_case(fmt, k, n, group_size, bits, zero_offset, act_order, m, dtype):
    qweight, qzeros, scales = tkq.make_layer(fmt, k, n, group_size, bits, seed=k + n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)).to(torch.int32) if act_order else None
    x, qweight, qzeros, scales = x.to(DEV), qweight.to(DEV), qzeros.to(DEV), scales.to(DEV)
    perm = None if perm is None else perm.to(DEV)
    if fmt == "awq":  # float64 reference on the device (fast on a GPU, exact enough anywhere)
        want = x.double() @ awq_dequantize(qweight, qzeros, scales).double()
        got = awq_gemm(x, qweight, qzeros, scales, backend="triton")
    else:
        xs = x.double() if perm is None else x.double()[:, perm.long()]
        want = xs @ gptq_dequantize(qweight, qzeros, scales, bits, zero_offset).double()
        got = gptq_gemm(x, qweight, qzeros, scales, bits, zero_offset, perm, backend="triton")
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    record("quant", f"{fmt} k={k} n={n} g={group_size} {bits}b z+{zero_offset} perm={act_order} m={m} "
           f"{str(dtype)[6:]}", err, tkq.TOL[dtype] * (2 if dtype == torch.bfloat16 else 1))


def quant_suite(quick):
    if quick:
        for case in tkq.CASES[:3]:
            quant_case(*case, torch.float16)
        return
    for case in tkq.CASES:  # every format variant and tile, fp16 (the tools' dtype)
        quant_case(*case, torch.float16)
    for case in tkq.CASES[:4]:
        quant_case(*case, torch.float32)
    for m in (1, 8, 16, 17, 33, 256, 1000):  # real layer sizes, every M tile, split-K at small M
        for dtype in (torch.float16, torch.bfloat16):
            quant_case("awq", 4096, 4096, 128, 4, 0, False, m, dtype)
        quant_case("gptq", 4096, 1536, 128, 4, 1, m % 2 == 1, m, torch.bfloat16)


# ---------------------------------------------------------------- lora ----------------------------------
@guarded
def lora_case(name, token_slots, hidden, rank, slices, num_slots, dtype):
    x, a, b, y, offsets, _ = tkl.make_case(token_slots, hidden, rank, slices, num_slots, dtype)
    h_ref, y_ref, adapted = tkl.reference(x, a, b, y, offsets, token_slots)
    md = LoRAMetadata.build(np.array(token_slots), DEV, dtype)
    for backend in ("triton", "torch"):
        yd = y.clone().to(DEV)
        lora_apply(x.to(DEV), a.to(DEV), b.to(DEV), yd, offsets, md, backend)
        out = yd.cpu().double()
        err = ((out - y_ref).abs().max() / y_ref.abs().max()).item()
        base_same = torch.equal(yd.cpu()[~adapted], y[~adapted])
        record("lora", f"{backend} {name} {str(dtype)[6:]}", err if base_same else 1.0,
               tkl.TOLERANCE[dtype])


def lora_suite(quick):
    for dtype in ([torch.float16] if quick else [torch.float16, torch.bfloat16, torch.float32]):
        for name, (slots, hidden, rank, slices, num_slots) in tkl.CASES.items():
            lora_case(name, slots, hidden, rank, slices, num_slots, dtype)
        if not quick:
            rng = np.random.default_rng(0)
            decode = rng.integers(-1, 8, 256).tolist()
            lora_case("decode-256tok-8slots-qkv4096", decode, 4096, 16, [4096, 1024, 1024], 8, dtype)
            prefill = [3] * 2000 + rng.integers(-1, 8, 200).tolist()
            lora_case("prefill-2000+200-skewed", prefill, 4096, 16, [4096, 1024, 1024], 8, dtype)


# ---------------------------------------------------------------- benchmarks ----------------------------
def bench(fn, ms=None):
    if DEV.type != "cuda":  # CPU smoke: one timed call
        t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=ms or 40)


@guarded
def bench_quant(quick):
    """AWQ int4 GEMM (group 128) vs dense bf16 cuBLAS on the same shape, and vs dequantize-then-cuBLAS (vLLM's
    AWQ path for >= 256 tokens)."""
    rows = []
    dtype = torch.float16 if DEV.type == "cpu" else torch.bfloat16
    shapes = [(4096, 4096)] if quick else [(4096, 4096), (4096, 14336), (14336, 4096)]
    ms_list = [1, 16] if quick else [1, 4, 16, 32, 64, 256, 1024, 4096]
    for k, n in shapes:
        qweight, qzeros, scales = (t.to(DEV) for t in tkq.make_layer("awq", k if not quick else 256,
                                                                      n if not quick else 256, 128, 4, 0))
        kk, nn_ = qweight.shape[0], scales.shape[1]
        w = awq_dequantize(qweight, qzeros, scales).to(dtype)  # [K, N]
        wt = w.T.contiguous()  # [N, K] as nn.Linear stores it
        for m in ms_list:
            x = torch.randn(m, kk, device=DEV, dtype=dtype)
            t_awq = bench(lambda: awq_gemm(x, qweight, qzeros, scales, backend="triton"))
            t_dense = bench(lambda: torch.nn.functional.linear(x, wt))
            t_deq = bench(lambda: x @ awq_dequantize(qweight, qzeros, scales).to(dtype))
            wbytes = qweight.numel() * 4 + qzeros.numel() * 4 + scales.numel() * 2
            row = dict(k=kk, n=nn_, m=m, awq_ms=t_awq, dense_ms=t_dense, dequant_then_mm_ms=t_deq,
                       awq_tflops=2 * m * kk * nn_ / t_awq / 1e9, dense_tflops=2 * m * kk * nn_ / t_dense / 1e9,
                       awq_weight_gbs=wbytes / t_awq / 1e6)
            rows.append(row)
            print(f"awq K={kk} N={nn_} M={m:5d}: triton {t_awq*1e3:8.1f} us ({row['awq_tflops']:6.1f} TFLOP/s, "
                  f"{row['awq_weight_gbs']:6.0f} GB/s of int4 weights) | dense bf16 {t_dense*1e3:8.1f} us | "
                  f"dequant+mm {t_deq*1e3:8.1f} us | awq/dense {t_awq/t_dense:5.2f}x", flush=True)
    RESULTS["bench"]["awq_gemm"] = rows


@guarded
def bench_lora(quick):
    """Multi-LoRA delta for a qkv layer (hidden 4096, rank 16, 8 adapters): Triton vs the torch path, next to the
    base projection it rides on."""
    rows = []
    dtype = torch.float16 if DEV.type == "cpu" else torch.bfloat16
    hidden = 256 if quick else 4096
    slices = [hidden, hidden // 4, hidden // 4]
    rng = np.random.default_rng(0)
    w = torch.randn(sum(slices), hidden, device=DEV, dtype=dtype) / hidden**0.5
    for label, slots in [("decode 64 tok / 8 adapters", rng.integers(0, 8, 64)),
                         ("decode 256 tok / 8 adapters", rng.integers(0, 8, 256)),
                         ("decode 256 tok / 8 adapters + 50% base", rng.integers(-8, 8, 256).clip(-1)),
                         ("prefill 4096 tok / 1 adapter + 64 decode", np.r_[np.full(4096, 2), rng.integers(0, 8, 64)])]:
        slots = slots[:32] if quick else slots
        x = torch.randn(len(slots), hidden, device=DEV, dtype=dtype)
        a = torch.randn(8, 3 * 16, hidden, device=DEV, dtype=dtype) / hidden**0.5
        b = torch.randn(8, 16, sum(slices), device=DEV, dtype=dtype) * 0.02
        y = torch.nn.functional.linear(x, w)
        offsets = [0, *np.cumsum(slices).tolist()]
        md = LoRAMetadata.build(np.asarray(slots), DEV, dtype)
        t = {bk: bench(lambda bk=bk: lora_apply(x, a, b, y, offsets, md, bk)) for bk in ("triton", "torch")}
        t_base = bench(lambda: torch.nn.functional.linear(x, w))
        t_build = bench(lambda: LoRAMetadata.build(np.asarray(slots), DEV, dtype))
        rows.append(dict(case=label, tokens=len(slots), triton_ms=t["triton"], torch_ms=t["torch"],
                         base_gemm_ms=t_base, metadata_build_ms=t_build))
        print(f"lora {label:42s}: triton {t['triton']*1e3:7.1f} us | torch {t['torch']*1e3:7.1f} us | base qkv GEMM "
              f"{t_base*1e3:7.1f} us | metadata build (host, per step) {t_build*1e3:7.1f} us", flush=True)
    RESULTS["bench"]["lora"] = rows


@guarded
def bench_launch_overhead(quick):
    """Host time per call with the GPU kept busy elsewhere: what one op costs the Python thread (no sync)."""
    if DEV.type != "cuda":
        return
    gen = torch.Generator().manual_seed(0)
    q, k, v, md = tka.make_batch([1] * 32, [500] * 32, 32, 8, 128, 16, torch.bfloat16, gen)
    qd, kd, vd, mdd = q.to(DEV), k.to(DEV), v.to(DEV), to_dev(md)
    x = torch.randn(32, 4096, device=DEV, dtype=torch.bfloat16)
    wt = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)
    qweight, qzeros, scales = (t.to(DEV) for t in tkq.make_layer("awq", 4096, 4096, 128, 4, 0))
    keys = torch.randn(32, 8, 128, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(32, device=DEV, dtype=torch.int64)
    ops = {
        "torch add (baseline eager op)": lambda: x.add(1.0),
        "torch linear 32x4096x4096": lambda: torch.nn.functional.linear(x, wt),
        "tiffin rms_norm (torch, ~7 ops)": lambda: __import__("tiffin.kernels", fromlist=["rms_norm"]).rms_norm(
            x, wt[0], 1e-5),
        "triton paged_attention decode (32 seqs)": lambda: paged_attention(qd, kd, vd, mdd, 0.08, backend="triton"),
        "triton write_kv": lambda: write_kv(keys, keys, kd, vd, slots, backend="triton"),
        "triton awq_gemm m=32": lambda: awq_gemm(x, qweight, qzeros, scales, backend="triton"),
    }
    rows = {}
    for name, fn in ops.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 200  # well under the launch queue's depth: the host never waits on the GPU here
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        rows[name] = host_us
        print(f"host cost per call: {name:42s} {host_us:7.1f} us", flush=True)
    RESULTS["bench"]["host_us_per_call"] = rows


@guarded
def bf16_parity(quick, tiny=None):
    """Informational: tiffin (bf16, Triton) vs transformers (bf16, same device) greedy on the tiny model."""
    from tiffin import LLM, SamplingParams
    from tiffin.tiny import make_tiny_model
    from transformers import AutoModelForCausalLM
    import tempfile
    path = tiny or make_tiny_model(tempfile.mkdtemp(prefix="tiffin-bf16-"), arch="llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 2048, (n,), generator=g).tolist() for n in (3, 17, 40, 90, 150, 260)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
    ref = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEV)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            ref.append(out[0, len(p):].tolist())
    del hf
    llm = LLM(str(path), dtype="bfloat16", device=DEV.type)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(got, ref)]
    RESULTS["bench"]["bf16_parity_matching_prefix_of_32"] = prefix
    print(f"bf16 greedy vs transformers bf16 ({DEV.type}): matching prefix per prompt (of 32) {prefix}", flush=True)


def main():
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--what", choices=["correctness", "bench", "all"], default="all")
    ap.add_argument("--suites", default="attention,quant,lora", help="correctness suites to run")
    ap.add_argument("--tiny", default=None, help="tiny model dir for the bf16 parity check (default: write one)")
    args = ap.parse_args()
    DEV = torch.device(args.device)
    if DEV.type == "cuda":
        p = torch.cuda.get_device_properties(DEV)
        RESULTS["device"] = dict(name=p.name, cc=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                                 total_gib=p.total_memory / 2**30, torch=torch.__version__,
                                 triton=__import__("triton").__version__, cuda=torch.version.cuda)
        print(RESULTS["device"], flush=True)
    t0 = time.time()
    if args.what in ("correctness", "all"):
        for suite in args.suites.split(","):
            {"attention": attention_suite, "quant": quant_suite, "lora": lora_suite}[suite](args.quick)
        RESULTS["correctness_seconds"] = time.time() - t0
    if args.what in ("bench", "all"):
        bench_launch_overhead(args.quick)
        bench_quant(args.quick)
        bench_lora(args.quick)
        bf16_parity(args.quick, args.tiny)
    bad = [r for r in RESULTS["correctness"] if not r["ok"]]
    print(f"\ncorrectness: {len(RESULTS['correctness']) - len(bad)}/{len(RESULTS['correctness'])} ok, "
          f"{len(RESULTS['errors'])} errors", flush=True)
    for r in bad:
        print("  BAD", r["kind"], r["case"], f"err={r['err']:.2e}")
    for e in RESULTS["errors"]:
        print("  ERR", e[:300])
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))
    return 1 if bad or RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
TIFFIN_SMOKE_PY_EOF

cat > "$WORK/py/step_anatomy.py" <<'TIFFIN_SMOKE_PY_EOF'
"""Where a tiffin step's time goes on the GPU, and whether KV sizing respects gpu_memory_utilization.

    python step_anatomy.py MODEL_DIR --json out.json [--util 0.5]

1. KV sizing: an engine built with gpu_memory_utilization=U (max_num_seqs large enough that the KV pool is not
   capped) should leave the process using about U x total memory; reports blocks, bytes, allocator and driver
   views, and what a profile-sized KV allocation cost.
2. Decode steps at batch 1 / 32 / 256 (after the prompts are prefilled): wall time per engine.step(), the host
   time to enqueue the forward, the GPU time of the forward (CUDA events), sampler + prepare time, and the rest
   (scheduler, block manager, detokenizer, outputs). One step is profiled: CUDA kernels launched, summed kernel
   time vs wall time (GPU idle share), top kernels.
3. One 4096-token prefill step: wall, GPU time, achieved TFLOP/s.
"""
import argparse, json, sys, time
from collections import Counter

import torch

from tiffin import SamplingParams
from tiffin.engine.config import EngineConfig
from tiffin.engine.llm_engine import LLMEngine

OUT = {}


def gib(x):
    return round(x / 2**30, 3)


def build(model, util, device, max_model_len, max_num_seqs):
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        free0, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", device=device, max_model_len=max_model_len,
                                 max_num_seqs=max_num_seqs, gpu_memory_utilization=util))
    load_s = time.perf_counter() - t0
    r = eng.model_runner
    kv = r.kv_cache
    info = dict(util=util, load_and_profile_s=round(load_s, 2), num_blocks=r.num_blocks,
                kv_gib=gib(kv.numel() * kv.element_size()), weight_gib=gib(eng.weight_bytes),
                bytes_per_block=r._bytes_per_block(), max_model_len=eng.max_model_len,
                profile_kv_gib_if_max_len=gib(r.max_blocks_per_seq * r._bytes_per_block()))
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        info.update(total_gib=gib(total), free_before_gib=gib(free0), used_by_others_before_gib=gib(total - free0),
                    process_used_after_gib=gib(free0 - free), device_used_after_gib=gib(total - free),
                    device_used_share=round((total - free) / total, 3),
                    torch_allocated_gib=gib(torch.cuda.memory_allocated()),
                    torch_reserved_gib=gib(torch.cuda.memory_reserved()),
                    torch_peak_allocated_gib=gib(torch.cuda.max_memory_allocated()))
    return eng, info


def instrument(eng):
    """Wrap the runner's pieces with host timers and CUDA events."""
    r, rec = eng.model_runner, Counter()
    cuda = r.device.type == "cuda"
    model, prepare, sampler = r.model, r._prepare, r.sampler
    fwd = model.forward
    events = []

    def timed_forward(*a, **k):
        t = time.perf_counter()
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        out = fwd(*a, **k)
        if cuda:
            e.record()
            events.append((s, e))
        rec["forward_enqueue_s"] += time.perf_counter() - t
        return out

    def timed_prepare(sched):
        t = time.perf_counter()
        out = prepare(sched)
        rec["prepare_s"] += time.perf_counter() - t
        rec["tokens"] += int(sum(sched.num_scheduled_tokens))
        rec["max_q"] = max(rec["max_q"], max(sched.num_scheduled_tokens))
        return out

    class TimedSampler:
        def __call__(self, logits, seqs):
            t = time.perf_counter()
            out = sampler(logits, seqs)  # ends with .tolist(): waits for the forward to finish
            rec["sample_and_wait_s"] += time.perf_counter() - t
            return out

    model.forward = timed_forward
    r._prepare = timed_prepare
    r.sampler = TimedSampler()

    def gpu_ms():
        if not cuda:
            return 0.0
        torch.cuda.synchronize()
        ms = sum(s.elapsed_time(e) for s, e in events)
        events.clear()
        return ms
    return rec, gpu_ms


def decode_anatomy(eng, batch, prompt_len, steps, device):
    rec, gpu_ms = instrument(eng)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", [(7 * i + j) % (eng.model_config.vocab_size - 4) + 4 for j in range(prompt_len)],
                        SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True))
    # prefill until every sequence decodes
    for _ in range(10_000):
        rec.clear()
        eng.step()
        if rec["max_q"] == 1 and not eng.scheduler.waiting:
            break
    gpu_ms()
    rec.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0
    g = gpu_ms()
    row = dict(batch=batch, steps=steps, step_ms=1e3 * wall / steps, gpu_forward_ms=g / steps,
               forward_enqueue_ms=1e3 * rec["forward_enqueue_s"] / steps,
               prepare_ms=1e3 * rec["prepare_s"] / steps,
               sample_and_wait_ms=1e3 * rec["sample_and_wait_s"] / steps,
               tokens_per_s=batch * steps / wall)
    row["other_host_ms"] = row["step_ms"] - row["forward_enqueue_ms"] - row["prepare_ms"] - row["sample_and_wait_ms"]
    row["gpu_busy_share_of_step"] = round(row["gpu_forward_ms"] / row["step_ms"], 3) if g else None
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            prof_wall = time.perf_counter() - t
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        dt = lambda e: getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)  # noqa: E731 (us)
        busy = sum(dt(e) for e in kernels) / 1e3  # ms
        names = Counter()
        for e in kernels:
            names[e.name[:70]] += dt(e)
        row.update(profiled_kernels=len(kernels), profiled_kernel_ms=busy, profiled_wall_ms=1e3 * prof_wall,
                   top_kernels_us={k: round(v, 1) for k, v in names.most_common(8)})
    eng.abort_request([f"b{batch}-{i}" for i in range(batch)])
    print(json.dumps(row), flush=True)
    return row


def prefill_anatomy(eng, tokens, device, hidden, inter, layers, vocab, heads, head_dim):
    rec, gpu_ms = instrument(eng)
    eng.add_request("pf", [(j * 13) % (vocab - 4) + 4 for j in range(tokens)],
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    eng.step()
    wall = time.perf_counter() - t
    g = gpu_ms()
    params = layers * (hidden * (heads * head_dim) * 2 + 2 * hidden * (eng.model_config.num_kv_heads * head_dim)
                       + 3 * hidden * inter)
    flops = 2 * params * rec["tokens"] + 2 * layers * rec["tokens"] ** 2 * heads * head_dim  # + causal attention
    row = dict(prefill_tokens=rec["tokens"], wall_ms=1e3 * wall, gpu_forward_ms=g,
               tflops_on_gpu_time=flops / (g * 1e9) if g else None, tflops_on_wall=flops / (wall * 1e12))
    eng.abort_request("pf")
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    ap.add_argument("--util", type=float, default=0.5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    args = ap.parse_args()
    # max_num_seqs 1024 so that KV is sized by memory, not capped by max_num_seqs x max_model_len
    limit = json.load(open(f"{args.model}/config.json")).get("max_position_embeddings", 4096)
    if args.device == "cuda" and limit > 4096:
        # the model's default max_model_len (its full context): the profiling run allocates KV for one such
        # sequence; compare the KV pool with the 4096-token engine below (same utilization)
        try:
            eng, info = build(args.model, args.util, args.device, None, 1024)
            OUT["kv_sizing_default_max_model_len"] = info
            print(json.dumps(info), flush=True)
            del eng
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as e:
            OUT.setdefault("errors", []).append(f"default max_model_len engine: {type(e).__name__}: {e}")
            print("ERR", OUT["errors"][-1], flush=True)
    eng, info = build(args.model, args.util, args.device, min(4096, limit), 1024)
    OUT["kv_sizing"] = info
    print(json.dumps(info), flush=True)
    OUT["decode"] = []
    for b in [int(x) for x in args.batches.split(",")]:
        try:
            OUT["decode"].append(decode_anatomy(eng, b, args.prompt_len, args.steps, args.device))
        except Exception as e:
            OUT.setdefault("errors", []).append(f"decode batch {b}: {type(e).__name__}: {e}")
            print("ERR", OUT["errors"][-1], flush=True)
    mc = eng.model_config
    try:
        OUT["prefill"] = prefill_anatomy(eng, args.prefill_tokens, args.device, mc.hidden_size,
                                         mc.intermediate_size, mc.num_layers, mc.vocab_size, mc.num_heads,
                                         mc.head_dim)
    except Exception as e:
        OUT.setdefault("errors", []).append(f"prefill: {type(e).__name__}: {e}")
        print("ERR", OUT["errors"][-1], flush=True)
    if args.json:
        open(args.json, "w").write(json.dumps(OUT, indent=1))


if __name__ == "__main__":
    main()
TIFFIN_SMOKE_PY_EOF

cat > "$WORK/py/make_1b.py" <<'TIFFIN_SMOKE_PY_EOF'
"""A random ~1B Llama (hidden 2048, 16 layers, 32/8 heads, inter 5632, vocab 32000) in bf16, written with
transformers' from_config + save_pretrained, plus a 32k byte-level BPE tokenizer (tiffin.tiny's, no download).

    python make_1b.py OUT_DIR [--small]   # --small: a toy-sized model, to test this script on CPU
"""
import json, shutil, sys, tempfile, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tiffin.tiny import make_tiny_model

out = Path(sys.argv[1])
small = "--small" in sys.argv
t0 = time.time()
dims = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=5632, vocab_size=32000)
if small:
    dims.update(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=512)
# 128k positions like Llama 3.1: tiffin's default max_model_len then sizes its KV-profiling run (step_anatomy.py)
config = LlamaConfig(**dims, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=3, pad_token_id=0,
                     hidden_act="silu", attention_bias=False, mlp_bias=False)
config.architectures = ["LlamaForCausalLM"]
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
with torch.device(device):  # random init on the GPU: seconds instead of a minute of CPU randn
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except TypeError:  # transformers < 4.56 spelling
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
del model
# tokenizer: tiffin.tiny trains a byte-level BPE of exactly vocab_size tokens on the stdlib's text
with tempfile.TemporaryDirectory() as tmp:
    make_tiny_model(tmp, arch="llama", vocab_size=32000, max_position_embeddings=4096)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(tmp) / name, out / name)
cfg = json.loads((out / "config.json").read_text())
print(f"wrote {out}: {n / 1e9:.2f}B parameters, dtype {cfg.get('dtype') or cfg.get('torch_dtype')}, "
      f"{sum(f.stat().st_size for f in out.glob('*.safetensors')) / 2**30:.2f} GiB, {time.time() - t0:.0f}s")
TIFFIN_SMOKE_PY_EOF

cat > "$WORK/py/tput.py" <<'TIFFIN_SMOKE_PY_EOF'
"""benchmarks/throughput.py with GPU-appropriate peers, without editing it: transformers models are moved to
the GPU (the script loads them on CPU), and with --vllm-graphs vLLM runs in its default mode (torch.compile +
CUDA graphs) instead of the script's enforce_eager=True (a CPU-build setting).

    python tput.py [--vllm-graphs] -- <throughput.py arguments>
"""
import importlib.util, sys

import torch

argv = sys.argv[1:]
graphs = "--vllm-graphs" in argv
argv = [a for a in argv if a not in ("--vllm-graphs", "--")]
spec = importlib.util.spec_from_file_location("throughput", "benchmarks/throughput.py")
tp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tp)
device = "cuda" if torch.cuda.is_available() else "cpu"
_load_hf = tp.load_hf
tp.load_hf = lambda model_dir, dtype: _load_hf(model_dir, dtype).to(device)
if graphs:
    assert "enforce_eager=True" in tp.VLLM_SCRIPT
    tp.VLLM_SCRIPT = tp.VLLM_SCRIPT.replace("enforce_eager=True", "enforce_eager=False")
    tp.VLLM_SCRIPT = tp.VLLM_SCRIPT.replace('"version": vllm.__version__', '"version": vllm.__version__ + " cuda-graphs"')
tp.main(argv)
TIFFIN_SMOKE_PY_EOF

cat > "$WORK/py/summary.py" <<'TIFFIN_SMOKE_PY_EOF'
"""Summarise a gpu_smoke.sh run: steps, pass/fail, the numbers that matter. Writes OUT/summary.md, prints it."""
import json, re, sys
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
logs = work / "logs"
md = ["# tiffin GPU smoke", ""]


def read(name):
    p = logs / name
    return p.read_text(errors="replace") if p.exists() else ""


def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception:
        return None


env = read("env.log").strip()
if env:
    md += ["## Environment", "```", env[-2500:], "```", ""]
md += ["## Steps", "| step | status | seconds |", "|---|---|---|"]
steps = (work / "steps.tsv").read_text().splitlines() if (work / "steps.tsv").exists() else []
for line in steps:
    parts = line.split("\t")
    if len(parts) == 3:
        md.append(f"| {parts[0]} | {parts[1]} | {parts[2]} |")
md.append("")

md += ["## Functional (GPU pytest and kernel checks)"]
for log in sorted(logs.glob("a*_pytest*.log")) + sorted(logs.glob("d_*.log")):
    text = log.read_text(errors="replace")
    tail = [l for l in text.splitlines() if re.search(r"\b(passed|failed|error|errors|skipped)\b.* in [0-9.]+s", l)]
    failed = [l for l in text.splitlines() if l.startswith(("FAILED", "ERROR"))]
    md.append(f"- **{log.stem}**: {tail[-1].strip('= ') if tail else 'no pytest summary line (timeout or crash; see logs)'}")
    md += [f"  - {l[:300]}" for l in failed[:25]]
for name in ("gpu_checks_attention.json", "gpu_checks_quant.json", "gpu_checks_lora.json"):
    res = load(name)
    if res is None:
        md.append(f"- **{name}**: missing (timeout or crash; see logs)")
        continue
    rows = res.get("correctness", [])
    bad = [r for r in rows if not r["ok"]]
    worst = {}
    for r in rows:
        key = (r["kind"], r["case"].split()[0])
        worst[key] = max(worst.get(key, 0.0), r["err"] / max(r["tol"], 1e-30) if r["tol"] else r["err"])
    md.append(f"- **{name}**: {len(rows) - len(bad)}/{len(rows)} within tolerance, {len(res.get('errors', []))} "
              f"exceptions; worst err/tol per (kind, backend): "
              + ", ".join(f"{k[0]}/{k[1]} {v:.2f}" for k, v in sorted(worst.items())))
    md += [f"  - BAD {r['kind']} {r['case']} err={r['err']:.2e} tol={r['tol']:.0e}" for r in bad[:20]]
    md += [f"  - EXC {e[:300]}" for e in res.get("errors", [])[:10]]
md.append("")

md += ["## Throughput (benchmarks/throughput.py, random ~0.85B Llama, bf16)"]
rates = {}
for log in sorted(logs.glob("b*_throughput*.log")):
    text = log.read_text(errors="replace")
    for m in re.finditer(r"^(.+?): (\d+) output tok/s$", text, re.M):
        if not m.group(1).startswith("workload"):
            rates[m.group(1)] = int(m.group(2))
    wl = re.search(r"^workload: .*$", text, re.M)
    if wl:
        rates.setdefault("_workload", wl.group(0))
    if not re.search(r"output tok/s$", text, re.M):
        err = [l for l in text.splitlines() if "Error" in l or "error" in l][-3:]
        md.append(f"- {log.stem}: no result. " + " / ".join(e.strip()[:200] for e in err))
if "_workload" in rates:
    md.append(f"- {rates.pop('_workload')}")
if not any(k.startswith("vllm") for k in rates):
    md.append("- vLLM: not run (no vLLM environment: no package index reachable, SMOKE_VLLM=0, or its install "
              "failed/timed out; see logs/setup_vllm.log)")
base = rates.get("tiffin")
md += ["", "| engine | output tok/s | tiffin / engine |", "|---|---|---|"]
for k, v in rates.items():
    md.append(f"| {k} | {v} | {base / v:.2f} |" if base else f"| {k} | {v} | - |")
md.append("")

an = load("anatomy.json")
if an:
    md += ["## Step anatomy (1B model, bf16, Triton path)", "", f"KV sizing, max_model_len 4096: `{json.dumps(an.get('kv_sizing'))}`", ""]
    if an.get("kv_sizing_default_max_model_len"):
        md += [f"KV sizing, the model's default max_model_len: `{json.dumps(an['kv_sizing_default_max_model_len'])}`", ""]
    md += [
           "columns: wall per engine.step(); GPU time of the model forward (CUDA events); host time to enqueue it; "
           "_prepare (metadata + H2D); sampler incl. waiting for the GPU; the rest (logits enqueue, scheduler, block "
           "manager, detokenizer, outputs); GPU forward / step; CUDA kernels in one profiled step.", "",
           "| batch | step ms | GPU fwd ms | fwd enqueue ms | prepare ms | sample+wait ms | other host ms | GPU busy | "
           "kernels/step | tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in an.get("decode", []):
        md.append(f"| {r['batch']} | {r['step_ms']:.2f} | {r['gpu_forward_ms']:.2f} | {r['forward_enqueue_ms']:.2f} | "
                  f"{r['prepare_ms']:.2f} | {r['sample_and_wait_ms']:.2f} | {r['other_host_ms']:.2f} | "
                  f"{r.get('gpu_busy_share_of_step')} | {r.get('profiled_kernels', '-')} | {r['tokens_per_s']:.0f} |")
    for r in an.get("decode", []):
        if r.get("top_kernels_us"):
            md.append(f"- batch {r['batch']} top kernels (us in one step): {json.dumps(r['top_kernels_us'])}")
    if an.get("prefill"):
        md.append(f"- prefill: `{json.dumps(an['prefill'])}`")
    md += [f"- ERR {e}" for e in an.get("errors", [])]
    md.append("")

for log in sorted(logs.glob("c*_kernels*.log")):
    md += [f"## {log.stem} (benchmarks/attention.py)", "```", log.read_text(errors="replace")[-6000:], "```", ""]

bench = load("gpu_checks_bench.json")
if bench:
    b = bench.get("bench", {})
    md += ["## Microbenchmarks (gpu_checks.py --what bench)"]
    for k, v in (b.get("host_us_per_call") or {}).items():
        md.append(f"- host cost per call, {k}: {v:.1f} us")
    if b.get("awq_gemm"):
        md += ["", "| K | N | M | awq us | dense bf16 us | dequant+mm us | awq/dense | awq TFLOP/s | awq int4 GB/s |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in b["awq_gemm"]:
            md.append(f"| {r['k']} | {r['n']} | {r['m']} | {r['awq_ms']*1e3:.1f} | {r['dense_ms']*1e3:.1f} | "
                      f"{r['dequant_then_mm_ms']*1e3:.1f} | {r['awq_ms']/r['dense_ms']:.2f} | {r['awq_tflops']:.1f} | "
                      f"{r['awq_weight_gbs']:.0f} |")
    if b.get("lora"):
        md += ["", "| LoRA case | triton us | torch us | base qkv GEMM us | host metadata us |", "|---|---|---|---|---|"]
        for r in b["lora"]:
            md.append(f"| {r['case']} | {r['triton_ms']*1e3:.1f} | {r['torch_ms']*1e3:.1f} | {r['base_gemm_ms']*1e3:.1f} | "
                      f"{r['metadata_build_ms']*1e3:.1f} |")
    if "bf16_parity_matching_prefix_of_32" in b:
        md.append(f"- bf16 greedy vs transformers bf16 on the GPU, matching prefix of 32 per prompt: "
                  f"{b['bf16_parity_matching_prefix_of_32']}")
    md += [f"- EXC {e[:300]}" for e in bench.get("errors", [])]
    md.append("")

seven = read("f_7b_load.log")
if seven:
    md += ["## 7B load", "```", seven[-1500:], "```"]
text = "\n".join(md) + "\n"
(out / "summary.md").write_text(text)
print(text)
TIFFIN_SMOKE_PY_EOF

cat > "$WORK/py/load7b.py" <<'TIFFIN_SMOKE_PY_EOF'
"""Opt-in (SMOKE_7B=1): write a random Llama-2-7B-shaped bf16 checkpoint, then time tiffin loading it and read
the host and GPU memory peaks (safetensors streaming should keep host RSS near one tensor)."""
import json, resource, shutil, sys, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

path = Path(sys.argv[1])
tok_src = Path(sys.argv[2])
if not (path / "config.json").exists():
    t = time.time()
    cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_id=3, pad_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("cuda"):
        try:
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        except TypeError:
            m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    m.save_pretrained(path, max_shard_size="5GB")
    del m
    torch.cuda.empty_cache()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tok_src / name, path / name)
    print(f"wrote 7B checkpoint in {time.time() - t:.0f}s", flush=True)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
torch.cuda.reset_peak_memory_stats()
from tiffin import LLM, SamplingParams  # noqa: E402

t = time.time()
llm = LLM(str(path), max_model_len=4096)
load_s = time.time() - t
out = llm.generate([{"prompt_token_ids": list(range(5, 200))}], SamplingParams(temperature=0, max_tokens=16,
                   ignore_eos=True), use_tqdm=False)
print(json.dumps(dict(load_and_profile_s=round(load_s, 1),
                      host_peak_rss_gib_before=round(rss0, 2),
                      host_peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                      gpu_peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      num_kv_blocks=llm.llm_engine.model_runner.num_blocks,
                      generated=len(out[0].outputs[0].token_ids))), flush=True)
TIFFIN_SMOKE_PY_EOF

# ---------------------------------------------------------------------------------------------- python -----
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
cuda_torch() { "$1" -c 'import torch, sys; sys.exit(not (torch.cuda.is_available() and torch.version.cuda))' >/dev/null 2>&1; }
index_reachable() {
    timeout 10 "$1" - >/dev/null 2>&1 <<'EOF'
import os, urllib.request
url = (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple/").rstrip("/") + "/pip/"
urllib.request.urlopen(url, timeout=8)
EOF
}
BASE=""
for c in python3 python3.13 python3.12 python3.11; do
    if command -v "$c" >/dev/null && py_ok "$c"; then BASE=$(command -v "$c"); cuda_torch "$c" && break; fi
done
MODE=""
VLLM_PY=""
{
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cpus: $(nproc)  budget: ${BUDGET}s"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    command -v nvidia-smi >/dev/null && nvidia-smi | grep -o 'CUDA Version: [0-9.]*'
    echo "repo: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
} > "$LOG/env.log" 2>&1

setup_venv() {  # setup_venv SYSTEM_SITE(0/1): venv in $WORK/venv with the project and its test extra
    local p=$WORK/venv/bin/python
    [ -x "$p" ] || "$BASE" -m venv "$WORK/venv" || return 1
    if (( $1 )); then   # the image's packages on the path (a .pth: BASE may itself be a venv), so pip sees its
        # CUDA torch as installed (uv would fetch it again) and installs only what is missing
        "$BASE" -c 'import site, sysconfig; print("\n".join(dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]])))' \
            > "$("$p" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_image_site.pth" || return 1
        "$p" -m pip install -q --upgrade pip >/dev/null 2>&1
        "$p" -m pip install -q -e "${ROOT}[test]" || return 1
    else
        "$p" -m pip install -q uv || return 1
        "$p" -m uv pip install --python "$p" torch || return 1
        if ! cuda_torch "$p"; then   # PyPI's wheel may need a newer driver than this machine has: match the driver
            local v tag; v=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | grep -o '[0-9.]*$')
            case "$v" in 13.*) tag=cu130;; 12.9*|12.8*) tag=cu128;; 12.7*|12.6*) tag=cu126;; 12.*) tag=cu124;; *) tag=cu118;; esac
            echo "torch from PyPI does not see the GPU (driver CUDA $v); trying the $tag index"
            "$p" -m uv pip install --python "$p" --reinstall torch --index-url "https://download.pytorch.org/whl/$tag" || return 1
        fi
        "$p" -m uv pip install --python "$p" -e "${ROOT}[test]" || return 1
    fi
    cuda_torch "$p" || [ "$DEVICE" = cpu ]
}
setup_vllm() {  # vLLM in its own venv (it pins torch and much else)
    local p=$WORK/vllm-venv/bin/python
    [ -x "$p" ] || "$BASE" -m venv "$WORK/vllm-venv" || return 1
    "$p" -m pip install -q uv && "$p" -m uv pip install --python "$p" vllm && "$p" -c 'import vllm; print("vllm", vllm.__version__)' \
        && touch "$WORK/vllm.ready"
}

export ROOT WORK BASE DEVICE
export -f cuda_torch setup_venv setup_vllm
if [ -n "${SMOKE_PYTHON:-}" ]; then
    PY=$SMOKE_PYTHON; MODE="given ($PY)"
elif [ -z "$BASE" ]; then
    note "no python >= 3.11 found"; PY=""; exit 1
elif [ "${SMOKE_FRESH_VENV:-0}" != 1 ] && cuda_torch "$BASE" && ! index_reachable "$BASE"; then
    PY=$BASE; MODE="image python, offline ($PY)"
elif index_reachable "$BASE"; then
    if [ "${SMOKE_FRESH_VENV:-0}" != 1 ] && cuda_torch "$BASE"; then sys_site=1; MODE="venv over the image's torch"; else sys_site=0; MODE="fresh venv"; fi
    if [ "${SMOKE_VLLM:-1}" = 1 ] && [ "$DEVICE" = cuda ]; then
        bg_step setup_vllm 330 setup_vllm; SETUP_VLLM_PID=${BG[-1]}; BG=()   # not waited for by the phases
    fi
    if run_step setup_venv 300 setup_venv "$sys_site"; then PY=$WORK/venv/bin/python
    else note "venv setup failed (see logs/setup_venv.log)"; PY=$BASE; MODE="$MODE FAILED -> $BASE"; fi
else
    PY=$BASE; MODE="$BASE: no CUDA torch and no package index reachable"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the repo's tiffin, whatever is installed
"$PY" - >> "$LOG/env.log" 2>&1 <<'EOF'
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"cc {p.major}.{p.minor}", p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
for m in ("triton", "transformers", "safetensors", "tokenizers", "pytest", "peft", "vllm", "tiffin"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as e:
        print(m, "MISSING", type(e).__name__)
EOF
echo "mode: $MODE" >> "$LOG/env.log"
note "python: $MODE"
if [ "$DEVICE" = cuda ] && ! cuda_torch "$PY"; then note "torch in $PY does not see a CUDA GPU: nothing to test"; exit 1; fi

# ---------------------------------------------------------------------------------------------- run --------
NCPU=$(nproc)
TASKSET=()
if command -v taskset >/dev/null && (( NCPU >= 8 )); then TASKSET=(taskset -c "$((NCPU - 4))-$((NCPU - 1))"); fi
PT=("$PY" -m pytest -q -p no:cacheprovider -rfE)
M1B=$WORK/models/llama-1b
TINY=$WORK/models/tiny
SMALL=()
WL=(--dtype bfloat16 --n 256 --prompt-len 64:512 --output-len 64:256)
CHECKS=("$PY" "$WORK/py/gpu_checks.py")
ANAT=(--batches "1,32,256")
if [ "$DEVICE" = cpu ]; then  # plumbing test: toy sizes, kernels under Triton's interpreter
    export TRITON_INTERPRET=1
    SMALL=(--small); WL=(--dtype bfloat16 --n 4 --prompt-len 8:16 --output-len 4:8)
    CHECKS+=(--device cpu --quick); ANAT=(--device cpu --batches "1,4" --steps 3 --prompt-len 16 --prefill-tokens 200)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# (d) CPU-only kernel tests: background, low priority, on the last cores, until the budget says stop
# (compile_check's own tests are left out: they compile every kernel for sm_80/sm_90 on all cores, minutes)
bg_step d_pytest_kernel_tests_cpu 420 env -u TRITON_INTERPRET nice -n 10 ${TASKSET[@]+"${TASKSET[@]}"} "${PT[@]}" \
    tests/kernels/test_kernels_attention.py tests/kernels/test_quant_kernels.py tests/kernels/test_kernels_lora.py \
    -k "not test_compile_check_every_arch_class"
D_PID=${BG[-1]}; BG=()

# models and (a) in parallel: all functional, none timed
bg_step models_tiny 90 "$PY" -m tiffin.tiny "$TINY"
bg_step models_1b 200 "$PY" "$WORK/py/make_1b.py" "$M1B" ${SMALL[@]+"${SMALL[@]}"}
bg_step a1_pytest_gpu_triton_path 240 "${PT[@]}" tests/engine/test_engine_parity.py tests/engine/test_engine.py
bg_step a5_pytest_gpu_lora_triton_path 240 "${PT[@]}" tests/engine/test_lora.py
bg_step a2_pytest_gpu_torch_backend 200 env TIFFIN_KERNEL_BACKEND=torch "${PT[@]}" tests/engine/test_engine_parity.py
bg_step a3_pytest_gpu_quant_fixtures_triton 200 env TIFFIN_KERNEL_BACKEND=triton "${PT[@]}" tests/engine/test_quant_fixtures.py
for suite in attention quant lora; do
    bg_step "a4_gpu_kernels_$suite" 220 "${CHECKS[@]}" --what correctness --suites "$suite" --json "$OUT/gpu_checks_$suite.json"
done
wait_bg
note "functional phase done"

# benchmarks: one at a time on the GPU
VLLM_READY() { [ -f "$WORK/vllm.ready" ] && VLLM_PY=$WORK/vllm-venv/bin/python; }
if [ -d "$M1B" ]; then
    run_step b1_throughput_tiffin 150 "$PY" "$WORK/py/tput.py" -- "$M1B" --peers tiffin "${WL[@]}"
    run_step b2_step_anatomy 150 "$PY" "$WORK/py/step_anatomy.py" "$M1B" --json "$OUT/anatomy.json" "${ANAT[@]}"
    vllm_done=0
    if VLLM_READY; then
        run_step b3_throughput_vllm_cuda_graphs 200 "$PY" "$WORK/py/tput.py" --vllm-graphs -- "$M1B" --peers vllm \
            --vllm-python "$VLLM_PY" "${WL[@]}"; vllm_done=1
    fi
else
    note "no 1B model: throughput and anatomy skipped"
fi
if [ "$DEVICE" = cuda ]; then
    run_step c1_kernels_bench_d128 150 "$PY" benchmarks/attention.py
fi
if [ -d "$M1B" ]; then
    run_step b4_throughput_hf_cb 150 "$PY" "$WORK/py/tput.py" -- "$M1B" --peers hf-cb "${WL[@]}"
fi
run_step e_kernel_microbench 150 "${CHECKS[@]}" --what bench --tiny "$TINY" --json "$OUT/gpu_checks_bench.json"
if [ -d "$M1B" ] && (( ! ${vllm_done:-0} )); then  # a late vLLM install: wait for it while the budget allows
    while [ -n "${SETUP_VLLM_PID:-}" ] && ! VLLM_READY && kill -0 "$SETUP_VLLM_PID" 2>/dev/null \
            && (( $(left) > 150 )); do sleep 5; done
    if VLLM_READY; then
        run_step b3_throughput_vllm_cuda_graphs 200 "$PY" "$WORK/py/tput.py" --vllm-graphs -- "$M1B" --peers vllm \
            --vllm-python "$VLLM_PY" "${WL[@]}"
    fi
fi
if [ -d "$M1B" ] && VLLM_READY; then
    run_step b5_throughput_vllm_eager 150 "$PY" benchmarks/throughput.py "$M1B" --peers vllm --vllm-python "$VLLM_PY" "${WL[@]}"
fi
if [ "$DEVICE" = cuda ]; then
    run_step c2_kernels_bench_d64 90 "$PY" benchmarks/attention.py --head-dim 64
fi
if [ "${SMOKE_7B:-0}" = 1 ] && [ "$DEVICE" = cuda ]; then
    run_step f_7b_load 240 "$PY" "$WORK/py/load7b.py" "$WORK/models/llama-7b" "$M1B"
fi
wait "$D_PID" 2>/dev/null
exit 0
