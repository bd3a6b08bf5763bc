"""ASGI middleware in front of the routes: the API key check and the request-body size and time limits.

Both answer with OpenAI's error object before any route code runs, so an unauthenticated or oversized
request never reaches JSON parsing or the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from lmforge.serve.protocol import APIError

# Routes a load balancer or a person's browser must reach without the key: health checks, and the
# chat page, a static file with a field for the key that its own API calls then send.
OPEN_ROUTES = frozenset({"/health", "/ping", "/"})


def timeout_error(what: str, seconds: float) -> APIError:
    return APIError(408, f"the request's {what} did not arrive within {seconds:g} s: send the whole request at once",
                    code="request_timeout")


async def send_error(send, err: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
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
                err = APIError(401, f"{what}: send the header 'Authorization: Bearer YOUR_KEY'",
                               code="invalid_api_key")
                return await send_error(send, err, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a body over max_bytes with 413: at once from Content-Length, else while reading it
    (chunked uploads); one that has not all arrived within read_timeout seconds with 408 (a client that
    stalls mid-body would hold its connection forever). Then replays the body it read to the app."""

    def __init__(self, app, max_bytes: int, read_timeout: float | None = None):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is over this server's limit of {self.max_bytes} bytes: "
                                  "send a shorter prompt", code="request_too_large")
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
            return await send_error(send, timeout_error("body", self.read_timeout), [(b"connection", b"close")])
        replayed = [False]

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for http.disconnect, as the server's would

        await self.app(scope, replay, send)
