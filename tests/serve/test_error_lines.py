"""An error message is one line even where it quotes what the client sent (a model name, a
content part's type, a key of logit_bias): line breaks, other control characters and lone
surrogates come back escaped, so a log line or a terminal shows the message as sent, and the
answer can always be written. Found by tests/serve/test_fuzz.py."""

from __future__ import annotations

import httpx
import pytest

from lmforge.serve.protocol import APIError
from tests.serve.fuzzing import error_message


def test_an_api_error_escapes_line_breaks_control_characters_and_surrogates():
    err = APIError(400, "the model 'a\nb\r\x1b[2J\u2028\x85' does not exist")
    assert err.message == "the model 'a\\nb\\r\\x1b[2J\\u2028\\x85' does not exist"
    assert err.body()["error"]["message"] == err.message
    assert APIError(400, "naïve 日本 \t tab \ud800").message == "naïve 日本 \\t tab \\ud800"
    # outside the BMP, not a surrogate: kept
    assert APIError(400, "\U0001f600").message == "\U0001f600"


@pytest.mark.parametrize(
    "path, body, status, quoted",
    [
        ("/v1/completions", {"prompt": "t5", "model": "gpt\n4"}, 404, "'gpt\\n4'"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "ima\nge"}]}]},
            400,
            "'ima\\nge'",
        ),
        (
            "/v1/completions",
            {"prompt": "t5", "logit_bias": {"5\n6": "x"}},
            400,
            "'logit_bias.5\\n6'",
        ),
    ],
)
def test_a_message_that_quotes_the_request_is_one_line(server, path, body, status, quoted):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert quoted in error_message(r)


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/completions", b'{"prompt": "t5", "model": "\xed\xa0\x80"}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "\xed\xa0\x80"}]}]}',
        ),
    ],
)
def test_a_lone_surrogate_the_message_quotes_is_escaped(server, path, raw):
    """json.loads reads UTF-8-encoded surrogates (ED A0 80) with 'surrogatepass'; quoted back raw
    they made the error answer itself fail to encode (a 500). Escaped, or refused as not UTF-8
    before: a 4xx either way."""
    r = httpx.post(
        server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code in (400, 404), r.text
    error_message(r)
