"""OpenAI's Batch API: /batches (create, retrieve, list, cancel) over JSONL files uploaded to /files, each line run
through the app's own routes, stored durably line by line (tiffin.plugin.openai.batch_store).

Invariants:
- A batch goes validating -> in_progress -> finalizing -> completed, or to failed (validation refused the file),
  expired (its `completion_window` ran out: the lines not yet run are failed with `batch_expired`) or
  cancelling -> cancelled (the lines running are aborted; finished ones are kept).
- Validation reads every line before any runs. A line that is not a JSON object with a string `custom_id`, POST,
  a supported `url` and a `body` naming a served model (or none) that does not stream fails alone,
  with an error record in the error file; a `custom_id` seen twice, more than `batch_max_lines` lines or no line
  fail the batch.
- A line runs as the same request sent live would: an in-process call of this app's route, as the batch's owner
  (fair share, the Responses store), its generation at `batch_priority` (below interactive traffic under the
  priority scheduling policy), at most `batch_max_concurrency` lines at once across all batches. A 429 or 503
  answer (a full queue, a stopping engine) is no result: the line is tried again a second later.
- A line's result is committed to disk before it counts as done, and a line with a result never runs again: a
  server killed and restarted resumes every unfinished batch (from the app's lifespan) with the lines left.
- The output file holds the lines answered 200, the error file the others, both in input order, in OpenAI's
  shape: {id, custom_id, response: {status_code, request_id, body}, error} or {..., response: null, error}.
- A line may name any of the supported urls, whatever the batch's `endpoint` (which OpenAI requires all to
  match): one file may mix chat, completions, embeddings and responses, as vLLM's run-batch allows."""

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError

from tiffin.plugin.openai.batch_store import BatchStore, error_record, new_id, nth_line, paced
from tiffin.plugin.openai.clients import CLIENT_STATE, client_of
from tiffin.plugin.openai.encoding import dumps
from tiffin.plugin.openai.files import check_quota, file_object, file_routes, page
from tiffin.plugin.openai.protocol import APIError

if TYPE_CHECKING:
    from tiffin.plugin.openai.routing import ModelRouter

logger = logging.getLogger("tiffin.batches")
ENDPOINTS = {  # a batch line's url -> what its model must do
    "/v1/chat/completions": "generate",
    "/v1/completions": "generate",
    "/v1/embeddings": "embed",
    "/v1/responses": "generate",
}
WINDOW = re.compile(r"(\d+)([smhd])")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
RETRY_STATUSES = (429, 503)
RETRY_AFTER = 1.0  # seconds


