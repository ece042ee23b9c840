"""Data-parallel routing: multi-turn chats over shared system prompts, at DP=2 and DP=4, per router policy, against
one engine with the replicas' summed KV pool.

`--conversations` chats (default 64) of `--turns` turns (6), each opening with one of `--system-prompts` (8) system
prompts; a turn's prompt is the chat so far (system prompt, earlier user turns and replies) plus a new user turn,
sent as soon as the chat's previous reply finished (every chat in flight at once). Each replica has
`--blocks-per-replica` KV blocks; the single engine has data_parallel_size times that. Reports per run: the prefix
cache's hit rate (prompt tokens found cached / looked up, over every replica), the prompt tokens the router expected
to be found (its map of the replicas' blocks and of the prompts in flight) over those found, mean and p90 time to
first token, wall time, and the busiest replica's tokens (prompt + generated) over the idlest's.

Replicas are processes sharing this machine's cores: hit rates are what routing decides; TTFT and wall time also
measure the cores being shared (on a 2-core machine DP=4 runs four engines on two cores), so compare them only
within one run.

    python benchmarks/dp_router.py [--model DIR]                 # default: the built-in tiny Llama
    python benchmarks/dp_router.py --make-model DIR [--shape llama-40m]
    python benchmarks/dp_router.py --quick                       # 8 chats x 2 turns over 2 system prompts, DP=2
"""

import argparse
import random
import statistics
import tempfile
import time

from common import SHAPES, make_model, markdown_table, random_tokens, vocab_size

from tiffin.engine.config import ROUTER_POLICIES, EngineConfig
from tiffin.engine.data_parallel import make_engine
from tiffin.engine.sampling_params import SamplingParams


def chats(args, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The system prompt of each chat and its user turns."""
    rng = random.Random(args.seed)
    systems = [random_tokens(rng, args.system_len, vocab, low=4) for _ in range(args.system_prompts)]
    opening = [systems[i % len(systems)] for i in range(args.conversations)]
    users = [[random_tokens(rng, args.user_len, vocab, low=4) for _ in range(args.turns)] for _ in opening]
    return opening, users


def drive(engine, opening: list[list[int]], users: list[list[list[int]]], output_len: int) -> dict:
    """Run every chat to its end, each turn sent when the chat's previous reply finished; TTFT of each turn."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    history = [list(system) for system in opening]
    sent, ttft, turn = {}, [], [0] * len(opening)

    def send(chat: int) -> None:
        history[chat] += users[chat][turn[chat]]
        request_id = f"{chat}-{turn[chat]}"
        engine.add_request(request_id, {"prompt_token_ids": list(history[chat])}, params)
        sent[request_id] = time.perf_counter()

    start = time.perf_counter()
    for chat in range(len(opening)):
        send(chat)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in sent and out.outputs[0].token_ids:
                ttft.append(time.perf_counter() - sent.pop(out.request_id))
            if out.finished:
                chat = int(out.request_id.split("-")[0])
                history[chat] += out.outputs[0].token_ids
                turn[chat] += 1
                if turn[chat] < len(users[chat]):
                    send(chat)
    return {"wall": time.perf_counter() - start, "ttft": ttft}


def run(args, dp: int, policy: str | None, opening, users) -> dict:
    """One engine (policy None: a single one with the summed pool) through the workload."""
    blocks = args.blocks_per_replica * (dp if policy is None else 1)
    config = EngineConfig(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=blocks,
        data_parallel_size=1 if policy is None else dp,
        router_policy=policy or "cache_aware",
        router_balance_threshold=args.balance_threshold,
        max_model_len=args.system_len + args.turns * (args.user_len + args.output_len) + 1,
    )
    engine = make_engine(config)
    try:
        result = drive(engine, opening, users, args.output_len)
        stats = engine.stats()
        row = {
            "DP": dp,
            "engine": f"1 engine, {blocks} blocks" if policy is None else f"{policy}, {dp} x {blocks} blocks",
            "hit rate": f"{stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1):.3f}",
        }
        if policy is None:
            row |= {"router expected/found": "-", "busiest/idlest": "-"}
        else:
            router = engine.router
            row["router expected/found"] = f"{sum(router.expected_hits) / max(stats.prefix_cache_hits, 1):.2f}"
            work = [s.prompt_tokens + s.generation_tokens for s in engine.replica_stats]
            row["busiest/idlest"] = f"{max(work) / max(min(work), 1):.2f}"
        ttft = sorted(result["ttft"])
        return row | {
            "mean TTFT ms": f"{1000 * statistics.fmean(ttft):.1f}",
            "p90 TTFT ms": f"{1000 * ttft[int(0.9 * (len(ttft) - 1))]:.1f}",
            "wall s": f"{result['wall']:.1f}",
        }
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: the built-in tiny Llama, written to a temp dir)")
    parser.add_argument("--make-model", metavar="DIR", help="write a random benchmark Llama (--shape) to DIR, use it")
    parser.add_argument("--shape", default="llama-40m", choices=SHAPES, help="the --make-model shape")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dp", default="2,4", help="data_parallel_size values, comma-separated")
    parser.add_argument("--policies", default=",".join(ROUTER_POLICIES))
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-replica", type=int, default=256)
    parser.add_argument("--balance-threshold", type=int, default=8192, help="router_balance_threshold, tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 chats x 2 turns over 2 system prompts, DP=2")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.system_prompts, args.dp = 8, 2, 2, "2"
        args.system_len, args.user_len, args.output_len, args.blocks_per_replica = 64, 8, 4, 32
    if args.make_model:
        args.model = str(make_model(args.make_model, args.shape))
    elif args.model is None:
        from tiffin.tiny import make_tiny_model

        args.model = str(make_tiny_model(tempfile.mkdtemp(prefix="tiffin-tiny-")))
    opening, users = chats(args, vocab_size(args.model))
    print(
        f"{args.conversations} chats x {args.turns} turns over {args.system_prompts} system prompts of "
        f"{args.system_len} tokens, user turns {args.user_len}, replies {args.output_len} tokens, block size "
        f"{args.block_size}, {args.blocks_per_replica} blocks per replica"
    )
    rows = []
    for dp in map(int, args.dp.split(",")):
        for policy in [None, *args.policies.split(",")]:
            rows.append(run(args, dp, policy, opening, users))
            print(rows[-1], flush=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
