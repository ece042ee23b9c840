"""Interactive TTFT beside a Batch API batch (issue #52): does a large batch, run at `batch_priority` with
`batch_max_concurrency` lines at once, keep the time to first token of interactive chats within 1.5x of theirs
without it?

In-process (the app and engine of tiffin.plugin.openai, no HTTP server): `--streams` (8) clients each send
`--requests` greedy chats one after the other (`--max-tokens` each), first alone, then while a batch of `--lines`
completions lines (`--batch-tokens` each, ignore_eos) runs; a chat's TTFT is its engine request's first token
time less its arrival (RequestStream timestamps, through the serving's on_finished hook). The batch starts first
and the chats once it runs; it is cancelled when they end. Printed: TTFT p50/p90 alone and beside the batch, the
ratio of p50s, and the batch lines finished meanwhile. Timings only; it checks nothing.

    python benchmarks/batch_ttft.py --model /work/models/smol-Q4_K_M.gguf
    python benchmarks/batch_ttft.py --policy fcfs          # the batch's priority ignored: the bound alone
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from tiffin import AsyncLLMEngine
from tiffin.plugin.openai.app import create_app
from tiffin.plugin.openai.batches import BatchSettings, call_app
from tiffin.plugin.openai.protocol import APIError
from tiffin.plugin.openai.serving import OpenAIServing
from tiffin.tiny import make_tiny_model


async def chats(app, args, ttfts: list) -> None:
    async def client(i: int) -> None:
        for r in range(args.requests):
            messages = [{"role": "user", "content": f"Client {i}, question {r}: tell me about Oslo."}]
            body = {"model": "m", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
            status, _ = await call_app(app, "/chat/completions", json.dumps(body).encode(), f"user-{i}")
            assert status == 200

    ttfts.clear()
    await asyncio.gather(*(client(i) for i in range(args.streams)))


async def main(args) -> None:
    model = args.model or str(make_tiny_model(tempfile.mkdtemp() + "/tiny"))
    engine = AsyncLLMEngine.from_engine_args(model, scheduling_policy=args.policy, max_num_seqs=args.max_num_seqs)
    ttfts: list[float] = []

    def finished(stream, out) -> None:
        if stream.request_id.startswith("chatcmpl") and stream.first_token_time is not None:
            ttfts.append(stream.first_token_time - stream.arrival_time)

    settings = BatchSettings(batch_dir=tempfile.mkdtemp(), batch_max_concurrency=args.concurrency)
    app = create_app(OpenAIServing(engine, "m", on_finished=finished), batches=settings)
    async with app.router.lifespan_context(app):
        await chats(app, args, ttfts)  # warm-up
        await chats(app, args, ttfts)
        alone = list(ttfts)
        lines = [
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "m",
                    "prompt": f"Line {i}: once upon a time",
                    "max_tokens": args.batch_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            for i in range(args.lines)
        ]
        batches = app.state.batch_api
        owner = "batch-user"
        content = b"\n".join(json.dumps(x).encode() for x in lines)
        file = batches.store.put_file(owner, {"id": "file-bench", "purpose": "batch"}, iter([content]))
        create = {"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        status, answer = await call_app(app, "/batches", json.dumps(create).encode(), owner)
        batch = json.loads(answer)
        assert status == 200, batch
        while batches.store.get_batch(owner, batch["id"])["request_counts"]["completed"] < args.concurrency:
            await asyncio.sleep(0.05)
        before = batches.store.get_batch(owner, batch["id"])["request_counts"]["completed"]
        started = time.monotonic()
        await chats(app, args, ttfts)
        took = time.monotonic() - started
        beside = list(ttfts)
        done = batches.store.get_batch(owner, batch["id"])["request_counts"]["completed"] - before
        try:
            await batches.cancel(owner, batch["id"])  # the lines left
        except APIError as e:  # none left: a short --lines may finish while the chats run
            if e.code != "invalid_state":
                raise
    engine.shutdown()

    def q(xs, p):
        return statistics.quantiles(xs, n=10)[p // 10 - 1] * 1000 if len(xs) > 1 else xs[0] * 1000

    print(
        f"policy {args.policy}, batch_max_concurrency {args.concurrency}, max_num_seqs {args.max_num_seqs}, "
        f"{args.streams} chat clients x {args.requests} requests of {args.max_tokens} tokens"
    )
    print(f"TTFT alone:  p50 {q(alone, 50):.1f} ms  p90 {q(alone, 90):.1f} ms  ({len(alone)} chats)")
    print(f"TTFT beside: p50 {q(beside, 50):.1f} ms  p90 {q(beside, 90):.1f} ms  ({len(beside)} chats)")
    print(
        f"ratio p50 beside / alone: {q(beside, 50) / q(alone, 50):.2f} (goal <= 1.5); "
        f"batch lines finished meanwhile: {done} in {took:.1f} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the built-in tiny llama")
    parser.add_argument("--policy", default="priority", choices=("priority", "fcfs"))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
