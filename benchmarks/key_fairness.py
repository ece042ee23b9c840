"""One key's flood against another key's small request, through a served Bento (issue #50, defect 4): key A opens
`--streams` streaming chats of `n` 64 and 512 tokens each, then key B sends `--b-chats` chats at once, of
`--b-max-tokens` 4 each, with one system prompt (a cache-aware router keeps them together unless fairness spreads
them); prints B's latency alone and under the flood, what A's requests were answered (200, 429 with their error
codes), and whether A may ask for a more urgent priority than B's. `--data-parallel-size 2`: the same over two
engine replicas behind the router.

    python benchmarks/key_fairness.py [--streams 18] [--fair-share false] [--data-parallel-size 2 --max-num-seqs 8]

Starts `bentoml serve tiffin.plugin.service:Tiffin` (the built-in tiny model unless --model) with two user keys."""

import argparse
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tiffin.testing.servers import BentoServer

FLOOD = {"messages": [{"role": "user", "content": "Tell me a long story."}], "n": 64, "max_tokens": 512}
SMALL = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 8}


def chat(server: BentoServer, key: str, body: dict, stream: bool = False) -> tuple[int, str, float]:
    """Status, error code (or the parameter at fault) and seconds to the whole answer."""
    start = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=server.url, timeout=900) as http:
        body = {"model": server.model, **body, "stream": stream, "ignore_eos": True}
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            text = r.read().decode()
    error = json.loads(text)["error"] if r.status_code != 200 else {}
    code = error.get("code") or (f"param {error['param']}" if error.get("param") else "")
    return r.status_code, code, time.monotonic() - start


def b_chat(i: int, max_tokens: int) -> dict:
    """B's chat `i`: the shared system prompt, its own question."""
    return {**SMALL, "messages": [SYSTEM, {"role": "user", "content": f"Hi, question {i}"}], "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=18)
    parser.add_argument("--model", default="tiffin-tiny-llama")
    parser.add_argument("--fair-share", default="true")
    parser.add_argument("--max-tokens", type=int, default=512, help="each flood sequence's")
    parser.add_argument("--b-chats", type=int, default=1, help="B's chats sent at once under the flood")
    parser.add_argument("--b-max-tokens", type=int, default=4, help="each of B's chats'")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, help="seats per replica (default: the Bento's)")
    args = parser.parse_args(argv)
    settings = {"model": args.model, "api_key": "key-a,key-b", "fair_share": args.fair_share}
    settings |= {"data_parallel_size": args.data_parallel_size}
    settings |= {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    with tempfile.TemporaryDirectory() as tmp, BentoServer(Path(tmp), args=settings) as server:
        server.wait("/readyz", 200, 300)
        with httpx.Client(base_url=server.url) as http:
            server.model = http.get("/v1/models", headers={"x-api-key": "key-b"}).json()["data"][0]["id"]
        alone = chat(server, "key-b", b_chat(-1, args.b_max_tokens))
        urgent = chat(server, "key-a", {**SMALL, "priority": -1})
        flood, long = [], {**FLOOD, "max_tokens": args.max_tokens}
        threads = [
            threading.Thread(target=lambda: flood.append(chat(server, "key-a", long, stream=True)))
            for _ in range(args.streams)
        ]
        for t in threads:
            t.start()
        time.sleep(5)  # the flood queued and running
        under = []
        b_chats = [
            threading.Thread(target=lambda i=i: under.append(chat(server, "key-b", b_chat(i, args.b_max_tokens))))
            for i in range(args.b_chats)
        ]
        for t in b_chats:
            t.start()
        for t in b_chats + threads:
            t.join()
    seconds = sorted(s for _, _, s in under)
    statuses = " ".join(str(status) for status, _, _ in under)
    print(f"B's {args.b_max_tokens}-token chat alone: {alone[0]} in {alone[2]:.2f} s; ", end="")
    print(f"under A's flood: {statuses} ({args.b_chats} at once) in {sum(seconds) / len(seconds):.2f} s mean, ", end="")
    print(f"{seconds[-1]:.2f} s max")
    print(f"A asking priority -1: {urgent[0]} {urgent[1]}")
    print(f"A's {args.streams} floods (n 64, {args.max_tokens} tokens):", dict(Counter((s, c) for s, c, _ in flood)))


if __name__ == "__main__":
    main()
