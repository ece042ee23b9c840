"""The Batch API through `bentoml serve`, killed with SIGKILL midway through a batch and started again on the same
batch_dir: the batch resumes by itself, its output holds every custom_id exactly once, and the restarted server
computes exactly the lines that were not recorded before the kill (its finished-request counter), none twice."""

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


def test_a_killed_bento_resumes_its_batch_and_runs_no_recorded_line_again(bento_server, tmp_path):
    args = {"model": "tiffin-tiny-llama", "batch_dir": str(tmp_path / "batches"), "batch_max_concurrency": 2}
    first = bento_server(args=args)
    c = openai.OpenAI(base_url=f"{first.url}/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"model": "tiffin-tiny-llama", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"line {i}"}}
        for i in range(LINES)
    ]
    file = c.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    while c.batches.retrieve(batch.id).request_counts.completed < 5:
        time.sleep(0.05)
    kill_9(first)
    with sqlite3.connect(tmp_path / "batches" / "batches.sqlite3") as db:
        (recorded,) = db.execute("select completed from batches where id = ?", (batch.id,)).fetchone()
    assert 5 <= recorded < LINES

    second = bento_server(args=args)
    c = openai.OpenAI(base_url=f"{second.url}/v1", api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + 300
    while (done := c.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and done.status == "in_progress", done
        time.sleep(0.2)
    assert done.request_counts.model_dump() == {"total": LINES, "completed": LINES, "failed": 0}
    out = [json.loads(r) for r in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"l{i}" for i in range(LINES))
    assert {len(r["response"]["body"]["choices"][0]["text"]) > 0 for r in out} == {True}
    assert second.metrics()["tiffin_e2e_request_latency_seconds_count"] == LINES - recorded  # none twice
