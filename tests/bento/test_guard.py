"""API keys, the body limit, the waiting-queue bound and graceful shutdown (issue #16): the Guard middleware
in-process, then the Bento end to end (`bentoml serve` with keys set), ending with a SIGTERM while a stream
runs."""

import asyncio
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("bentoml")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Mount, Route  # noqa: E402

from tiffin.plugin.guard import Guard  # noqa: E402
from tiffin.plugin.openai.clients import client_of  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

KEY, KEY2, ADMIN = "sk-user-key", "sk-other-key", "sk-admin-key"


def v1_app() -> FastAPI:
    v1 = FastAPI()

    @v1.post("/completions")
    async def completions(body: dict):
        return {"size": len(str(body))}

    @v1.post("/load_lora_adapter")
    async def load():
        return {"loaded": True}

    @v1.get("/client")
    async def client(raw: Request):
        return {"client": client_of(raw)}

    return v1


def guarded(**options) -> TestClient:

    ok = lambda request: PlainTextResponse("ok")
    app = Starlette(routes=[Route("/livez", ok), Route("/readyz", ok), Route("/metrics", ok), Mount("/v1", v1_app())])
    return TestClient(Guard(app, **options))


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys():
    client = guarded(api_key=KEY, admin_api_key=ADMIN)
    assert client.get("/livez").status_code == client.get("/readyz").status_code == 200  # probes stay open
    for headers in ({}, bearer("wrong"), bearer(KEY + "x"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = client.post("/v1/completions", json={}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
        assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
    assert client.get("/metrics").status_code == 401
    assert client.post("/v1/completions", json={}, headers=bearer(KEY)).status_code == 200
    assert client.get("/metrics", headers=bearer(KEY)).status_code == 200
    assert client.post("/v1/completions", json={}, headers=bearer(ADMIN)).status_code == 200  # admin opens all
    assert client.post("/v1/load_lora_adapter", headers=bearer(KEY)).status_code == 401  # the user key does not
    assert client.post("/v1/load_lora_adapter", headers=bearer(ADMIN)).status_code == 200


def test_several_keys_each_open_the_routes_and_name_their_client():
    client = guarded(api_key=f"{KEY}, {KEY2},", admin_api_key=ADMIN)
    ids = {}
    for key in (KEY, KEY2, ADMIN):
        seen = {client.get("/v1/client", headers=h).json()["client"] for h in (bearer(key), {"x-api-key": key})}
        assert len(seen) == 1 and None not in seen, seen  # either header, the same client, every time
        ids[key] = seen.pop()
        assert client.get("/v1/client", headers=bearer(key)).json()["client"] == ids[key]
    assert len(set(ids.values())) == 3 and all(key not in i for key, i in ids.items())
    for headers in ({"x-api-key": "wrong"}, {"x-api-key": KEY + "x"}, {"x-api-key": ""}, bearer(f"{KEY},{KEY2}")):
        assert client.get("/v1/client", headers=headers).status_code == 401, headers
    assert client.get("/v1/client", headers={**bearer("wrong"), "x-api-key": KEY2}).json()["client"] == ids[KEY2]
    for key in (KEY, KEY2):  # admin routes still need the admin key
        assert client.post("/v1/load_lora_adapter", headers={"x-api-key": key}).status_code == 401
    assert client.post("/v1/load_lora_adapter", headers={"x-api-key": ADMIN}).status_code == 200
    without_admin = guarded(api_key=f"{KEY},{KEY2}")  # then every user key is an admin key too, as one was
    assert without_admin.post("/v1/load_lora_adapter", headers=bearer(KEY2)).status_code == 200


def test_client_is_none_without_keys_and_the_presented_key_without_a_guard():
    assert guarded().get("/v1/client", headers=bearer(KEY)).json() == {"client": None}
    assert guarded(admin_api_key=ADMIN).get("/v1/client", headers=bearer(KEY)).json() == {"client": None}
    guarded_id = guarded(api_key=KEY).get("/v1/client", headers=bearer(KEY)).json()["client"]
    unguarded = TestClient(v1_app())  # as tests run the app in-process
    assert unguarded.get("/client", headers=bearer(KEY)).json()["client"] == guarded_id
    assert unguarded.get("/client", headers={"x-api-key": KEY}).json()["client"] == guarded_id
    assert unguarded.get("/client").json()["client"] is None


def test_admin_key_alone_guards_only_the_admin_routes():
    client = guarded(admin_api_key=ADMIN)
    assert client.post("/v1/completions", json={}).status_code == 200
    assert client.post("/v1/load_lora_adapter").status_code == 401
    assert client.post("/v1/load_lora_adapter", headers=bearer(ADMIN)).status_code == 200
    assert guarded(api_key=KEY).post("/v1/load_lora_adapter", headers=bearer(KEY)).status_code == 200


def test_body_limit():
    client = guarded(max_body=1000)
    assert client.post("/v1/completions", json={"prompt": "x" * 900}).status_code == 200
    r = client.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_a_path_with_a_body_limit_of_its_own():  # /v1/files: uploads up to batch_max_file_bytes
    client = guarded(max_body=1000, body_limits={"/v1/completions": 3000})
    assert client.post("/v1/completions", json={"prompt": "x" * 2000}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x" * 4000}).status_code == 413
    assert client.post("/v1/load_lora_adapter", content=b"x" * 2000).status_code == 413  # the others keep max_body


def test_draining_turns_new_requests_away():
    draining = threading.Event()
    client = guarded(draining=draining.is_set)
    assert client.post("/v1/completions", json={}).status_code == 200
    draining.set()
    assert client.post("/v1/completions", json={}).status_code == 503
    assert client.get("/livez").status_code == 200


def test_concurrency_is_bounded_per_key_and_in_all_with_openai_shaped_429s():
    """One key cannot take every slot (issue #50, defect 4); a refusal is OpenAI's error shape with Retry-After,
    not BentoML's `{"error": "Too many requests"}`; scrapes are never refused."""

    async def run():
        release = asyncio.Event()

        async def hold(request):
            await release.wait()
            return PlainTextResponse("done")

        app = Starlette(routes=[Route("/hold", hold, methods=["POST"]), Route("/metrics", hold)])
        guard = Guard(app, api_key=f"{KEY},{KEY2}", admin_api_key=ADMIN, max_concurrency=3, max_concurrency_per_key=2)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://guarded") as http:
            post = lambda key: http.post("/hold", headers=bearer(key))
            held = [asyncio.create_task(post(KEY)) for _ in range(2)]
            await asyncio.sleep(0.05)
            over_share = await post(KEY)
            held.append(asyncio.create_task(post(KEY2)))  # the other key still gets in
            held.append(asyncio.create_task(http.get("/metrics", headers=bearer(KEY))))
            await asyncio.sleep(0.05)
            full = await post(ADMIN)
            release.set()
            done = await asyncio.gather(*held)
            again = await post(KEY)
        return over_share, full, done, again, guard.in_flight

    over_share, full, done, again, in_flight = asyncio.run(run())
    for refused, setting in ((over_share, "max_concurrency_per_key"), (full, "max_concurrency")):
        error = refused.json()["error"]
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "rate_limit_error"
        assert f"({setting})" in error["message"], error
    assert [r.status_code for r in done] == [200] * 4 and again.status_code == 200 and not in_flight


def test_waiting_queue_bound_is_a_429_with_retry_after(openai_app):
    from tiffin import SamplingParams
    from tiffin.engine.errors import QueueFull

    api = openai_app(num_kv_blocks=64, max_num_seqs=1, max_waiting_requests=2)
    engine = api.engine

    async def fill_then_add():
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        streams = [await engine.add_request("fill-0", "x", long)]
        await anext(streams[0])  # running: the engine took it out of the queue
        streams += [await engine.add_request(f"fill-{i}", "x", long) for i in (1, 2)]  # they wait
        try:
            with pytest.raises(QueueFull, match="max_waiting_requests=2"):
                await engine.add_request("one-too-many", "x", SamplingParams(max_tokens=1))
        finally:
            for stream in streams:
                stream.close()

    try:
        asyncio.run(fill_then_add())
        app = api.app

        async def full(*args, **kwargs):
            raise QueueFull("max_waiting_requests=2 sequences are waiting")

        engine.add_request = full
        r = TestClient(app).post("/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        engine.shutdown()


# --- the Bento ---


@pytest.fixture(scope="module")
def server(bento_server, tmp_path_factory):
    return bento_server(
        args={"model": "tiffin-tiny-llama", "num_kv_blocks": 128, "max_request_body": "1MiB"},
        env={
            "TIFFIN_API_KEY": KEY,
            "TIFFIN_ADMIN_API_KEY": ADMIN,
            "TIFFIN_LORA_ROOTS": str(tmp_path_factory.mktemp("adapters")),
            "TIFFIN_SHUTDOWN_GRACE_PERIOD": "60",
        },
    )


def test_bento_routes_need_the_key(server):
    http = server.http
    body = {"prompt": "Hello", "max_tokens": 3}
    assert http.get("/livez").status_code == 200
    for method, path, kw in [
        ("GET", "/v1/models", {}),
        ("POST", "/v1/completions", {"json": body}),
        ("POST", "/generate", {"json": {"prompt": "Hello", "max_tokens": 3}}),
        ("GET", "/metrics", {}),
        ("POST", "/v1/tokenize", {"json": {"prompt": "Hello"}}),
        ("POST", "/tokenize", {"json": {"prompt": "Hello"}}),  # vLLM's root path
        ("POST", "/detokenize", {"json": {"tokens": [1, 2]}}),
    ]:
        assert http.request(method, path, **kw).status_code == 401, path
        assert http.request(method, path, headers=bearer("nope"), **kw).status_code == 401, path
        assert http.request(method, path, headers=bearer(KEY), **kw).status_code == 200, path
        assert http.request(method, path, headers={"x-api-key": KEY}, **kw).status_code == 200, path
    tokens = http.post("/tokenize", json={"prompt": "Hello"}, headers=bearer(KEY)).json()
    assert tokens == http.post("/v1/tokenize", json={"prompt": "Hello"}, headers=bearer(KEY)).json()
    assert tokens["count"] == len(tokens["tokens"]) > 1
    assert http.get("/tokenize", headers=bearer(KEY)).status_code == 405  # the root app answers only its routes
    assert http.get("/", headers=bearer(KEY)).status_code == 200  # BentoML's own routes stay its own
    load = {"lora_name": "x", "lora_path": "missing"}
    assert http.post("/v1/load_lora_adapter", json=load, headers=bearer(KEY)).status_code == 401
    assert http.post("/v1/load_lora_adapter", json=load, headers=bearer(ADMIN)).status_code == 400  # past the key
    started = time.monotonic()
    r = http.post("/v1/completions", content=b"x" * (20 << 20), headers=bearer(KEY))
    assert r.status_code == 413 and time.monotonic() - started < 10


# Every route BentoML serves besides tiffin's (docs, schema, healthz, metrics, static content, the typed APIs),
# and spellings of the probes and routes a router might normalise
UNPROTECTED_LOOKING = ["/", "/docs", "/docs.json", "/schema.json", "/healthz", "/metrics", "/static_content/index.css"]
UNPROTECTED_LOOKING += ["/generate", "/generate_stream", "/livez/", "//docs", "/readyz/../docs", "/livez%2F..%2Fdocs"]
UNPROTECTED_LOOKING += ["/v1/openapi.json", "/v1/docs", "/v1/models/"]
ADMIN_SPELLINGS = [
    "/v1/load_lora_adapter/",
    "/v1//load_lora_adapter",
    "//v1/load_lora_adapter",
    "/v1/./load_lora_adapter",
]
ADMIN_SPELLINGS += ["/v1/%6Coad_lora_adapter", "/V1/load_lora_adapter", "/v1/load_lora_adapter?x=1"]
ADMIN_SPELLINGS += ["/v1/load_lora_adapter%2F", "/v1/x/../load_lora_adapter", "/v1/unload_lora_adapter/"]


def _raw(server, method: str, path: str, headers: dict, body: bytes = b"") -> httpx.Response:
    """A request with its path as written: httpx would normalise dot segments."""
    request = server.http.build_request(method, "/", headers=headers, content=body)
    request.url = request.url.copy_with(raw_path=path.encode())
    return server.http.send(request)


@pytest.mark.parametrize("method", ["GET", "POST", "OPTIONS", "HEAD"])
def test_no_route_but_the_probes_answers_without_the_key(server, method):
    for path in UNPROTECTED_LOOKING:
        body = b'{"prompt": "x", "max_tokens": 1}' if method == "POST" else b""
        r = _raw(server, method, path, {"content-type": "application/json"}, body)
        assert r.status_code == 401, (method, path, r.status_code, r.text[:200])


@pytest.mark.parametrize(
    "authorization", [f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Bearer{KEY}", ""]
)
def test_only_the_bearer_scheme_with_the_exact_key_passes(server, authorization):
    assert server.http.get("/v1/models", headers={"authorization": authorization}).status_code == 401
    assert server.http.get("/v1/models", headers={"authorization": f"bearer  {KEY}"}).status_code == 200


def test_the_user_key_reaches_no_admin_route_however_spelled(server):
    """Each spelling is refused, unknown (404) or redirected (307) to the route itself, which refuses it."""
    load = b'{"lora_name": "x", "lora_path": "missing"}'
    for path in ADMIN_SPELLINGS:
        r = _raw(server, "POST", path, {**bearer(KEY), "content-type": "application/json"}, load)
        assert r.status_code in (401, 404, 307), (path, r.status_code, r.text[:200])
        if r.status_code == 307:
            target = httpx.URL(r.headers["location"]).raw_path.decode()
            assert _raw(server, "POST", target, bearer(KEY), load).status_code == 401, (path, target)


SLEEP_SPELLINGS = ["/sleep", "/sleep/", "//sleep", "/./sleep", "/x/../sleep", "/%73leep", "/SLEEP", "/v1/sleep"]
SLEEP_SPELLINGS += ["/wake_up", "/wake_up/", "/update_weights", "/update_weights/", "/v1/../update_weights"]


def test_sleep_routes_need_the_admin_key_however_spelled(server):
    """The user key puts nothing to sleep however the path is spelled; the admin key does, through BentoML's
    mounts: completions (and the typed API) then 503 naming the state, /readyz stays 200, and the wake serves."""
    http, body = server.http, b'{"model_path": "/nonexistent"}'
    for path in SLEEP_SPELLINGS:
        r = _raw(server, "POST", path + "?level=2", {**bearer(KEY), "content-type": "application/json"}, body)
        assert r.status_code in (401, 404, 307), (path, r.status_code, r.text[:200])
        if r.status_code == 307:
            target = httpx.URL(r.headers["location"]).raw_path.decode()
            assert _raw(server, "POST", target, bearer(KEY), body).status_code == 401, (path, target)
    assert http.get("/is_sleeping", headers=bearer(KEY)).json() == {"is_sleeping": False}
    assert http.post("/sleep?level=1", headers=bearer(ADMIN)).json() == {"is_sleeping": True, "level": 1}
    completion = {"prompt": "Hello", "max_tokens": 3}
    refused = http.post("/v1/completions", json=completion, headers=bearer(KEY))
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_asleep"
    assert http.post("/generate", json=completion, headers=bearer(KEY)).status_code == 503
    assert http.get("/readyz").status_code == 200
    reload = http.post("/update_weights", json={"model_path": "/nonexistent"}, headers=bearer(ADMIN))
    assert reload.status_code == 409 and "asleep" in reload.json()["error"]["message"]
    assert http.post("/wake_up", headers=bearer(ADMIN)).json()["is_sleeping"] is False
    assert http.post("/v1/completions", json=completion, headers=bearer(KEY)).status_code == 200
    reload = http.post("/update_weights", json={"model_path": "/nonexistent"}, headers=bearer(ADMIN))
    assert reload.status_code == 400 and "cannot read the checkpoint at /nonexistent" in reload.text


def test_sigterm_lets_the_running_stream_finish(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=bearer(KEY), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1)
            assert server.status("/readyz") in (0, 503)  # not ready, or no longer accepting
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2], rest[-3:]
    server.proc.wait(30)
