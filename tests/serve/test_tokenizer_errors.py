"""A tokenizer that fails on a request's text (the `tokenizers` library panics: its pyo3
PanicException derives from BaseException, so `except Exception` misses it) answers that request
with OpenAI's error object and a 400, not a plain-text 500, and the server goes on serving."""

from __future__ import annotations

import shutil

import httpx
import pytest
from tokenizers import Regex, pre_tokenizers

from tests.serve.conftest import serve, word_tokenizer

# Catastrophic backtracking: oniguruma gives up past its retry limit and the Rust wrapper panics.
BACKTRACKS = "(t|tt)+x"
TRIGGER = "t" * 60


@pytest.fixture(scope="module")
def panicky(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("panicky") / "tiny-neox"
    shutil.copytree(model_dir, folder)
    tok = word_tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(BACKTRACKS), "isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    tok.save(str(folder / "tokenizer.json"))
    with serve(folder) as s:
        yield s


def _error(r: httpx.Response) -> dict:
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": TRIGGER, "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": TRIGGER}], "max_tokens": 2},
        ),
        ("/invocations", {"inputs": TRIGGER, "parameters": {"max_new_tokens": 2}}),
    ],
)
def test_a_tokenizer_panic_is_the_requests_400(panicky, path, body):
    r = httpx.post(panicky.url + path, json=body, timeout=60)
    # /invocations answers in TGI's shape: 422 for a bad input
    assert r.status_code in (400, 422), r.text
    if path == "/invocations":
        assert r.json()["error_type"] == "validation" and "tokenizer" in r.json()["error"]
        return
    err = _error(r)
    assert (
        r.status_code == 400
        and "tokenizer" in err["message"]
        and err["type"] == "invalid_request_error"
    )
    ok = httpx.post(
        panicky.url + "/v1/completions", json={"prompt": "t5 t6", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200
