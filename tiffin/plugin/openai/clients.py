"""Which client sent a request, for routes that keep something per client (response store ownership, fair share).

A client is the API key it presented, as an opaque id (`client_id`): the Bento's guard (tiffin.plugin.guard) puts
the id of the key it accepted in the ASGI scope's state (`CLIENT_STATE`), None when no keys are configured. Where
no guard ran (the app in-process), the key a request presents stands for its client, unchecked."""

import hashlib

from fastapi import Request

CLIENT_STATE = "tiffin_client"  # the key in scope["state"] under which the guard leaves the client's id
MIN_PRIORITY_STATE = "tiffin_min_priority"  # ... and the lowest `priority` that client may ask for


def presented_keys(headers: dict[bytes, bytes]) -> list[bytes]:
    """The API keys in a request's ASGI headers: an `Authorization: Bearer` token (OpenAI's), then `x-api-key`
    (Anthropic's)."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    keys = [token if scheme.lower() == b"bearer" else b"", headers.get(b"x-api-key", b"")]
    return [k.strip() for k in keys if k.strip()]


def client_id(key: bytes) -> str:
    """A key's opaque id: stable, distinct per key, and no use to anyone who reads it in a log."""
    return hashlib.sha256(key).hexdigest()[:16]


def client_of(raw: Request) -> str | None:
    """The id of the client that sent `raw`: the guard's verdict, else the first key presented, else None."""
    state = raw.scope.get("state") or {}
    if CLIENT_STATE in state:
        return state[CLIENT_STATE]
    keys = presented_keys(dict(raw.scope["headers"]))
    return client_id(keys[0]) if keys else None


def min_priority(raw: Request) -> int | None:
    """The lowest `priority` (the most urgent) the client that sent `raw` may ask for; None: any."""
    return (raw.scope.get("state") or {}).get(MIN_PRIORITY_STATE)
