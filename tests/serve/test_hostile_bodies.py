"""Bodies the request schema does not admit, sent to a real server (uvicorn, h11) as an attacker
would: invalid UTF-8, JSON nested 100,000 deep, number literals past what floats and Python's int
parsing take, NaN and Infinity, duplicate keys, 50 MB, JSON that is not an object, and methods a
route does not serve. None is a server error; each refused one is a 4xx one-line error object
(TGI's shape for /invocations' TGI bodies); and the server answers /health after each."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import serve
from tests.serve.fuzzing import HEADERS, check_answer, error_message

POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/invocations"]
# Every route and the method it serves: the others are 405s, as error objects too.
ROUTES = {
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/invocations": "POST",
    "/v1/models": "GET",
    "/v1/models/x": "GET",
    "/health": "GET",
    "/ping": "GET",
    "/metrics": "GET",
    "/": "GET",
}


@pytest.fixture(scope="module")
def live(model_dir):
    # The default body limit (1 MiB): the 100,000-deep bodies reach the JSON parser.
    with serve(model_dir, max_tokens_limit=8) as s:
        with httpx.Client(
            base_url=s.url, timeout=60, headers={**HEADERS, "host": f"127.0.0.1:{s.port}"}
        ) as c:
            yield c


@pytest.fixture(autouse=True)
def still_serving(live):
    yield
    r = live.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def post(live, path: str, raw: bytes, status: int | None = None) -> httpx.Response:
    r = live.post(path, content=raw)
    check_answer("POST", path, raw, r)
    if status is not None:
        assert r.status_code == status, r.text
    return r


# A string value holding bytes that are not UTF-8, on each route.
TEXT_BODIES = {
    "/v1/completions": b'{"prompt": "t5 %s t6", "max_tokens": 2}',
    "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "t5 %s"}], "max_tokens": 2}',
    "/invocations": b'{"inputs": "t5 %s", "parameters": {"max_new_tokens": 2}}',
}


@pytest.mark.parametrize("path", POST_ROUTES)
def test_invalid_utf8_is_a_400(live, path):
    # an invalid byte, a truncated sequence, an overlong one, one past U+10FFFF
    for bad in (b"\xff\xfe", b"\xc3", b"\xc0\xaf", b"\xf4\x90\x80\x80"):
        assert "utf-8" in error_message(post(live, path, TEXT_BODIES[path] % bad, 400))


@pytest.mark.parametrize("path", POST_ROUTES)
def test_an_encoded_lone_surrogate_is_a_400(live, path):
    """A surrogate written as UTF-8 bytes (ED A0 80 is U+D800) is not UTF-8, but json.loads reads bytes with
    'surrogatepass': a lone surrogate reaches the tokenizer, as a \\ud800 escape would (refused already)."""
    post(live, path, TEXT_BODIES[path] % b"\xed\xa0\x80", 400)


def test_invalid_utf8_in_a_key_is_a_400(live):
    assert "utf-8" in error_message(post(live, "/v1/completions", b'{"pro\xc3mpt": "t5"}', 400))


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"}",
    ],
    ids=["bare", "in-prompt", "in-messages"],
)
def test_json_nested_100k_deep_is_a_400(live, path, raw):
    assert "nested too deeply" in error_message(post(live, path, raw, 400))


def test_huge_number_literals_are_read_or_refused(live):
    # Python's json reads 1e999999 as inf (refused: the fields are finite-only) and rounds a
    # 100,000-digit fraction; a 4000-digit integer is under its 4300-digit limit, and out of range
    # of the seed and the vocabulary
    assert "finite" in error_message(
        post(live, "/v1/completions", b'{"prompt": "t5", "temperature": 1e999999}', 400)
    )
    post(
        live,
        "/v1/completions",
        b'{"prompt": "t5", "max_tokens": 2, "temperature": 0.' + b"3" * 100_000 + b"}",
        200,
    )
    post(live, "/v1/completions", b'{"prompt": "t5", "seed": -' + b"9" * 4000 + b"}", 400)
    post(live, "/v1/completions", b'{"prompt": [' + b"9" * 4000 + b"]}", 400)


@pytest.mark.parametrize("path", POST_ROUTES)
def test_an_integer_literal_past_pythons_digit_limit_is_a_400(live, path):
    """json.loads raises ValueError (not JSONDecodeError) for an integer over
    sys.get_int_max_str_digits() (4300) digits: an unparsable body, not a server error."""
    r = post(live, path, b'{"prompt": "t5", "inputs": "t5", "max_tokens": ' + b"9" * 5000 + b"}")
    assert r.status_code == 400


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"prompt": "t5", "temperature": %s}'),
        ("/v1/completions", b'{"prompt": "t5", "top_p": %s}'),
        ("/v1/completions", b'{"prompt": "t5", "repetition_penalty": %s}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "t5"}], "temperature": %s}',
        ),
        ("/invocations", b'{"inputs": "t5", "parameters": {"temperature": %s, "do_sample": true}}'),
        ("/invocations", b'{"inputs": "t5", "parameters": {"top_p": %s}}'),
        ("/invocations", b'{"inputs": "t5", "parameters": {"repetition_penalty": %s}}'),
    ],
)
def test_nan_and_infinity_literals_are_refused(live, path, body):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        r = post(live, path, body % literal, 422 if path == "/invocations" else 400)
        assert "finite" in error_message(r, tgi=path == "/invocations")


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/completions", b'{"prompt": "t5", "prompt": 5, "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": 5, "prompt": "t5", "max_tokens": 2, "max_tokens": 300}'),
        (
            "/v1/chat/completions",
            b'{"messages": [], "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}',
        ),
        (
            "/invocations",
            b'{"inputs": "t5", "parameters": {"max_new_tokens": 2}, "parameters": {"stop": 5}}',
        ),
    ],
)
def test_duplicate_keys_are_answered_without_a_server_error(live, path, raw):
    post(live, path, raw)


def test_a_50_mb_body_is_a_413(live):
    raw = b'{"prompt": "' + b"t5 " * (50 * 2**20 // 3) + b'"}'
    r = post(live, "/v1/completions", raw, 413)  # refused from its Content-Length
    assert error_message(r).startswith(
        "the request body is over this server's limit of 1048576 bytes"
    )
    # chunked
    r = live.post(
        "/v1/completions", content=(raw[i : i + 2**20] for i in range(0, len(raw), 2**20))
    )
    check_answer("POST", "/v1/completions", raw, r)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path", POST_ROUTES)
def test_json_that_is_not_an_object_is_refused(live, path):
    for raw, kind in [
        (b'[{"prompt": "t5"}]', "list"),
        (b"null", "NoneType"),
        (b'"t5"', "str"),
        (b"5", "int"),
        (b"true", "bool"),
    ]:
        r = post(live, path, raw, 422 if path == "/invocations" else 400)
        assert f"must be a JSON object, not {kind}" in error_message(r, tgi=path == "/invocations")


@pytest.mark.parametrize("path", POST_ROUTES)
def test_what_is_not_json_is_a_400(live, path):
    for raw in (b"", b"{", b'{"prompt": "t5",}', b"\x00" * 16, b'{"prompt": "t5"} {}'):
        assert "not valid JSON" in error_message(post(live, path, raw, 400))


@pytest.mark.parametrize("path", ROUTES)
def test_a_method_a_route_does_not_serve_is_an_error_object(live, path):
    for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - {ROUTES[path]}:
        r = live.request(method, path, content=b"{}")
        check_answer(method, path, b"{}", r)
        assert r.status_code == 405, r.text
