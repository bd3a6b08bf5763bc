"""ASGI middleware in front of the routes: the Host check, the API key check, the JSON content type,
and the request-body size and time limits.

Each answers with OpenAI's error object before any route code runs, so a request from a web page of
another site, an unauthenticated or an oversized one never reaches JSON parsing or the engine.

A web page can make a browser send requests to a server on the user's machine (or network) that
needs no key: a form or a `fetch` with a text/plain body goes to any address without asking it first
(a CORS preflight, which this server never answers, is sent only for other content types, JSON's
among them), and DNS rebinding points the page's own domain at 127.0.0.1, making its requests
same-origin, answers readable. The first is stopped by taking only `Content-Type: application/json`
on JSON routes (415 otherwise), the second by answering 421 to a Host header that is none of this
server's names: an IP address (a rebinding page's requests carry its domain name, never an address),
localhost and the names under .localhost (which resolve to loopback only), and those the server adds
(`HostCheck`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from collections.abc import Iterable

from lmforge.serve.protocol import APIError

# Routes a load balancer or a person's browser must reach without the key: health checks, and the
# chat page, a static file with a field for the key that its own API calls then send.
OPEN_ROUTES = frozenset({"/health", "/ping", "/"})


def timeout_error(what: str, seconds: float) -> APIError:
    return APIError(
        408,
        f"the request's {what} did not arrive within {seconds:g} s: send the whole request at once",
        code="request_timeout",
    )


async def send_error(send, err: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(err.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Every route but OPEN_ROUTES needs `Authorization: Bearer KEY` (compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "no API key given" if not header else "the API key is not valid"
                err = APIError(
                    401,
                    f"{what}: send the header 'Authorization: Bearer YOUR_KEY'",
                    code="invalid_api_key",
                )
                return await send_error(send, err, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class HostCheck:
    """The Host names a server answers to: IP addresses, localhost and *.localhost, and `names`
    (a name, ".suffix" for it and every name under it, "*" for any Host at all), compared without
    case or port."""

    def __init__(self, names: Iterable[str] = ()):
        names = [n.strip().lower().rstrip(".") for n in names if n.strip()]
        self.any = "*" in names
        self.names = {n for n in names if not n.startswith(".")} | {"localhost"}
        self.suffixes = (".localhost", *(n for n in names if n.startswith(".")))

    def allows(self, host: str) -> bool:
        if self.any:
            return True
        name = host_name(host)
        try:
            # an IPv6 address may carry its zone ("fe80::1%eth0")
            ipaddress.ip_address(name.partition("%")[0])
            return True
        except ValueError:
            pass
        return name in self.names or any(name.endswith(s) or name == s[1:] for s in self.suffixes)


def host_name(host: str) -> str:
    """A Host header's name, lower case, without its port, brackets or a final dot."""
    host = host.strip().lower()
    if host.startswith("["):  # [IPv6]:port
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


class HostCheckMiddleware:
    """A request whose Host is none of the server's names (HostCheck) gets 421 Misdirected
    Request: this server does not answer for that name. A request without Host (HTTP/1.0) is let
    through: a browser always sends one."""

    def __init__(self, app, check: HostCheck):
        self.app, self.check = app, check

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.check.any:
            host = dict(scope["headers"]).get(b"host")
            if host is not None and not self.check.allows(host.decode("latin-1")):
                shown = host.decode("latin-1")[:100]
                err = APIError(
                    421,
                    f"this server does not answer for the host '{shown}' (a web page's requests to "
                    "a local server carry such a name): reach it by its address or localhost, or "
                    "start it with --allowed-hosts naming that host",
                    code="invalid_host",
                )
                return await send_error(send, err)
        await self.app(scope, receive, send)


class JsonContentTypeMiddleware:
    """POSTs to `routes` must say `Content-Type: application/json` (a charset or other parameter
    may follow), or get 415: a form or text/plain body is what a web page can send to any server
    without its consent."""

    def __init__(self, app, routes: Iterable[str]):
        self.app, self.routes = app, frozenset(routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.routes:
            given = dict(scope["headers"]).get(b"content-type", b"")
            if given.partition(b";")[0].strip().lower() != b"application/json":
                what = f"'{given.decode('latin-1')[:100]}'" if given else "no Content-Type"
                err = APIError(
                    415,
                    f"{scope['path']} takes a JSON body and this request has {what}: send the header "
                    "'Content-Type: application/json'",
                    code="unsupported_media_type",
                )
                return await send_error(send, err)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a body over max_bytes with 413: at once from Content-Length, else while reading it
    (chunked uploads); one that has not all arrived within read_timeout seconds with 408 (a
    client that stalls mid-body would hold its connection forever). Then replays the body it read
    to the app."""

    def __init__(self, app, max_bytes: int, read_timeout: float | None = None):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = APIError(
            413,
            f"the request body is over this server's limit of {self.max_bytes} bytes: "
            "send a shorter prompt",
            code="request_too_large",
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await send_error(send, too_large)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        return await send_error(send, too_large)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await send_error(
                send, timeout_error("body", self.read_timeout), [(b"connection", b"close")]
            )
        replayed = [False]

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            # after the body: waits for http.disconnect, as the server's would
            return await receive()

        await self.app(scope, replay, send)
