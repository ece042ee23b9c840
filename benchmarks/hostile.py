"""Huge requests against a serving Bento (issue #16): while 8 streams run, a 20 MB body is refused, then, in
other rounds, 8 MB prompts just under the body limit (completion and chat); prints how long each refusal took,
the longest gap between two events of any stream (against the same streams without the huge requests), and the
worker's memory before and after.

    python benchmarks/hostile.py [--rounds 3]

Starts `bentoml serve tiffin.plugin.service:Tiffin` (the built-in tiny model) on a loopback port."""

import argparse
import functools
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from tiffin.testing.servers import BentoServer

STREAM = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}


def worker_rss(server: BentoServer) -> int:
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    workers = [p for p in procs if any("worker" in part for part in p.cmdline())]
    return sum(p.memory_info().rss for p in workers)


def run_streams(server: BentoServer, n: int, during=None) -> tuple[float, list]:
    """Max gap between events over `n` concurrent streams; `during()` runs once every stream has started."""
    gaps, started, results = [], threading.Barrier(n + 1), []

    def stream():
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=STREAM) as r:
                last, first = None, True
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if first:
                        first = False
                        started.wait()

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait()
    if during is not None:
        results = during()
    for t in threads:
        t.join()
    return max(gaps), results


HUGE = {
    "20 MB body": {"prompt": "lorem ipsum " * (20_000_000 // 12)},
    "8 MB prompt": {"prompt": "lorem ipsum " * (8_000_000 // 12)},
    "8 MB chat": {"messages": [{"role": "user", "content": "lorem " * (8_000_000 // 6)}]},
}


def huge_requests(server: BentoServer, names: list[str]) -> list:
    out = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for name in names:
            body = json.dumps(HUGE[name]).encode()
            path = "/v1/chat/completions" if "chat" in name else "/v1/completions"
            started = time.monotonic()
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            out.append((name, r.status_code, time.monotonic() - started))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with BentoServer(Path(tempfile.mkdtemp()), args={"model": "tiffin-tiny-llama", "num_kv_blocks": 512}) as server:
        server.wait("/readyz", 200, timeout=300)
        run_streams(server, 8)  # warm up
        base_rss = worker_rss(server)
        clean_gap, _ = run_streams(server, 8)
        print(f"worker RSS {base_rss / 2**20:.0f} MiB; 8 streams alone: longest gap {clean_gap * 1000:.0f} ms")
        for names in (["20 MB body"], ["8 MB prompt", "8 MB chat"]):
            for i in range(args.rounds):
                gap, refusals = run_streams(server, 8, functools.partial(huge_requests, server, names))
                for name, status, seconds in refusals:
                    print(f"round {i}: {name}: {status} in {seconds * 1000:.0f} ms")
                print(f"round {i}: 8 streams meanwhile: longest gap {gap * 1000:.0f} ms")
            time.sleep(2)
            rss = worker_rss(server)
            print(f"worker RSS after: {rss / 2**20:.0f} MiB ({(rss / base_rss - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
