"""The fuzz tests' 5xx (tests/serve/test_fuzz.py, shrunk by hypothesis): sampling values the
schema admits that turn the float32 logits into inf and NaN, and sampling fails (a 500, or an
error event inside a streamed 200): a temperature or repetition_penalty > 0 but below float32's
smallest normal number (~1.2e-38), and on TGI's /invocations (whose temperature has no upper
bound) a huge temperature with a huge repetition_penalty. Whether the server answers such values
or refuses them with a 400 is its choice; a server error is not."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.fuzzing import HEADERS, check_answer

CHAT = [{"role": "user", "content": "t5 t17"}]
TGI = {"max_new_tokens": 4, "do_sample": True}  # TGI decodes greedily unless asked


@pytest.mark.parametrize("value", [5e-324, 1e-300, 1e-40])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "t5 t17", "max_tokens": 4, "temperature": "VALUE"}),
        ("/v1/completions", {"prompt": "t5 t17", "max_tokens": 4, "repetition_penalty": "VALUE"}),
        (
            "/v1/completions",
            {"prompt": "t5 t17", "max_tokens": 4, "repetition_penalty": "VALUE", "stream": True},
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "repetition_penalty": "VALUE"},
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "temperature": "VALUE", "stream": True},
        ),
        ("/invocations", {"inputs": "t5 t17", "parameters": {**TGI, "temperature": "VALUE"}}),
        (
            "/invocations",
            {"inputs": "t5 t17", "parameters": {**TGI, "repetition_penalty": "VALUE"}},
        ),
    ],
    ids=[
        "temperature",
        "repetition_penalty",
        "repetition_penalty-stream",
        "chat-repetition_penalty",
        "chat-temperature-stream",
        "tgi-temperature",
        "tgi-repetition_penalty",
    ],
)
def test_a_tiny_positive_sampling_value_is_no_server_error(server, path, body, value):
    def filled(d):
        return {
            k: value if v == "VALUE" else filled(v) if isinstance(v, dict) else v
            for k, v in d.items()
        }

    post(server, path, filled(body))


@pytest.mark.parametrize("value", [3.4028235677973366e38, 1e300])  # both inf as float32
def test_a_huge_tgi_temperature_with_a_huge_repetition_penalty_is_no_server_error(server, value):
    post(
        server,
        "/invocations",
        {
            "inputs": "t5 t17",
            "parameters": {**TGI, "temperature": value, "repetition_penalty": value},
        },
    )


def post(server, path: str, body: dict) -> None:
    r = httpx.post(
        server.url + path,
        json=body,
        headers={**HEADERS, "host": f"127.0.0.1:{server.port}"},
        timeout=60,
    )
    check_answer("POST", path, body, r)
