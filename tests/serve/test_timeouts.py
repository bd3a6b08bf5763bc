"""Slow and idle connections are let go: a request's headers and then its body must each arrive
within --read-timeout, and a kept-alive connection with no next request closes after
--keep-alive-timeout. Asserted on what the server does (a 408, a closed socket), never on how
long it took."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serve.conftest import serve, slowed

GIVE_UP = 60  # seconds a test waits for the server before calling the connection held forever


@pytest.fixture(scope="module")
def strict(model_dir):
    with serve(model_dir, read_timeout=1.0, keep_alive_timeout=1.0) as s:
        yield s


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(GIVE_UP)
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout here fails the
    test)."""
    got = b""
    while part := sock.recv(65536):
        got += part
    return got


def test_a_connection_that_sends_nothing_is_closed(strict):
    with _connect(strict) as sock:
        reply = _until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_headers_sent_a_byte_at_a_time_are_cut_off(strict):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 10_000
    with _connect(strict) as sock:
        deadline = time.monotonic() + GIVE_UP
        closed = False
        for byte in head:  # a slowloris: each byte well inside any idle timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() > deadline:
                break
        reply = b"" if closed else _until_closed(sock)
    assert closed or reply.startswith(b"HTTP/1.1 408 ")


def test_a_body_that_stalls_gets_408(strict, model_dir):
    body = json.dumps({"model": model_dir.name, "prompt": "t5", "max_tokens": 2}).encode()
    with _connect(strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10])
        )
        reply = _until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_an_idle_kept_alive_connection_is_closed_and_requests_still_work(strict, model_dir):
    with _connect(strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = _until_closed(sock)  # the answer, then the close once the connection idles
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.count(b"HTTP/1.1") == 1
    # A client that keeps its connection busy is not cut off, and a stream longer than the timeouts
    # runs on.
    with httpx.Client(base_url=strict.url) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
        body = {
            "model": model_dir.name,
            "prompt": "t5",
            "max_tokens": 60,
            "temperature": 0,
            "stream": True,
            "stop": ["never"],
        }  # greedy from t5: 60 tokens, no eos
        with slowed(strict.engine, 0.04), c.stream("POST", "/v1/completions", json=body) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert (
        events[-1] == "data: [DONE]"
        and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    )
