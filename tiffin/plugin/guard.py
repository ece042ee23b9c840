"""ASGI middleware in front of every route of the Bento: API keys, the request body limit, and draining.

- Keys: with `api_key` set (several, comma-separated), every route but the probes needs one of them, presented as
  `Authorization: Bearer <key>` (OpenAI's) or `x-api-key: <key>` (Anthropic's); with `admin_api_key` set, the LoRA
  load/unload routes and sleep / wake / weight reload (tiffin.plugin.sleep) need that key instead (it opens the other
  routes too); without any key configured those three are refused (403), the LoRA routes open. Keys are compared
  in constant time; a refusal is a 401 in OpenAI's error shape.
- Clients: the app learns which key a request presented, as an opaque id in `scope["state"]` (read it with
  tiffin.plugin.openai.clients.client_of): routes keep per-client things by it. None when no keys are configured
  or the request presented none of them (on a route open without a key). A user key (any key but `admin_api_key`)
  may not ask for a `priority` below `min_user_priority` (clients.min_priority): it can only lower its own.
- Concurrency: at most `max_concurrency` requests in the app at once, and `max_concurrency_per_key` of one key's
  (so one key cannot fill the server); beyond, a 429 in OpenAI's error shape with Retry-After. This replaces
  BentoML's own bound, which counts every key alike and answers `{"error": "Too many requests"}`.
- Body limit: a declared Content-Length beyond `max_body` (or the path's own limit in `body_limits`: file uploads)
  is answered 413 without buffering the body; a chunked body is counted as it arrives and cut off at the limit.
- Draining: while `draining()` is true (SIGTERM received), new requests get 503 while running ones finish.
- Liveness: while `failure()` names why the service is dead (an engine failed or stalled), /livez answers 503 with
  that reason in OpenAI's error shape, where BentoML's own answer says only that `__is_alive__` is false.
- Memory: after a request with a large body, freed memory goes back to the OS (see `_release_memory`).

`UploadsOnly`, behind it, keeps BentoML from fetching URLs for the typed APIs' file fields.
"""

import asyncio
import ctypes
import functools
import hmac
import json
import sys
from collections import Counter
from collections.abc import Callable

from tiffin.plugin.openai.clients import CLIENT_STATE, MIN_PRIORITY_STATE, client_id, presented_keys

PROBES = ("/livez", "/readyz")  # orchestrators probe without credentials, and must see draining
UNCOUNTED = ("/metrics",)  # scrapes are not bounded by the concurrency limits
ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
KEYED_ADMIN_ROUTES = ("/sleep", "/wake_up", "/update_weights")  # admin routes refused on a server without keys
DISCARD_LIMIT = 64 << 20  # an oversized body up to this is read and dropped, so the client sees the 413
RELEASE_AFTER = 1 << 20  # body bytes after which a request's freed buffers are handed back to the OS


