"""Property-based fuzzing of every route of `lmforge serve` from the schema the server admits
(tests/serve/fuzzing.py): no request gets a 5xx, every error is a one-line error object, a stream
ends in [DONE] without an error event, and afterwards the server answers /health, holds no engine
rows, and still gives the same greedy answer.

schemathesis writes the cases (its positive mode: bodies the schema admits; its negative mode:
bodies it does not), each run derandomized: it generated them twice as fast as hypothesis-jsonschema
over the same schemas, and reaches the boundaries (5e-324 above an exclusive minimum of 0) sooner.
The app runs in-process (starlette's TestClient, its lifespan starting the engine), a request a few
milliseconds, over a random-weights model whose limits keep every generation short.
LMFORGE_FUZZ_EXAMPLES sets the examples per route and mode (default 50, ~20 s on 2 cores; 2000 for a
long local run, ~10 min).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from functools import cache

import pytest

from tests.serve.conftest import WORDS
from tests.serve.fuzzing import HEADERS, check_answer, openapi_document, reachable

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("LMFORGE_FUZZ_EXAMPLES", "50"))
GREEDY = {"prompt": "t5 t17 t33", "max_tokens": 8, "temperature": 0}
BODY_ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/invocations",
    "/tokenize",
    "/detokenize",
]
GET_ROUTES = ["/v1/models", "/v1/models/{name}", "/health", "/ping", "/metrics", "/"]
# positive: bodies the schema admits, as written; reachable: the same, past the refusals to the
# engine (and streamed when it can be); negative: bodies the schema does not admit.
CASES = [(path, mode) for path in BODY_ROUTES for mode in ("positive", "reachable", "negative")] + [
    (path, "positive") for path in GET_ROUTES
]


@cache
def operations() -> dict[tuple[str, str], object]:
    schema = schemathesis.openapi.from_dict(openapi_document())
    return {
        (op.method.upper(), op.path): op
        for op in (result.ok() for result in schema.get_all_operations())
    }


def strategy(path: str, mode: str, served: str):
    method = "POST" if path in BODY_ROUTES else "GET"
    op = operations()[(method, path)]
    modes = schemathesis.GenerationMode
    cases = op.as_strategy(generation_mode=modes.NEGATIVE if mode == "negative" else modes.POSITIVE)
    if mode != "reachable":
        return cases
    vocab = len(WORDS)

    def edit(case, stream):
        case.body = reachable(path, case.body, served, vocab, stream)
        return case

    return st.builds(edit, cases, st.booleans())


@pytest.fixture(scope="module")
def app_client(model_dir):
    from starlette.testclient import TestClient

    from lmforge.inference.engine import Engine, EngineConfig
    from lmforge.models import load_pretrained
    from lmforge.serve.app import create_app
    from lmforge.serve.chat import ChatFormat
    from lmforge.serve.server import ServeConfig
    from lmforge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    engine = Engine(load_pretrained(model_dir), tokenizer, EngineConfig(max_batch=4))
    # Short generations and few choices: a case is milliseconds, and the limits themselves get
    # fuzzed.
    config = ServeConfig(model_dir.name, max_tokens_limit=8, max_choices=4)
    app = create_app(engine, tokenizer, ChatFormat(tokenizer, model_dir), config)
    # raise_server_exceptions=False: a handler's crash is seen as the 500 a client gets, not raised
    # here.
    with TestClient(app, base_url="http://127.0.0.1:8000", raise_server_exceptions=False) as client:
        client.engine = engine
        client.greedy = client.post("/v1/completions", json=GREEDY, headers=HEADERS).json()[
            "choices"
        ][0]["text"]
        yield client


def send(client, case):
    body = None if isinstance(case.body, schemathesis.core.NotSet) else case.body
    # Negative mode writes some bodies as raw bytes (not JSON at all): sent as they are.
    content = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    r = client.request(
        case.method,
        case.formatted_path,
        params=case.query or None,
        content=content,
        headers=HEADERS,
    )
    return body, r


def assert_still_serving(client) -> None:
    r = client.get("/health", headers=HEADERS)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    deadline = time.monotonic() + 10
    while client.engine.running or client.engine.queued:  # rows are freed at the engine's next step
        assert time.monotonic() < deadline, (
            "engine rows still held after every request was answered"
        )
        time.sleep(0.01)
    r = client.post("/v1/completions", json=GREEDY, headers=HEADERS)
    assert r.json()["choices"][0]["text"] == client.greedy


def test_the_document_covers_every_route(app_client):
    from fastapi.routing import APIRoute

    served = {
        (m, r.path.replace("{name:path}", "{name}"))
        for r in app_client.app.routes
        if isinstance(r, APIRoute)
        for m in r.methods
    }
    assert served == set(operations())


@pytest.mark.slow
@pytest.mark.parametrize("path, mode", CASES)
def test_no_request_gets_a_server_error(app_client, model_dir, path, mode):
    seen = Counter()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy(path, mode, model_dir.name))
    def fuzz(case):
        body, r = send(app_client, case)
        seen[r.status_code // 100] += 1
        check_answer(case.method, case.formatted_path, body, r)

    fuzz()
    assert seen, "no request was sent"
    if mode == "reachable":  # the edits get some of these past every refusal to an answer
        assert seen[2] > 0, seen
    assert_still_serving(app_client)
