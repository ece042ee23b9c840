"""The Batch API through `bentoml serve`, killed with SIGKILL at three seeded random points of a batch and started
again on the same batch_dir each time: the batch resumes by itself, its output holds every custom_id exactly once,
no recorded line is computed again: the last server computes exactly the lines not recorded before it started,
and each killed one at most `batch_max_concurrency` lines more than it recorded (lines it finished in the moment
between the engine and the disk, run again after the restart like those still running at the kill). What a server
computed is its engine's finished-request counter, read from its Prometheus files after the kill."""

import itertools
import json
import random
import sqlite3
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("bentoml")

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
LINES, CONCURRENCY, KILLS, SEED = 60, 2, 3, 52
FINISHED = "tiffin_e2e_request_latency_seconds_count"


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_bento_killed_three_times_resumes_its_batch_and_computes_no_recorded_line_again(bento_server, tmp_path):
    args = {"model": "tiffin-tiny-llama", "batch_dir": str(tmp_path / "batches"), "batch_max_concurrency": CONCURRENCY}
    server = bento_server(args=args)
    c = client(server)
    body = {"model": "tiffin-tiny-llama", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"line {i}"}}
        for i in range(LINES)
    ]
    file = c.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    recorded, lost = 0, []
    for kill_after in sorted(random.Random(SEED).sample(range(1, LINES - 8), KILLS)):  # lines recorded, then a kill
        while c.batches.retrieve(batch.id).request_counts.completed < kill_after:
            time.sleep(0.05)
        server.kill()
        with sqlite3.connect(tmp_path / "batches" / "batches.sqlite3") as db:
            (now,) = db.execute("select completed from batches where id = ?", (batch.id,)).fetchone()
        assert kill_after <= now < LINES
        # finished by this server's engine but not recorded: in flight at the kill (never a line recorded before)
        lost.append(server.stored_metrics()[FINISHED] - (now - recorded))
        assert 0 <= lost[-1] <= CONCURRENCY, lost
        recorded = now
        server = bento_server(args=args)
        c = client(server)
    deadline = time.monotonic() + 300
    while (done := c.batches.retrieve(batch.id)).status in ("in_progress", "finalizing"):
        assert time.monotonic() < deadline, done
        time.sleep(0.2)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": LINES, "completed": LINES, "failed": 0}
    out = [json.loads(r) for r in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"l{i}" for i in range(LINES))
    assert {len(r["response"]["body"]["choices"][0]["text"]) > 0 for r in out} == {True}
    # the last server computed exactly the lines not recorded at the last kill: none of those again
    assert server.metrics()[FINISHED] == LINES - recorded
    print(f"lines finished by each killed server's engine but not recorded, so computed again: {lost}")


def stream(server, max_tokens: int = 300) -> str:
    """A streamed greedy completion, all its tokens: its text."""
    body = {"model": "tiffin-tiny-llama", "prompt": "The bystander", "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_hostile_batch_files_are_refused_or_fail_alone_leaving_no_bytes_behind(bento_server, tmp_path):
    """A 100 MB upload past the limit (declared, and chunked without a length), a file of a million lines, a file
    of malformed lines and one of a duplicate custom_id, through the Bento while a bystander streams: each refused
    with a 413 or failed with its code, the bystander's text what it is alone, and nothing of the refused uploads or
    failed batches left in batch_dir, in SQLite or in the server's TMPDIR."""
    batch_dir, spool = tmp_path / "batches", tmp_path / "spool"
    spool.mkdir()
    args = {"model": "tiffin-tiny-llama", "batch_dir": str(batch_dir), "batch_max_file_bytes": 32 << 20}
    server = bento_server(args=args, env={"TMPDIR": str(spool)})
    c = client(server)
    alone, spooled = stream(server), set(spool.rglob("*"))
    bystanders: list[str] = []
    hostile_done = threading.Event()

    def bystander() -> None:
        while not hostile_done.is_set():
            bystanders.append(stream(server))

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        big = b"x" * (100 << 20)
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", big), purpose="batch")
        assert e.value.status_code == 413
        head = b'--B\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        parts = itertools.chain([head], (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)))
        headers = {"content-type": "multipart/form-data; boundary=B"}  # and no Content-Length: counted as it comes
        chunked = server.http.post("/v1/files", content=parts, headers=headers)
        assert chunked.status_code == 413 and "larger than" in chunked.text, chunked.text
        million = b"".join(b'{"custom_id": "h%d"}\n' % i for i in range(1_000_000))  # 23 MB
        line = {"method": "POST", "url": "/v1/completions", "body": {"model": "tiffin-tiny-llama", "prompt": "x"}}
        bad = [b"{not json", {**line, "url": "/v1/nope"}, {**line, "body": {"model": "gpt-4o", "prompt": "x"}}]
        bad = [
            x if isinstance(x, bytes) else json.dumps(x | {"custom_id": f"b{i}"}).encode() for i, x in enumerate(bad)
        ]
        files = {
            "too_many_requests": million,
            "duplicate_custom_id": b"\n".join(json.dumps(line | {"custom_id": "d"}).encode() for _ in range(2)),
            None: b"\n".join([*bad, json.dumps(line | {"custom_id": "good"}).encode()]),
        }
        for code, content in files.items():
            file = c.files.create(file=("hostile.jsonl", content), purpose="batch")
            batch = c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="1h")
            while (batch := c.batches.retrieve(batch.id)).status in ("validating", "in_progress", "finalizing"):
                time.sleep(0.1)
            if code is None:  # each malformed line fails alone
                assert batch.status == "completed" and batch.request_counts.model_dump() == {
                    "total": 4,
                    "completed": 1,
                    "failed": 3,
                }
                errors = [
                    json.loads(x)["error"]["code"] for x in c.files.content(batch.error_file_id).text.splitlines()
                ]
                assert errors == ["invalid_json", "invalid_url", "model_not_found"]
            else:
                assert batch.status == "failed" and batch.errors.data[0].code == code, batch
            c.files.delete(file.id)
    finally:
        hostile_done.set()
        thread.join()
    assert bystanders and set(bystanders) == {alone}
    with sqlite3.connect(batch_dir / "batches.sqlite3") as db:
        assert db.execute("select count(*) from lines").fetchone() == (0,)  # failed batches stored none
    kept = sorted(p.name for p in (batch_dir / "files").iterdir())  # the last batch's output and error files
    assert kept == sorted([batch.output_file_id, batch.error_file_id])
    assert set(spool.rglob("*")) == spooled
