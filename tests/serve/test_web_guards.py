"""A web page cannot drive a local keyless server: JSON routes take only `Content-Type:
application/json` (a cross-site form or text/plain POST needs no CORS preflight, a JSON one
does), and a Host header that is no name of this server (DNS rebinding: a page's own domain
pointed at 127.0.0.1) is refused with 421. Inside a SageMaker container /invocations takes any
content type and any Host, as the platform sends them."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from lmforge.serve.listen import allowed_hosts
from tests.serve.conftest import serve

BODY = {"prompt": "t5 t6", "max_tokens": 2, "temperature": 0}


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _post(
    server, path: str, content_type: str | None, host: str | None = None, body=BODY
) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    if host is not None:
        headers["host"] = host
    return httpx.post(
        server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=60
    )


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
        "application/jsonx",
    ],
)
def test_a_json_route_refuses_other_content_types(server, content_type):
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        r = _post(server, path, content_type)
        assert r.status_code == 415, (path, r.text)
        err = _error(r)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"],
)
def test_json_with_or_without_a_charset_is_served(server, content_type):
    assert _post(server, "/v1/completions", content_type).status_code == 200


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io"]
)
def test_a_foreign_host_is_refused_on_every_route(server, host):
    host = host.format(port=server.port)
    r = _post(server, "/v1/completions", "application/json", host)
    assert r.status_code == 421
    err = _error(r)
    assert err["code"] == "invalid_host" and "--allowed-hosts" in err["message"]
    for path in ("/health", "/", "/v1/models"):
        assert httpx.get(server.url + path, headers={"host": host}).status_code == 421


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.0.0.1:{port}",
        "localhost",
        "LOCALHOST:{port}",
        "[::1]:{port}",
        "chat.localhost:{port}",
        "192.168.1.20:{port}",
        "[fe80::1]",
    ],
)
def test_local_names_and_addresses_are_served(server, host):
    assert (
        httpx.get(
            server.url + "/health", headers={"host": host.format(port=server.port)}
        ).status_code
        == 200
    )


def test_a_request_without_host_is_served(server):
    """HTTP/1.0 has no Host header; a browser always sends one."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")


def test_allowed_hosts_admit_names(model_dir):
    with serve(model_dir, allowed_hosts=("gpu-box.lan", ".corp.example")) as s:
        for host in ("gpu-box.lan", "GPU-BOX.LAN:8000", "corp.example", "api.corp.example"):
            assert _post(s, "/v1/completions", "application/json", host).status_code == 200, host
        assert _post(s, "/v1/completions", "application/json", "evil.example").status_code == 421
        assert (
            _post(s, "/v1/completions", "application/json", "evilcorp.example").status_code == 421
        )
    with serve(model_dir, allowed_hosts=("*",)) as s:
        assert _post(s, "/v1/completions", "application/json", "evil.example").status_code == 200


def test_the_openai_client_and_the_sagemaker_routes_keep_working(server, model_dir):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert c.completions.create(model=model_dir.name, prompt="t5", max_tokens=2).choices[0].text
    with serve(model_dir, sagemaker=True, allowed_hosts=("*",)) as s:
        host = "model.sagemaker.internal:8080"
        for content_type in ("application/json", "text/csv", "application/octet-stream", None):
            r = _post(
                s,
                "/invocations",
                content_type,
                host,
                {"inputs": "t5", "parameters": {"max_new_tokens": 2}},
            )
            assert r.status_code == 200 and r.json()[0]["generated_text"], (content_type, r.text)
        assert httpx.get(s.url + "/ping", headers={"host": host}).status_code == 200
        # only SageMaker's own route
        assert _post(s, "/v1/completions", "text/plain", host).status_code == 415


def test_the_cli_derives_the_names_from_the_bound_address(monkeypatch):
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    assert allowed_hosts("127.0.0.1", None) == ()
    assert allowed_hosts("my-box", None) == ("my-box", socket.gethostname().lower())
    assert allowed_hosts("127.0.0.1", "a.example, b.example") == ("a.example", "b.example")
    assert socket.gethostname().lower() in allowed_hosts("0.0.0.0", None)
    assert allowed_hosts("127.0.0.1", "*") == ("*",)
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "8080")
    # SageMaker's proxy sends its own Host; the endpoint is behind IAM
    assert allowed_hosts("0.0.0.0", None) == ("*",)
    assert allowed_hosts("0.0.0.0", "a.example") == ("a.example", socket.gethostname().lower())