class BatchSettings(BaseModel):
    batch_dir: str | None = Field(
        None,
        description="directory of the Batch API's files, batches and finished lines (SQLite and files; one server "
        "per directory); None: /v1/files and /v1/batches are off",
    )
    batch_priority: int = Field(
        10, description="priority of batch lines' generations (scheduling_policy priority: lower first; live: 0)"
    )
    batch_max_concurrency: int = Field(8, ge=1, description="batch lines running at once, across all batches")
    batch_max_file_bytes: int = Field(200 << 20, ge=1, description="bytes of one uploaded file (more: 400)")
    batch_max_files: int = Field(100, ge=1, description="uploaded files one API key may hold (more: 400)")
    batch_max_lines: int = Field(50_000, ge=1, description="lines of one batch (more: the batch fails validation)")


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchAPI:
    """The batches of one app: their store, and the tasks that drive them."""

    def __init__(self, app: FastAPI, settings: BatchSettings) -> None:
        self.app, self.settings = app, settings
        self._store: BatchStore | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancelling: set[str] = set()  # batches whose task is cancelled to cancel the batch, not to stop
        self._slots: asyncio.Semaphore | None = None

    @property
    def store(self) -> BatchStore:
        """Opened at first use, not with the app: `bentoml build`, and BentoML's parent process, import the Bento's
        app too, and must not take the directory's lock."""
        if self._store is None:
            self._store = BatchStore(self.settings.batch_dir)
        return self._store

    def start(self, owner: str | None, batch_id: str) -> None:
        if batch_id not in self.tasks:
            self.tasks[batch_id] = asyncio.create_task(self._drive(owner, batch_id))
            self.tasks[batch_id].add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    async def resume(self) -> None:
        """Start every batch the store holds unfinished: what a restarted server picks up."""
        for owner, batch in await asyncio.to_thread(self.store.unfinished):
            self.start(owner, batch["id"])

    async def stop(self) -> None:
        """Stop every batch's task, leaving each where it is (a restart resumes it), and close the store."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._slots = None  # of this event loop
        if self._store is not None:
            self._store.close()
            self._store = None

    async def cancel(self, owner: str | None, batch_id: str) -> dict:
        batch = await asyncio.to_thread(self.store.get_batch, owner, batch_id)
        if batch is None:
            raise _not_found(batch_id)
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            raise APIError(400, f"batch {batch_id} is {batch['status']}: it cannot be cancelled", code="invalid_state")
        batch = await asyncio.to_thread(
            self.store.update_batch, batch_id, status="cancelling", expect=("validating", "in_progress")
        )
        self.cancelling.add(batch_id)
        task = self.tasks.get(batch_id)
        if task is not None:
            task.cancel()
        else:
            self.start(owner, batch_id)
        return batch

    async def _drive(self, owner: str | None, batch_id: str) -> None:
        try:
            try:
                while self.app.state.router is None:  # the servings are still loading
                    await asyncio.sleep(0.2)
                batch = await asyncio.to_thread(self.store.get_batch, owner, batch_id)
                if batch["status"] == "validating":
                    batch = await asyncio.to_thread(self._validate, owner, batch)
                if batch["status"] == "in_progress":
                    await self._run(owner, batch)
            except asyncio.CancelledError:
                if batch_id not in self.cancelling:
                    raise
            self.cancelling.discard(batch_id)
            await asyncio.to_thread(self._finalize, owner, batch_id)
        except Exception:
            logger.exception("tiffin: batch %s stopped; a restart resumes it", batch_id)

    def _validate(self, owner: str | None, batch: dict) -> dict:
        """Count the lines, then read and check each (on a worker thread, paced); the batch in_progress, or failed
        with the reason."""
        file = self.store.get_file(owner, batch["input_file_id"])
        if file is None:
            return self._fail(batch, "invalid_file", f"the input file {batch['input_file_id']} was deleted")
        path, limit = self.store.path(file["id"]), self.settings.batch_max_lines
        if (number := nth_line(path, limit + 1)) is not None:
            return self._fail(batch, "too_many_requests", f"a batch holds at most {limit} lines", number)
        lines, seen = [], set()
        with open(path, "rb") as f:
            for number, text in paced(enumerate(f, 1)):
                if not text.strip():
                    continue
                custom_id, url, body, error = check_line(text, self.app.state.router, self.settings.batch_priority)
                if custom_id in seen:
                    return self._fail(batch, "duplicate_custom_id", f"custom_id {custom_id!r} is used twice", number)
                if custom_id is not None:
                    seen.add(custom_id)
                record = None if error is None else dumps(error_record(custom_id, error)).decode()
                lines.append((len(lines), custom_id, url, body, record))
        if not lines:
            return self._fail(batch, "empty_file", "the input file holds no lines")
        if not self.store.put_lines(batch["id"], lines):  # cancelled meanwhile
            return self.store.get_batch(owner, batch["id"])
        return self.store.update_batch(batch["id"], status="in_progress", expect=("validating",))

    def _fail(self, batch: dict, code: str, message: str, line: int | None = None) -> dict:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]}
        return self.store.update_batch(batch["id"], status="failed", errors=errors, expect=("validating",))

    async def _run(self, owner: str | None, batch: dict) -> dict:
        """Run the lines without a result, until none is left or the window runs out; the batch finalizing."""
        batch_id = batch["id"]
        pending = await asyncio.to_thread(self.store.pending, batch_id)
        try:
            async with asyncio.timeout(max(batch["expires_at"] - time.time(), 0)):
                async with asyncio.TaskGroup() as group:
                    for idx in pending:
                        await self.slots.acquire()
                        group.create_task(self._line(owner, batch, idx))
        except TimeoutError:
            expired = {
                "code": "batch_expired",
                "message": "This request could not be executed before the completion window expired.",
            }
            await asyncio.to_thread(self.store.fail_pending, batch_id, expired)
            return await asyncio.to_thread(
                self.store.update_batch, batch_id, status="finalizing", expired_at=int(time.time())
            )
        return await asyncio.to_thread(self.store.update_batch, batch_id, status="finalizing")

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.batch_max_concurrency)
        return self._slots

    async def _line(self, owner: str | None, batch: dict, idx: int) -> None:
        try:
            custom_id, url, body = await asyncio.to_thread(self.store.line, batch["id"], idx)
            while True:
                answer = await call_app(self.app, url.removeprefix("/v1"), body.encode(), owner)
                if answer[0] not in RETRY_STATUSES:
                    break
                await asyncio.sleep(RETRY_AFTER)
            await asyncio.to_thread(self._finish, batch["id"], idx, custom_id, *answer)
        finally:
            self.slots.release()

    def _finish(self, batch_id: str, idx: int, custom_id: str, status: int, content: bytes) -> None:
        self.store.finish_line(batch_id, idx, output_record(custom_id, status, content), status == 200)

    def _finalize(self, owner: str | None, batch_id: str) -> None:
        """Write the output and error files of a batch that ran, and give it its final status (worker thread).
        The files' ids follow from the batch's, so that a finalization cut short and done again rewrites them."""
        batch = self.store.get_batch(owner, batch_id)
        if batch["status"] not in ("finalizing", "cancelling"):
            return
        final = "cancelled" if batch["status"] == "cancelling" else "expired" if batch["expired_at"] else "completed"
        changes: dict[str, Any] = {}
        for ok, field, kind in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
            if batch["request_counts"]["completed" if ok else "failed"]:
                file_id = f"file-{batch_id.removeprefix('batch_')}-{kind}"
                obj = file_object(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", 0)
                changes[field] = self.store.put_file(owner, obj, self.store.results(batch_id, ok))["id"]
        self.store.update_batch(batch_id, status=final, **changes)
        self.store.drop_lines(batch_id)


Checked = tuple[str | None, str | None, str | None, dict | None]


def check_line(text: bytes, router: "ModelRouter", priority: int) -> Checked:
    """(custom_id, url, body JSON to run, None), or (custom_id if it has one, None, None, the error that fails it).
    `router`: the servings a line's model must be one of; `priority`: what its generation runs at."""
    try:
        line = json.loads(text)
    except ValueError as e:
        return None, None, None, {"code": "invalid_json", "message": f"the line is not valid JSON: {e}"}
    if not isinstance(line, dict):
        return None, None, None, {"code": "invalid_request", "message": "the line is not a JSON object"}
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, None, None, {"code": "missing_custom_id", "message": "custom_id must be a non-empty string"}
    url, body = line.get("url"), line.get("body")
    problem = None
    if line.get("method") != "POST":
        problem = "invalid_method", f"method must be POST, got {line.get('method')!r}"
    elif url not in ENDPOINTS:
        problem = "invalid_url", f"url {url!r} is not one of {', '.join(ENDPOINTS)}"
    elif not isinstance(body, dict):
        problem = "invalid_body", "body must be a JSON object"
    elif body.get("stream"):
        problem = "invalid_body", "stream is not supported in a batch"
    else:
        try:
            router.route(body.get("model"), ENDPOINTS[url], url)
        except APIError as e:
            problem = e.code or "invalid_model", e.message
    if problem is not None:
        return custom_id, None, None, {"code": problem[0], "message": problem[1]}
    if ENDPOINTS[url] == "generate":
        body["priority"] = priority
    return custom_id, url, dumps(body).decode(), None


