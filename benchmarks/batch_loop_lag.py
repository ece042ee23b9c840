"""How long the event loop stalls while the Batch API validates a large file or takes a large upload, in-process
(issue #52: hostile files must not stall anything else). A 1 ms ticker on the loop records its longest gap:
  - alone;
  - while a file of `--hostile-lines` short lines (past batch_max_lines 50,000) is validated on a worker thread, as
    the app does (`BatchAPI._validate`: it fails `too_many_requests`);
  - while a file of 50,000 valid completions lines is validated (each line parsed, checked and stored);
  - while each of those files is parsed as a multipart upload on the loop (Starlette's form parser, as /v1/files).
The router is a stand-in that knows one model; the store is a real BatchStore in a scratch folder. The heap is
frozen first (gc.freeze): a full collection of this small process is not what is measured (the Bento's
collections are its own). CPU timings: compare figures of one run only.

    python benchmarks/batch_loop_lag.py
"""

import argparse
import asyncio
import gc
import json
import tempfile
import time
from types import SimpleNamespace

from embeddings import cpu_name
from starlette.requests import Request

from tiffin.plugin.openai.batch_store import new_id
from tiffin.plugin.openai.batches import BatchAPI, BatchSettings
from tiffin.plugin.openai.protocol import APIError


class Router:
    def route(self, model: str | None, task: str, url: str) -> None:
        if model not in (None, "tiny"):
            raise APIError(404, f"no model {model}", code="model_not_found")


async def longest_gap(work) -> tuple[float, float]:
    """(longest gap of a 1 ms ticker on the loop while `work()` ran, how long it ran), in seconds."""
    stop, gaps = asyncio.Event(), [0.0]

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    await work()
    took = time.perf_counter() - started
    stop.set()
    await task
    return max(gaps), took


def validation(content: bytes):
    api = BatchAPI(SimpleNamespace(state=SimpleNamespace(router=Router())), BatchSettings(batch_dir=tempfile.mkdtemp()))
    file = api.store.put_file(None, {"id": new_id("file"), "purpose": "batch"}, iter([content]))
    batch = {"id": new_id("batch"), "input_file_id": file["id"], "status": "validating"}
    api.store.put_batch(None, batch)

    async def work() -> None:
        status = (await asyncio.to_thread(api._validate, None, batch))["status"]
        assert status in ("failed", "in_progress"), status

    return work


def upload(content: bytes):
    head = b'--B\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    body = head + content + b"\r\n--B--\r\n"
    chunks = [body[i : i + (1 << 16)] for i in range(0, len(body), 1 << 16)]  # what uvicorn hands over at most

    async def work() -> None:
        left = iter(chunks)

        async def receive() -> dict:
            await asyncio.sleep(0)
            chunk = next(left, None)
            return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

        headers = [(b"content-type", b"multipart/form-data; boundary=B")]
        form = await Request({"type": "http", "method": "POST", "headers": headers}, receive).form(max_files=1)
        await form.close()

    return work


async def main(args) -> None:
    gc.freeze()
    short = b"".join(b'{"custom_id": "h%d"}\n' % i for i in range(args.hostile_lines))
    line = {"method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "hello " * 20}}
    valid = b"".join(json.dumps({"custom_id": f"c{i}", **line}).encode() + b"\n" for i in range(50_000))
    print(f"CPU: {cpu_name()}")

    async def idle() -> None:
        await asyncio.sleep(1)

    cases = [("alone, 1 s", idle)]
    for name, content in ((f"{args.hostile_lines:,} short lines", short), ("50,000 valid lines", valid)):
        cases += [
            (f"validate {name}", validation(content)),
            (f"upload {name} ({len(content) / 1e6:.0f} MB)", upload(content)),
        ]
    for name, work in cases:
        gap, took = await longest_gap(work)
        print(f"{name}: longest loop gap {gap * 1000:.1f} ms, took {took:.2f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hostile-lines", type=int, default=1_000_000)
    asyncio.run(main(ap.parse_args()))