class Guard:
    def __init__(
        self,
        app,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        max_body: int = 10 << 20,
        draining: Callable[[], bool] = lambda: False,
        failure: Callable[[], str | None] = lambda: None,
        max_concurrency: int | None = None,
        max_concurrency_per_key: int | None = None,
        min_user_priority: int | None = None,
        body_limits: dict[str, int] | None = None,
    ):
        self.app, self.max_body, self.draining, self.failure = app, max_body, draining, failure
        self.body_limits = body_limits or {}
        user_keys = [k.strip().encode() for k in (api_key or "").split(",") if k.strip()]
        self.admin_keys = [admin_api_key.encode()] if admin_api_key else user_keys
        self.keys = user_keys + [k for k in self.admin_keys if k not in user_keys] if user_keys else []
        self.known = list(dict.fromkeys(user_keys + self.admin_keys))  # every key a client may be known by
        self.privileged = [admin_api_key.encode()] if admin_api_key else []  # not bound by min_user_priority
        self.max_concurrency, self.max_concurrency_per_key = max_concurrency, max_concurrency_per_key
        self.min_user_priority = min_user_priority
        self.in_flight: Counter[str | None] = Counter()  # requests in the app, by client

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/livez" and (reason := self.failure()) is not None:
            return await _error(send, 503, reason, "engine_failed", "service_unavailable")
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["path"] in KEYED_ADMIN_ROUTES and not self.admin_keys:
            message = f"{scope['path']} needs admin_api_key (or api_key) to be set on the server"
            return await _error(send, 403, message, "admin_key_not_configured")
        keys = self.admin_keys if scope["path"] in ADMIN_ROUTES + KEYED_ADMIN_ROUTES else self.keys
        key = _matching(presented_keys(headers), self.known)
        if keys and key not in keys:
            message = "a valid API key is required: Authorization: Bearer <key>, or x-api-key: <key>"
            return await _error(send, 401, message, "invalid_api_key")
        client = None if key is None else client_id(key)
        state = scope.setdefault("state", {})
        state[CLIENT_STATE] = client
        if key is not None and key not in self.privileged and self.min_user_priority is not None:
            state[MIN_PRIORITY_STATE] = self.min_user_priority
        if self.draining():
            return await _error(send, 503, "the server is shutting down", "shutting_down", "service_unavailable")
        if scope["path"] in UNCOUNTED:
            return await self._bounded(scope, receive, send, headers)
        if (refusal := self._full(client)) is not None:
            return await _error(send, 429, refusal, "concurrency_limit", "rate_limit_error")
        self.in_flight[client] += 1
        try:
            await self._bounded(scope, receive, send, headers)
        finally:
            self.in_flight[client] -= 1
            if not self.in_flight[client]:
                del self.in_flight[client]

    def _full(self, client: str | None) -> str | None:
        """Why a request of `client` may not start now, or None."""
        if self.max_concurrency is not None and self.in_flight.total() >= self.max_concurrency:
            return f"the server is running {self.max_concurrency} requests (max_concurrency); retry later"
        limit = self.max_concurrency_per_key
        if limit is not None and client is not None and self.in_flight[client] >= limit:
            return f"this API key is running {limit} requests (max_concurrency_per_key); retry later"
        return None

    async def _bounded(self, scope, receive, send, headers: dict) -> None:
        """The app behind the body limit."""
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await _error(send, 400, "invalid Content-Length", "invalid_request")
        limit = self.body_limits.get(scope["path"], self.max_body)
        try:
            if declared > limit:
                await _discard(receive, declared)
                return await _error(send, 413, f"request body is larger than {limit} bytes", "request_too_large")
            declared = max(declared, await self._limited(scope, receive, send, limit))
        finally:
            if declared >= RELEASE_AFTER:
                await asyncio.to_thread(_release_memory)

    async def _limited(self, scope, receive, send, limit: int) -> int:
        """Run the app, counting body bytes as it reads them; past the limit, answer 413 and end the request.
        Returns the bytes received."""
        received, refused, started = 0, False, False

        async def counting_receive():
            nonlocal received, refused
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit and not refused:
                refused = True
                if not started:
                    await _error(send, 413, f"request body is larger than {limit} bytes", "request_too_large")
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if not refused:
                started = True
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise
        return received


class UploadsOnly:
    """The typed APIs' file fields (`fields`: route -> field) take uploaded files only. BentoML fetches a file field
    sent as a string as a URL, from any public host with no bound on time or size; tiffin fetches images only from
    `allowed_media_domains` (the /v1 routes), so such a field is a 400 here. The multipart body, bounded by the
    Guard in front, is read whole to look, then replayed to the app."""

    def __init__(self, app, fields: dict[str, str]):
        self.app, self.fields = app, fields

    async def __call__(self, scope, receive, send) -> None:
        field = self.fields.get(scope["path"]) if scope["type"] == "http" else None
        if field is None or not dict(scope["headers"]).get(b"content-type", b"").startswith(b"multipart/"):
            return await self.app(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        if await _strings_in(scope, body, field):
            message = f"{field}: upload image files (multipart parts with a filename); URLs are not fetched here"
            return await _error(send, 400, message, "invalid_file")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _strings_in(scope, body: bytes, field: str) -> bool:
    """Whether the multipart `body` gives `field` a value that is not a file."""
    from starlette.datastructures import UploadFile
    from starlette.requests import Request

    async def once():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, once).form()
    except Exception:  # noqa: BLE001 (a malformed body: the app answers it as it would)
        return False
    try:
        return any(not isinstance(value, UploadFile) for value in form.getlist(field))
    finally:
        await form.close()


@functools.cache
def _libc():
    return ctypes.CDLL("libc.so.6") if sys.platform == "linux" else None


def _release_memory() -> None:
    """The model runner raises glibc's mmap and trim thresholds so that step buffers are reused, which also keeps
    the megabytes a large request's body, JSON and text copies took resident after it is gone: trim them."""
    try:
        libc = _libc()
    except OSError:  # not glibc
        return
    if libc is not None:
        libc.malloc_trim(0)


def _matching(presented: list[bytes], keys: list[bytes]) -> bytes | None:
    """The key among `keys` that a request presented, if any; every pair compared, so the time tells nothing."""
    matches = [key for candidate in presented for key in keys if hmac.compare_digest(candidate, key)]
    return matches[0] if matches else None


async def _discard(receive, declared: int) -> None:
    if declared > DISCARD_LIMIT:
        return
    message = {"more_body": True}
    while message.get("more_body") and message.get("type", "http.request") == "http.request":
        message = await receive()


async def _error(send, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 429:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
