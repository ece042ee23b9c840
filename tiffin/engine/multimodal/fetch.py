"""Images named by `http(s)` URL, fetched only from the hosts `allowed_media_domains` lists (none by default): the
host of the URL and of every redirect must be listed (a redirect elsewhere is refused, not followed), the whole fetch
takes at most FETCH_TIMEOUT seconds, and the body at most `max_image_bytes` (a larger Content-Length is refused
before the body is read; a body growing past it is cut off). Every refusal is a ParamError naming the part, the URL
and the problem; the bytes are then decoded as a data URL's are (`image.decode_image`)."""

import time
from urllib.parse import urlsplit

from tiffin.engine.errors import ParamError

FETCH_TIMEOUT = 5.0  # seconds for a whole fetch, redirects included (vLLM's default image fetch timeout)
MAX_REDIRECTS = 3


def fetch_image(url: str, allowed: tuple[str, ...], max_bytes: int, where: str) -> bytes:
    """The body `url` answers with a 200, following at most MAX_REDIRECTS redirects within `allowed` hosts."""
    import httpx

    deadline = time.monotonic() + FETCH_TIMEOUT
    with httpx.Client(timeout=FETCH_TIMEOUT, follow_redirects=False) as http:
        for _ in range(MAX_REDIRECTS + 1):
            check_host(url, allowed, where)
            try:
                with http.stream("GET", url) as response:
                    if not response.is_redirect:
                        return _body(response, url, max_bytes, deadline, where)
                    url = str(response.url.join(response.headers.get("location", "")))
            except httpx.TimeoutException:
                raise _refusal(where, f"fetching {url} took more than {FETCH_TIMEOUT:g} s") from None
            except httpx.HTTPError as e:
                raise _refusal(where, f"{url} cannot be fetched: {type(e).__name__}: {e}") from None
    raise _refusal(where, f"{url}: more than {MAX_REDIRECTS} redirects")


def check_host(url: str, allowed: tuple[str, ...], where: str) -> None:
    """ParamError unless `url` is http(s) on a host of `allowed`."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme not in ("http", "https"):
        raise _refusal(where, f"{url}: only http(s) image URLs are fetched")
    if host not in allowed:
        raise _refusal(where, f"image URLs of {host!r} are refused: not in allowed_media_domains")


def _body(response, url: str, max_bytes: int, deadline: float, where: str) -> bytes:
    if response.status_code != 200:
        raise _refusal(where, f"{url} answered {response.status_code}, not 200")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _refusal(where, f"{url} holds {length} bytes, more than max_image_bytes={max_bytes}")
    data = bytearray()
    for piece in response.iter_bytes():
        data += piece
        if len(data) > max_bytes:
            raise _refusal(where, f"{url} holds more than max_image_bytes={max_bytes} bytes")
        if time.monotonic() > deadline:  # a server dripping bytes in time for each read
            raise _refusal(where, f"fetching {url} took more than {FETCH_TIMEOUT:g} s")
    return bytes(data)


def _refusal(where: str, problem: str) -> ParamError:
    return ParamError("messages", f"{where}: {problem}")
