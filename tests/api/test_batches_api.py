"""The Batch API through the `openai` client, in-process over a tiny llama ("tiny") and a tiny BERT ("tiny-bert"):
a file of mixed chat, completions, embeddings and responses lines with malformed ones runs to the answers the
same requests get live, each malformed line failing alone; a batch stopped midway and resumed by a new app on the
same batch_dir finishes every line once, none recorded before the stop run again; hostile files, other owners,
cancel and the completion window; `tiffin batch run` offline."""

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from tiffin.plugin.openai import batches as batches_module  # noqa: E402
from tiffin.plugin.openai.batches import BatchSettings  # noqa: E402


@pytest.fixture(scope="module")
def engines(openai_app, tmp_path_factory):
    from tiffin import AsyncLLMEngine
    from tiffin.tiny_bert import make_tiny_bert

    chat = openai_app(num_kv_blocks=128, max_num_seqs=8, scheduling_policy="priority")
    embed = AsyncLLMEngine.from_engine_args(
        str(make_tiny_bert(tmp_path_factory.mktemp("bert") / "embed")), dtype="float32"
    )
    yield chat, embed
    embed.shutdown()


def make_app(engines, batch_dir, **settings):
    from tiffin.plugin.openai.app import create_app
    from tiffin.plugin.openai.pooling import PoolingServing

    chat, embed = engines
    batch = BatchSettings(batch_dir=str(batch_dir), **settings)
    return create_app([chat.serving, PoolingServing(embed, "tiny-bert")], batches=batch)


