"""The HTTP/1.1 server under the app: uvicorn's h11 protocol with a read timeout, and the uvicorn
settings.

uvicorn closes a kept-alive connection that idles after a response (`timeout_keep_alive`), but
starts no clock before a request's headers: a connection that sends nothing, or its headers a byte
at a time (each byte resets the keep-alive timer), is held forever, and enough of them exhaust the
server's file descriptors. Here the headers must be complete within `read_timeout` of a request's
first byte (of the connection, for the first request); otherwise the server answers 408 and closes,
as nginx's client_header_timeout does. The body gets the same time again (BodyLimitMiddleware).
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmforge.serve.middleware import timeout_error


class TimedH11Protocol(H11Protocol):
    """H11Protocol whose request headers must arrive within `read_timeout` seconds (set by
    `protocol_class`)."""

    read_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Clock on while a request's headers are awaited (h11's IDLE), off once they are in."""
        if self.conn.their_state is h11.IDLE:
            # After a response, an idle connection is uvicorn's keep-alive timer's; its first byte
            # starts ours.
            if (
                self._header_timer is None
                and self.timeout_keep_alive_task is None
                and not self.transport.is_closing()
            ):
                self._header_timer = self.loop.call_later(self.read_timeout, self._headers_too_slow)
        else:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        # No request was parsed, so h11 cannot write the response: the bytes are written directly.
        body = json.dumps(timeout_error("headers", self.read_timeout).body()).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def protocol_class(read_timeout: float) -> type[TimedH11Protocol]:
    """uvicorn builds the protocol itself (Config.http takes a class), so the timeout travels in
    a subclass."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": read_timeout})


def uvicorn_config(app, read_timeout: float, keep_alive_timeout: float, **kwargs) -> uvicorn.Config:
    """uvicorn's settings for lmforge serve (and its tests): h11 with the read timeout, the
    keep-alive timeout."""
    return uvicorn.Config(
        app,
        http=protocol_class(read_timeout),
        timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type]
        ws="none",
        **kwargs,
    )
