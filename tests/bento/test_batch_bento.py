"""The Batch API through `bentoml serve`, killed with SIGKILL twice midway through a batch and started again on the
same batch_dir each time: the batch resumes by itself, its output holds every custom_id exactly once, and the last
server computes exactly the lines that were not recorded before its predecessor's kill (its finished-request
counter), none twice."""

import json
import sqlite3
import time

import psutil
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("bentoml")

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
LINES = 60


def kill_9(server) -> None:
    main = psutil.Process(server.proc.pid)
    for p in [main, *main.children(recursive=True)]:  # a Bento's workers run in process groups of their own
        p.kill()
    server.proc.wait(10)


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_killed_bento_resumes_its_batch_and_runs_no_recorded_line_again(bento_server, tmp_path):
    args = {"model": "tiffin-tiny-llama", "batch_dir": str(tmp_path / "batches"), "batch_max_concurrency": 2}
    server = bento_server(args=args)
    c = client(server)
    body = {"model": "tiffin-tiny-llama", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"line {i}"}}
        for i in range(LINES)
    ]
    file = c.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    recorded = 0
    for kill_after in (5, 25):  # two kills, each once more lines are recorded; a restart after each
        while c.batches.retrieve(batch.id).request_counts.completed < kill_after:
            time.sleep(0.05)
        kill_9(server)
        with sqlite3.connect(tmp_path / "batches" / "batches.sqlite3") as db:
            (now,) = db.execute("select completed from batches where id = ?", (batch.id,)).fetchone()
        assert kill_after <= now < LINES and now >= recorded
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
    assert server.metrics()["tiffin_e2e_request_latency_seconds_count"] == LINES - recorded
