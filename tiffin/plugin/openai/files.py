"""OpenAI's /files API for the Batch API: upload a `purpose=batch` JSONL file (multipart, as the `openai` client
sends it), list, retrieve, read and delete; the output and error files of finished batches are read here too.

Invariants:
- An upload is counted as it arrives: past `batch_max_file_bytes` (and a little for the multipart framing) the
  request is refused with a 400 before more is read; a file part over the limit is a 400 too. Nothing of a
  refused upload stays on disk.
- Each owner holds at most `batch_max_files` files, its batches' outputs included: an upload (or a batch, which
  writes up to two) past that is a 400 until it deletes some. Disk use is bounded so.
- Files are found only by their owner (the client that uploaded them, or whose batch wrote them)."""

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from tiffin.plugin.openai.batch_store import new_id
from tiffin.plugin.openai.clients import client_of
from tiffin.plugin.openai.protocol import APIError

MULTIPART_SLACK = 64 << 10  # bytes of multipart framing and form fields beside the file


def file_object(file_id: str, filename: str, purpose: str, size: int) -> dict:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", type="not_found_error", param="id")


def page(items: list[dict], limit: int, after: str | None) -> dict:
    """OpenAI's cursor page of `items` (newest first): those after the id `after`, at most `limit`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[: max(limit, 1)]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": len(items) > len(data)}


def file_routes(app: FastAPI, api: Callable[[], Any]) -> None:
    """The /files routes on `app`, over the Batch API `api()` gives (tiffin.plugin.openai.batches.BatchAPI: its
    `store` and `settings`; a 400 when the Batch API is off)."""

    @app.post("/files")
    async def upload_file(raw: Request):
        batches, owner = api(), client_of(raw)
        limit = batches.settings.batch_max_file_bytes
        form = await _counted(raw, limit + MULTIPART_SLACK).form(max_files=1, max_fields=4)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "a file is required (multipart field `file`)", param="file")
            if upload.size is None or upload.size > limit:
                raise APIError(400, f"file is larger than {limit} bytes", param="file", code="file_too_large")
            await check_quota(batches, owner)
            obj = file_object(new_id("file"), upload.filename or "upload.jsonl", purpose, upload.size)
            upload.file.seek(0)
            chunks = iter(lambda: upload.file.read(1 << 20), b"")
            return await asyncio.to_thread(batches.store.put_file, owner, obj, chunks)
        finally:
            await form.close()

    @app.get("/files")
    async def list_files(raw: Request, purpose: str | None = None, limit: int = 10000, after: str | None = None):
        files = await asyncio.to_thread(api().store.list_files, client_of(raw), purpose)
        return page(files, limit, after)

    @app.get("/files/{file_id}")
    async def retrieve_file(file_id: str, raw: Request):
        return await _file(api(), raw, file_id)

    @app.get("/files/{file_id}/content")
    async def file_content(file_id: str, raw: Request):
        batches = api()
        obj = await _file(batches, raw, file_id)
        return FileResponse(batches.store.path(obj["id"]), media_type="application/octet-stream")

    @app.delete("/files/{file_id}")
    async def delete_file(file_id: str, raw: Request):
        if not await asyncio.to_thread(api().store.delete_file, client_of(raw), file_id):
            raise not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


async def check_quota(batches: Any, owner: str | None) -> None:
    """A 400 when `owner` holds as many files as it may."""
    if await asyncio.to_thread(batches.store.count_files, owner) >= batches.settings.batch_max_files:
        message = f"this API key holds {batches.settings.batch_max_files} files already: delete some first"
        raise APIError(400, message, param="file", code="file_limit_reached")


async def _file(batches: Any, raw: Request, file_id: str) -> dict:
    obj = await asyncio.to_thread(batches.store.get_file, client_of(raw), file_id)
    if obj is None:
        raise not_found(file_id)
    return obj


def _counted(raw: Request, limit: int) -> Request:
    """`raw`, whose body is refused (a 400) once more than `limit` bytes of it have arrived."""
    received = 0

    async def receive():
        nonlocal received
        message = await raw.receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise APIError(400, f"upload is larger than {limit} bytes", param="file", code="file_too_large")
        return message

    return Request(raw.scope, receive)