def output_record(custom_id: str, status: int, content: bytes) -> dict:
    """The output (or error) file's line for a request answered `status` with the JSON `content`."""
    try:
        body = json.loads(content)
    except ValueError:
        body = {"error": {"message": content.decode(errors="replace"), "type": "server_error"}}
    request_id = body.get("id") if status == 200 and isinstance(body, dict) else None
    response = {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body}
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": None}


async def call_app(app: FastAPI, path: str, body: bytes, client: str | None) -> tuple[int, bytes]:
    """POST `body` (JSON) to `app`'s route `path` in-process, as `client`: (status, response body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": None,
        "server": None,
        "state": {CLIENT_STATE: client},
    }
    answered, sent = asyncio.Event(), False
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # as a server does: the client hangs up only once it has the answer
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:  # Starlette re-raises a 500's exception after answering it
        if not chunks:
            raise
    finally:
        answered.set()
    return status, b"".join(chunks)


def batch_routes(app: FastAPI, settings: BatchSettings | None) -> None:
    """/files and /batches on `app` (400s while `settings` has no batch_dir), and the lifespan that resumes
    unfinished batches at start and stops them at shutdown."""
    batches = BatchAPI(app, settings) if settings is not None and settings.batch_dir else None
    app.state.batch_api = batches

    def api() -> BatchAPI:
        if batches is None:
            raise APIError(400, "the Batch API is off on this server (set batch_dir)", code="batches_disabled")
        return batches

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if batches is not None:
            await batches.resume()
        try:
            yield
        finally:
            if batches is not None:
                await batches.stop()

    app.router.lifespan_context = lifespan
    file_routes(app, api)

    @app.post("/batches")
    async def create_batch(raw: Request):
        batches, owner = api(), client_of(raw)
        try:
            req = CreateBatchRequest.model_validate(await raw.json())
        except (ValueError, ValidationError) as e:
            raise APIError(400, f"invalid batch request: {e}") from None
        if req.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        window = WINDOW.fullmatch(req.completion_window)
        if window is None or int(window[1]) == 0:
            message = "completion_window must be a duration such as 24h (s, m, h or d)"
            raise APIError(400, message, param="completion_window")
        file = await asyncio.to_thread(batches.store.get_file, owner, req.input_file_id)
        if file is None or file["purpose"] != "batch":
            raise APIError(400, f"no batch input file {req.input_file_id}", param="input_file_id")
        await check_quota(batches, owner)  # its output and error files
        now = int(time.time())
        batch = {
            "id": new_id("batch"),
            "object": "batch",
            "endpoint": req.endpoint,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + int(window[1]) * SECONDS[window[2]],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "metadata": req.metadata,
        }
        await asyncio.to_thread(batches.store.put_batch, owner, batch)
        batches.start(owner, batch["id"])
        return batch | {"request_counts": {"total": 0, "completed": 0, "failed": 0}}

    @app.get("/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, raw: Request):
        batch = await asyncio.to_thread(api().store.get_batch, client_of(raw), batch_id)
        if batch is None:
            raise _not_found(batch_id)
        return batch

    @app.get("/batches")
    async def list_batches(raw: Request, limit: int = 20, after: str | None = None):
        return page(await asyncio.to_thread(api().store.list_batches, client_of(raw)), limit, after)

    @app.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, raw: Request):
        return await api().cancel(client_of(raw), batch_id)


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", type="not_found_error", param="batch_id")
