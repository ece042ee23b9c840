"""`http(s)` image URLs in chat messages, served by a local `http.server` on 127.0.0.1: fetched only from a host of
`allowed_media_domains` (off by default), the same tokens as the decoded image given directly; a redirect within
the allowed hosts followed, one to another host refused, as are redirect loops, non-200 answers, bodies past
`max_image_bytes` (declared or not) and fetches past the timeout, each a ParamError naming the part and the URL."""

import base64
import http.server
import threading
import time

import pytest

from tests.engine.test_llava import random_image
from tiffin import LLM, SamplingParams
from tiffin.engine.errors import ParamError
from tiffin.engine.multimodal import fetch
from tiffin.testing.images import encoded

PNG = encoded(random_image(5, (40, 60)), "PNG")
WHERE = "messages[0].content[0]"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Length": str(len(PNG))}, PNG),
            "/redirect": (302, {"Location": "/cat.png"}, b""),
            "/away": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/declared-big": (200, {"Content-Length": str(10**9)}, b""),
            "/big": (200, {}, bytes(100_000)),  # no Content-Length: read until the connection closes
        }
        if self.path == "/slow":
            time.sleep(1)
        status, headers, body = routes.get(self.path, (404, {}, b""))
        self.send_response(status)  # HTTP/1.0: the connection closes after each answer
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def fetched(url: str, max_bytes: int = 65536) -> bytes:
    return fetch.fetch_image(url, ("127.0.0.1",), max_bytes, WHERE)


def test_allowed_host_fetched_and_redirects_within_it_followed(server):
    assert fetched(f"{server}/cat.png") == fetched(f"{server}/redirect") == PNG


@pytest.mark.parametrize(
    "path, words",
    [
        ("/away", "'localhost' are refused: not in allowed_media_domains"),
        ("/loop", "more than 3 redirects"),
        ("/missing", "answered 404"),
        ("/declared-big", "holds 1000000000 bytes, more than max_image_bytes=65536"),
        ("/big", "more than max_image_bytes=65536"),
    ],
)
def test_fetch_refused_by_name(server, path, words):
    with pytest.raises(ParamError, match=words) as e:
        fetched(server + path)
    assert e.value.param == "messages" and str(e.value).startswith(f"{WHERE}: ")


def test_fetch_past_the_timeout_refused(server, monkeypatch):
    monkeypatch.setattr(fetch, "FETCH_TIMEOUT", 0.2)
    with pytest.raises(ParamError, match="took more than 0.2 s"):
        fetched(f"{server}/slow")


def chat_of(url: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    return [{"role": "user", "content": parts}]


def test_chat_fetches_only_from_allowed_hosts(tiny_llava, server):
    """Off by default (the host refused before any request); allowed, the tokens are those of the same file sent as
    a data URL (which `test_vision_api` checks against the engine given the decoded image)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ParamError, match="'127.0.0.1' are refused: not in allowed_media_domains"):
        LLM(tiny_llava, dtype="float32").chat(chat_of(f"{server}/redirect"), params, use_tqdm=False)
    llm = LLM(tiny_llava, dtype="float32", allowed_media_domains="127.0.0.1")
    fetched_run, inline_run = (
        llm.chat(chat_of(url), params, use_tqdm=False)[0].outputs[0].token_ids
        for url in (f"{server}/redirect", f"data:image/png;base64,{base64.b64encode(PNG).decode()}")
    )
    assert fetched_run == inline_run and len(fetched_run) == 8