def client(http, key: str = "key-a") -> "openai.OpenAI":
    return openai.OpenAI(base_url="http://testserver", api_key=key, http_client=http, max_retries=0)


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def finished(c, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := c.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def records(c, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    return {r["custom_id"]: r for r in map(json.loads, c.files.content(file_id).text.splitlines())}


def comparable(body: dict) -> dict:
    """What two answers to one greedy request share: all but ids and times."""
    body = {k: v for k, v in body.items() if k not in ("id", "created", "created_at", "completed_at")}
    if "output" in body:  # a Response: its items' ids too
        body["output"] = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    return body


def submit(c, lines: list, window: str = "24h"):
    file = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window=window)


CHATS = [[{"role": "user", "content": t}] for t in ("Hi there", "Tell me about Oslo", "2+2=")]
PROMPTS = ["Once upon a time", "The capital of", "def main():"]
TEXTS = ["hello world", "a cat on a mat"]


def test_a_mixed_file_answers_as_live_and_malformed_lines_fail_alone(engines, tmp_path):
    lines = [
        line(f"chat-{i}", "/v1/chat/completions", model="tiny", messages=m, max_tokens=6, temperature=0)
        for i, m in enumerate(CHATS)
    ]
    lines += [
        line(f"cmpl-{i}", "/v1/completions", model="tiny", prompt=p, max_tokens=6, temperature=0)
        for i, p in enumerate(PROMPTS)
    ]
    lines += [line(f"emb-{i}", "/v1/embeddings", model="tiny-bert", input=t) for i, t in enumerate(TEXTS)]
    lines += [line("resp-0", "/v1/responses", model="tiny", input="Hi", max_output_tokens=6, temperature=0)]
    bad = {
        "bad-url": line("bad-url", "/v1/nope", model="tiny", prompt="x"),
        "bad-model": line("bad-model", "/v1/completions", model="gpt-4o", prompt="x"),
        "bad-stream": line("bad-stream", "/v1/completions", model="tiny", prompt="x", stream=True),
        "bad-body": line("bad-body", "/v1/completions", model="tiny", prompt="x", max_tokens="many"),
    }
    lines[4:4] = [b'{"custom_id": "torn", "method": "POST"', *bad.values()]
    with TestClient(make_app(engines, tmp_path)) as http:
        c = client(http)
        batch = finished(c, submit(c, lines).id)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": 14, "completed": 9, "failed": 5}
        out, err = records(c, batch.output_file_id), records(c, batch.error_file_id)
        assert set(out) == {f"chat-{i}" for i in range(3)} | {f"cmpl-{i}" for i in range(3)} | {
            "emb-0",
            "emb-1",
            "resp-0",
        }
        assert set(err) == {None, *bad}
        assert err[None]["error"]["code"] == "invalid_json" and err[None]["response"] is None
        assert err["bad-url"]["error"]["code"] == "invalid_url"
        assert err["bad-model"]["error"]["code"] == "model_not_found"
        assert "stream" in err["bad-stream"]["error"]["message"]
        assert err["bad-body"]["error"] is None  # it ran, and the route refused it as it would live
        assert err["bad-body"]["response"]["status_code"] == 400
        assert err["bad-body"]["response"]["body"]["error"]["param"] == "max_tokens"
        sent = {x["custom_id"]: x for x in lines if isinstance(x, dict)}
        for custom_id, got in out.items():  # the same request sent live (without the batch's priority)
            live = http.post(sent[custom_id]["url"].removeprefix("/v1"), json=sent[custom_id]["body"]).json()
            response = got["response"]
            assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
            got, live = comparable(response["body"]), comparable(live)
            if custom_id.startswith("emb"):  # the engine's bound on an embedding batched with others
                pairs = zip(got.pop("data")[0]["embedding"], live.pop("data")[0]["embedding"])
                assert max(abs(a - b) for a, b in pairs) <= 1e-6
            assert got == live
        assert [f.purpose for f in c.files.list()] == ["batch_output", "batch_output", "batch"]


@pytest.fixture
def engine_prompts(engines, monkeypatch):
    """The prompts the chat engine is given, in order (what it computes)."""
    engine, seen = engines[0].engine, []
    add_request = engine.add_request

    async def counted(request_id, prompt, *args, **kwargs):
        seen.append(prompt)
        return await add_request(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", counted)
    return seen


@pytest.fixture
def gate(monkeypatch):
    """`gate(n)`: the first n batch lines go through; the others wait (before reaching the app) until
    `gate.open.set()`."""
    call_app, opened = batches_module.call_app, []

    def arm(n: int) -> None:
        arm.open = asyncio.Event()

        async def gated(*args):
            opened.append(1)
            if len(opened) > n:
                await arm.open.wait()
            return await call_app(*args)

        monkeypatch.setattr(batches_module, "call_app", gated)

    return arm


def prompts(n: int) -> list[str]:
    return [f"line {i}:" for i in range(n)]


def completions(n: int, tokens: int = 4) -> list[dict]:
    return [
        line(f"l{i}", "/v1/completions", model="tiny", prompt=prompt, max_tokens=tokens, temperature=0)
        for i, prompt in enumerate(prompts(n))
    ]


def test_a_stopped_batch_resumes_on_restart_and_runs_each_line_once(engines, tmp_path, engine_prompts, gate):
    """Lines run up to a point, the app stops (its lifespan ends) with two lines waiting, and a new app on the
    same batch_dir finishes the batch: every custom_id once, the engine given each line's prompt once."""
    gate(5)
    with TestClient(make_app(engines, tmp_path, batch_max_concurrency=2)) as http:
        c = client(http)
        batch_id = submit(c, completions(12)).id
        deadline = time.monotonic() + 60
        while c.batches.retrieve(batch_id).request_counts.completed < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # five lines through the gate, not necessarily the first five: two run at a time, started in either order
    assert len(set(engine_prompts)) == len(engine_prompts) == 5 and set(engine_prompts) <= set(prompts(12))
    gate(10**9)
    with TestClient(make_app(engines, tmp_path, batch_max_concurrency=2)) as http:
        c = client(http)
        batch = finished(c, batch_id)
        assert batch.status == "completed" and batch.request_counts.completed == 12, batch
        out = c.files.content(batch.output_file_id).text.splitlines()
    assert sorted(json.loads(r)["custom_id"] for r in out) == sorted(f"l{i}" for i in range(12))
    assert sorted(engine_prompts) == sorted(prompts(12))  # none computed twice


def test_cancel_aborts_running_lines_and_the_window_expires_the_rest(engines, tmp_path, gate):
    gate(0)
    with TestClient(make_app(engines, tmp_path)) as http:
        c = client(http)
        cancelled = submit(c, completions(3)).id
        while c.batches.retrieve(cancelled).status != "in_progress":
            time.sleep(0.02)
        assert c.batches.cancel(cancelled).status in ("cancelling", "cancelled")
        batch = finished(c, cancelled)
        assert batch.status == "cancelled" and batch.cancelled_at and batch.output_file_id is None, batch
        assert batch.request_counts.completed == batch.request_counts.failed == 0
        with pytest.raises(openai.BadRequestError):
            c.batches.cancel(cancelled)
        expired = finished(c, submit(c, completions(3), window="1s").id)
        assert expired.status == "expired" and expired.expired_at, expired
        assert expired.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
        errors = records(c, expired.error_file_id)
        assert sorted(errors) == ["l0", "l1", "l2"]
        assert {r["error"]["code"] for r in errors.values()} == {"batch_expired"}
        gate.open.set()
        live = c.completions.create(model="tiny", prompt="still", max_tokens=2)  # nothing stalled
        assert live.choices[0].finish_reason == "length"
    assert not engines[0].engine.engine.has_unfinished_requests()


def test_a_full_queue_is_no_result_the_line_is_tried_again(engines, tmp_path, monkeypatch):
    call_app, calls = batches_module.call_app, []

    async def busy_first(*args):
        calls.append(1)
        return (429, b'{"error": {"code": "queue_full"}}') if len(calls) <= 2 else await call_app(*args)

    monkeypatch.setattr(batches_module, "call_app", busy_first)
    monkeypatch.setattr(batches_module, "RETRY_AFTER", 0.01)
    with TestClient(make_app(engines, tmp_path, batch_max_concurrency=1)) as http:
        c = client(http)
        batch = finished(c, submit(c, completions(2)).id)
        assert batch.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
        assert len(calls) == 4 and batch.error_file_id is None


def test_hostile_files_are_refused_or_fail_alone(engines, tmp_path, monkeypatch):
    from openai import BadRequestError, NotFoundError

    checked = []  # lines parsed and checked: none of a file with too many lines
    check_line = batches_module.check_line
    monkeypatch.setattr(batches_module, "check_line", lambda *args: checked.append(1) or check_line(*args))

    settings = {"batch_max_file_bytes": 4096, "batch_max_files": 4, "batch_max_lines": 5}
    with TestClient(make_app(engines, tmp_path, **settings)) as http:
        c, other = client(http), client(http, "key-b")
        for size in (5000, 1 << 20):  # the file part over the limit; the body cut off as it arrives
            with pytest.raises(BadRequestError, match="larger than") as e:
                c.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
            assert e.value.body["code"] == "file_too_large"
        with pytest.raises(BadRequestError, match="purpose"):
            c.files.create(file=("a.jsonl", jsonl(completions(1))), purpose="fine-tune")
        duplicate = [*completions(2), completions(1)[0]]
        failed = finished(c, submit(c, duplicate).id)
        assert failed.status == "failed" and failed.errors.data[0].code == "duplicate_custom_id"
        assert failed.errors.data[0].line == 3
        checked.clear()
        six = completions(6)
        too_many = finished(c, submit(c, [*six[:3], b"", *six[3:]]).id)  # a blank line does not count
        assert too_many.status == "failed" and too_many.errors.data[0].code == "too_many_requests"
        assert too_many.errors.data[0].line == 7 and checked == []
        empty = finished(c, submit(c, [b""]).id)
        assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"
        file = c.files.create(file=("a.jsonl", jsonl(completions(2))), purpose="batch")
        with pytest.raises(BadRequestError, match="holds 4 files"):
            c.files.create(file=("a.jsonl", jsonl(completions(1))), purpose="batch")
        with pytest.raises(NotFoundError):  # another key's file and batch do not exist for it
            other.files.retrieve(failed.input_file_id)
        with pytest.raises(NotFoundError):
            other.batches.retrieve(failed.id)
        assert other.files.list().data == [] and other.batches.list().data == []
        with pytest.raises(BadRequestError, match="holds 4 files"):  # a batch would write files too
            c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="1h")
        assert c.files.delete(failed.input_file_id).deleted and c.files.delete(too_many.input_file_id).deleted
        for bad in ({"endpoint": "/v1/nope"}, {"completion_window": "forever"}, {"input_file_id": "file-nope"}):
            args = {"input_file_id": file.id, "endpoint": "/v1/completions", "completion_window": "24h"} | bad
            with pytest.raises(BadRequestError):
                c.batches.create(**args)
        done = finished(
            c, c.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h").id
        )
        assert done.status == "completed" and done.request_counts.completed == 2
        assert [b.id for b in c.batches.list()][0] == done.id


def test_the_batch_api_is_off_without_a_batch_dir(engines):
    from tiffin.plugin.openai.app import create_app

    with TestClient(create_app(engines[0].serving)) as http:
        with pytest.raises(openai.BadRequestError, match="batch_dir"):
            client(http).batches.list()


def test_tiffin_batch_run_answers_offline_as_the_server_does(engines, tiny_model, tmp_path, capsys):
    from tiffin import cli

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl([*completions(3, tokens=5), b"[1]", line("x", "/v1/embeddings", model="tiny", input="a")]))
    args = ["batch", "run", str(source), "-o", str(out), "--model", str(tiny_model("llama"))]
    with pytest.raises(SystemExit, match="2 line"):  # the two bad lines fail alone: exit 1
        cli.main([*args, "--served-model-name", "tiny"])
    got = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["custom_id"] for r in got] == ["l0", "l1", "l2", None, "x"]  # input order
    assert got[3]["error"]["code"] == "invalid_request" and got[4]["error"]["code"] == "invalid_model"
    with TestClient(engines[0].app) as http:
        for r, request in zip(got, completions(3, tokens=5)):
            live = http.post("/completions", json=request["body"]).json()
            assert r["response"]["body"]["choices"] == live["choices"]
    source.write_bytes(jsonl([*completions(2), completions(1)[0]]))
    with pytest.raises(SystemExit, match="used twice"):
        cli.main([*args, "--served-model-name", "tiny"])
