"""Prefix caching: 32 requests sharing a 1,000-token system prompt, each with its own 50-token question.

Runs the same workload with `enable_prefix_caching` on and off in one process and reports peak KV blocks in
use and mean time to first token (all requests arrive at once).

    python benchmarks/prefix.py --model DIR [--dtype bfloat16]
    python benchmarks/prefix.py --make-model DIR [--shape llama-40m]   # a benchmark model (common.SHAPES)
"""

import argparse
import time

from common import SHAPES, make_model, markdown_table, shared_prefix_prompts, vocab_size

from tiffin import LLM, SamplingParams


def run(model: str, dtype: str, prompts: list[list[int]], output_len: int, caching: bool) -> dict:
    llm = LLM(model, dtype=dtype, enable_prefix_caching=caching, max_model_len=len(prompts[0]) + output_len)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:64]}, params, use_tqdm=False)  # warm-up, shares nothing
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    first_token, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
        peak = max(peak, engine.stats().kv_blocks_used)
    wall = time.perf_counter() - start
    stats = engine.stats()
    return {
        "caching": "on" if caching else "off",
        "peak_blocks": peak,
        "mean_ttft_s": sum(first_token.values()) / len(first_token),
        "wall_s": wall,
        "hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--make-model", metavar="DIR", help="write a random benchmark Llama (--shape) to DIR, use it")
    parser.add_argument("--shape", default="llama-40m", choices=SHAPES, help="the --make-model shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(args.make_model, args.shape)
        args.model = args.model or args.make_model
    if not args.model:
        parser.error("--model or --make-model is required")
    prompts = shared_prefix_prompts(args.n, args.system_len, args.question_len, vocab_size(args.model), args.seed)
    off, on = (run(args.model, args.dtype, prompts, args.output_len, c) for c in (False, True))
    print(
        f"{args.n} requests, {args.system_len}-token shared prefix + {args.question_len}-token questions, "
        f"{args.output_len} output tokens, {args.dtype}\n"
    )
    rows = [
        {
            "prefix caching": r["caching"],
            "peak KV blocks": r["peak_blocks"],
            "mean TTFT s": f"{r['mean_ttft_s']:.3f}",
            "wall s": f"{r['wall_s']:.2f}",
            "cache hit rate": f"{r['hit_rate']:.1%}",
        }
        for r in (off, on)
    ]
    print(markdown_table(rows))
    print(
        f"\npeak blocks on/off = {on['peak_blocks'] / off['peak_blocks']:.2f}x; "
        f"mean TTFT off/on = {off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x lower with caching"
    )


if __name__ == "__main__":
    main()
