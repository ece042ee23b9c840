"""Mixed traffic against a serving Bento for a long while (issue #31): completions and chats, streamed and not,
tools, structured outputs, two LoRA adapters and clients that leave mid-stream, at a fixed concurrency. After a
warm-up of the same traffic it prints the worker's RSS over time, every failure and connection reset, the longest
gap a bystander stream saw between two events, and the KV blocks still held once the traffic ends.

    python benchmarks/soak.py [--requests 10000] [--warmup 1000] [--concurrency 128] [--fp32-gemm onednn]

Starts `bentoml serve tiffin.plugin.service:Tiffin` on a tiny random Llama (written here, with PEFT adapters for it)
on a loopback port; needs the test extra (peft)."""

import argparse
import asyncio
import itertools
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from common import name_list

from tiffin.testing.servers import BentoServer
from tiffin.tiny import make_tiny_model

ADAPTERS = ("soak-qv", "soak-mlp")
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}},
    {"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 3},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 1}}}},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge its boxing form".split()


def _workers(server: BentoServer) -> list[psutil.Process]:
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    return [p for p in procs if any("worker" in part for part in p.cmdline())]


def worker_rss(server: BentoServer) -> int:
    return sum(p.memory_info().rss for p in _workers(server))


def worker_anonymous(server: BentoServer) -> int:
    """The workers' anonymous resident bytes (heap, arenas, the KV pool): RSS less the mapped files (libraries)."""
    total = 0
    for p in _workers(server):
        rollup = Path(f"/proc/{p.pid}/smaps_rollup").read_text()
        total += sum(int(line.split()[1]) << 10 for line in rollup.splitlines() if line.startswith("Anonymous:"))
    return total


def write_adapters(base: Path, root: Path) -> None:
    """Two adapters of different ranks and targets (PEFT's own files; random weights do not matter here)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for name, targets, rank in zip(ADAPTERS, (["q_proj", "v_proj"], ["gate_proj", "down_proj"]), (8, 4)):
        model = AutoModelForCausalLM.from_pretrained(base)
        get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=targets)).save_pretrained(root / name)


KINDS = ("completion", "chat", "stream", "chat-stream", "tools", "structured", "lora", "leave")


def request(rng: random.Random, kinds: tuple[str, ...] = KINDS) -> tuple[str, str, dict, bool]:
    """(kind, path, body, leave after the first event) of one request drawn from the mix."""
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(1, 48)}
    completion = {"prompt": prompt, "max_tokens": rng.randint(1, 48)}
    kind = rng.choice(kinds)
    if kind == "completion":
        return kind, "/v1/completions", completion, False
    if kind == "chat":
        return kind, "/v1/chat/completions", chat, False
    if kind in ("stream", "leave"):
        return kind, "/v1/completions", {**completion, "stream": True, "max_tokens": 48}, kind == "leave"
    if kind == "chat-stream":
        return kind, "/v1/chat/completions", {**chat, "stream": True}, False
    if kind == "tools":
        return (
            kind,
            "/v1/chat/completions",
            {**chat, "tools": TOOLS, "tool_choice": rng.choice(["auto", "required"])},
            False,
        )
    if kind == "structured":
        schema = {"name": "s", "schema": rng.choice(SCHEMAS)}
        body = {**chat, "max_tokens": 64, "response_format": {"type": "json_schema", "json_schema": schema}}
        return kind, "/v1/chat/completions", body, False
    return kind, "/v1/completions", {**completion, "model": rng.choice(ADAPTERS)}, False


async def send(http: httpx.AsyncClient, path: str, body: dict, leave: bool) -> str | None:
    """None if the request got what it asked for (or left as planned), else what went wrong."""
    try:
        if not body.get("stream"):
            r = await http.post(path, json=body)
            return None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return f"{r.status_code} {(await r.aread())[:200]!r}"
            lines = [line async for line in _until(r.aiter_lines(), leave)]
            return None if leave or lines[-1:] == ["data: [DONE]"] else f"stream ended with {lines[-2:]}"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError, httpx.WriteError) as e:
        return f"reset: {type(e).__name__}: {e}"
    except httpx.TimeoutException as e:
        return f"timeout: {type(e).__name__}"


async def _until(lines, leave: bool):
    async for line in lines:
        if line:
            yield line
            if leave and line.startswith("data: "):
                return


async def traffic(url: str, count: int, concurrency: int, seed: int, failures: list, mix=KINDS) -> dict[str, int]:
    rng, kinds = random.Random(seed), {}
    todo = iter([request(rng, mix) for _ in range(count)])
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:

        async def client():
            for kind, path, body, leave in todo:
                kinds[kind] = kinds.get(kind, 0) + 1
                error = await send(http, path, body, leave)
                if error:
                    failures.append((kind, error))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return kinds


class Bystander(threading.Thread):
    """Streams one request after another, recording the longest gap between two events of a stream."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.longest, self.stop = url, 0.0, threading.Event()

    def run(self) -> None:
        body = {"prompt": "a bystander", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=300) as http:
            while not self.stop.is_set():
                with http.stream("POST", "/v1/completions", json=body) as r:
                    last = None
                    for line in r.iter_lines():
                        now = time.monotonic()
                        if line.startswith("data: ") and last is not None:
                            self.longest = max(self.longest, now - last)
                        last = now if line.startswith("data: ") else last


def kv_blocks_used(server: BentoServer) -> float:
    text = server.http.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tiffin_kv_cache_blocks_used"))


def sample_rss(server: BentoServer, every: float, stop: threading.Event, samples: list) -> None:
    started = time.monotonic()
    while not stop.wait(every):
        samples.append((time.monotonic() - started, worker_rss(server)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", type=name_list(KINDS, "kind"), default=KINDS, help="the mix, comma-separated")
    parser.add_argument(
        "--fp32-gemm",
        choices=("auto", "onednn", "mkl"),
        default="auto",
        help="TIFFIN_CPU_FP32_GEMM for the server (onednn: the path that keeps a kernel per row count)",
    )
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    base, adapters = make_tiny_model(tmp / "model", arch="llama"), tmp / "adapters"
    write_adapters(base, adapters)
    settings = {"model": base, "num_kv_blocks": 1024, "max_num_seqs": args.concurrency, "max_loras": 2}
    settings["embedding_model"] = "none"  # the generation engine's soak
    (tmp / "bento").mkdir()
    with BentoServer(
        tmp / "bento", args=settings, env={"TIFFIN_LORA_ROOTS": str(adapters), "TIFFIN_CPU_FP32_GEMM": args.fp32_gemm}
    ) as server:
        server.wait("/readyz", 200, timeout=300)
        for name in ADAPTERS:
            r = server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters / name)})
            r.raise_for_status()
        fresh = worker_rss(server)
        print(
            f"fresh server, adapters loaded: worker RSS {fresh / 2**20:.0f} MiB "
            f"(anonymous {worker_anonymous(server) / 2**20:.0f} MiB)"
        )
        failures: list = []
        bystander = Bystander(server.url)  # the warm-up is the same traffic as what it measures
        bystander.start()
        asyncio.run(traffic(server.url, args.warmup, args.concurrency, args.seed + 1, failures, args.kinds))
        warm = worker_rss(server)
        print(
            f"after the warm-up ({args.warmup} requests, {len(failures)} failed): worker RSS {warm / 2**20:.0f} MiB "
            f"= {warm / fresh:.3f} x fresh (anonymous {worker_anonymous(server) / 2**20:.0f} MiB)"
        )
        failures.clear()
        bystander.longest, samples, stop = 0.0, [], threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(server, 5, stop, samples), daemon=True)
        sampler.start()
        started = time.monotonic()
        kinds = asyncio.run(traffic(server.url, args.requests, args.concurrency, args.seed, failures, args.kinds))
        elapsed = time.monotonic() - started
        bystander.stop.set(), stop.set()
        bystander.join(), sampler.join()
        after, blocks = worker_rss(server), kv_blocks_used(server)
        for t, rss in samples[:: max(1, len(samples) // 12)]:
            print(f"  t={t:5.0f} s  RSS {rss / 2**20:6.0f} MiB")
        mix = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        print(f"{args.requests} requests at concurrency {args.concurrency} in {elapsed:.0f} s ({mix})")
        resets = sum(error.startswith("reset") for _, error in failures)
        print(f"failures {len(failures)} (connection resets {resets}); longest bystander gap {bystander.longest:.2f} s")
        for kind, error in itertools.islice(failures, 10):
            print(f"  {kind}: {error}")
        ratio = after / warm
        anonymous = worker_anonymous(server) / 2**20
        print(
            f"worker RSS after {after / 2**20:.0f} MiB = {ratio:.3f} x after the warm-up (anonymous {anonymous:.0f} "
            f"MiB); KV blocks used {blocks:g}"
        )


if __name__ == "__main__":
    main()
