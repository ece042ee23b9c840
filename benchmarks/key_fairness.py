"""One key's flood against another key's small request, through a served Bento (issue #50, defect 4): key A opens
`--streams` streaming chats of `n` 64 and 512 tokens each, then key B sends a 4-token chat; prints B's latency
alone and under the flood, what A's requests were answered (200, 429 with their error codes), and whether A may
ask for a more urgent priority than B's.

    python benchmarks/key_fairness.py [--streams 18] [--fair-share false]

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=18)
    parser.add_argument("--model", default="tiffin-tiny-llama")
    parser.add_argument("--fair-share", default="true")
    parser.add_argument("--max-tokens", type=int, default=512, help="each flood sequence's")
    args = parser.parse_args(argv)
    settings = {"model": args.model, "api_key": "key-a,key-b", "fair_share": args.fair_share}
    with tempfile.TemporaryDirectory() as tmp, BentoServer(Path(tmp), args=settings) as server:
        server.wait("/readyz", 200, 300)
        with httpx.Client(base_url=server.url) as http:
            server.model = http.get("/v1/models", headers={"x-api-key": "key-b"}).json()["data"][0]["id"]
        alone = chat(server, "key-b", SMALL)
        urgent = chat(server, "key-a", {**SMALL, "priority": -1})
        flood, long = [], {**FLOOD, "max_tokens": args.max_tokens}
        threads = [
            threading.Thread(target=lambda: flood.append(chat(server, "key-a", long, stream=True)))
            for _ in range(args.streams)
        ]
        for t in threads:
            t.start()
        time.sleep(5)  # the flood queued and running
        under = chat(server, "key-b", SMALL)
        for t in threads:
            t.join()
    print(f"B's 4-token chat alone: {alone[0]} in {alone[2]:.2f} s; under A's flood: {under[0]} in {under[2]:.2f} s")
    print(f"A asking priority -1: {urgent[0]} {urgent[1]}")
    print(f"A's {args.streams} floods (n 64, {args.max_tokens} tokens):", dict(Counter((s, c) for s, c, _ in flood)))


if __name__ == "__main__":
    main()
