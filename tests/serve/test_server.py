"""The live server through the official openai client: completions, chat, streaming, models, errors,
concurrency and disconnects. Expected texts come from `generate_text` on the same model alone."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from lmforge.errors import UserError
from lmforge.inference import generate_text
from tests.serve.conftest import API_KEY, slowed

JSON = {"content-type": "application/json"}  # what the server reads a body as, and requires
PROMPTS = [
    "t5 t17 t33 t2 t99",
    "t8 t9 t10",
    "t250 t1 t2 t3 t4 t77 t41",
    "t7",
    "t120 t121",
    "t64 t32 t16 t8",
]


def client(server, key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, **kw)


def expected(reference, prompt: str, n: int, **kw) -> str:
    model, tok = reference
    return generate_text(model, tok, [prompt], n, temperature=0, **kw)[0]


def test_completion_matches_generate_alone_with_usage(server, reference, model_dir):
    c = client(server)
    r = c.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == model_dir.name
    assert r.choices[0].text == expected(reference, PROMPTS[0], 12)
    assert r.usage.prompt_tokens == 5
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Several prompts in one request; choices in prompt order.
    r = c.completions.create(model=model_dir.name, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [expected(reference, p, 6) for p in PROMPTS[:3]]


def test_stop_strings_seed_and_n(server, reference, model_dir):
    c = client(server)
    full = expected(reference, PROMPTS[1], 16)
    words = full.split()
    stop = f"{words[3]} {words[4]}"
    r = c.completions.create(
        model=model_dir.name, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    # Seeded sampling is reproducible; the n choices of one request use seed, seed + 1, ...
    kw = dict(
        model=model_dir.name,
        prompt=PROMPTS[2],
        max_tokens=10,
        temperature=1.0,
        extra_body={"top_k": 50},
    )
    one = c.completions.create(seed=7, **kw)
    two = c.completions.create(seed=7, n=2, **kw)
    assert one.choices[0].text == two.choices[0].text
    model, tok = reference
    ref = generate_text(model, tok, [PROMPTS[2]], 10, temperature=1.0, top_k=50, seed=8)[0]
    assert two.choices[1].text == ref


def test_chat_and_streams_match_non_streamed(server, reference, model_dir):
    c = client(server)
    messages = [{"role": "system", "content": "t3 t4"}, {"role": "user", "content": "t5 t6 t7"}]
    r = c.chat.completions.create(
        model=model_dir.name, messages=messages, max_tokens=10, temperature=0
    )
    # The documented fallback format, with "\nUser:" as a stop string.
    prompt = "System: t3 t4\nUser: t5 t6 t7\nAssistant:"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected(reference, prompt, 10, stop=["\nUser:"])
    assert r.usage.prompt_tokens == len(reference[1].encode(prompt))

    stream = c.chat.completions.create(
        model=model_dir.name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        == r.choices[0].message.content
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    )
    assert len(chunks) >= 4  # the text came in pieces, not in one chunk

    done = c.completions.create(
        model=model_dir.name, prompt=PROMPTS[3], max_tokens=8, temperature=0
    )
    pieces = list(
        c.completions.create(
            model=model_dir.name, prompt=PROMPTS[3], max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text


def test_sse_framing(server, model_dir):
    body = {"model": model_dir.name, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert [json.loads(e[6:])["object"] for e in events[:-2]] == ["text_completion"] * (
        len(events) - 2
    )


def test_models(server, model_dir):
    c = client(server)
    assert [m.id for m in c.models.list()] == [model_dir.name]
    assert c.models.list().data[0].max_model_len == 128  # the context, under vLLM's name for it
    page = httpx.get(server.url + "/").text  # the chat page starts from what fits that context
    assert (
        'data-context="128"' in page
        and 'id="max-tokens" type="number" min="1" step="1" value="64"' in page
    )
    assert c.models.retrieve(model_dir.name).id == model_dir.name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_request_errors_are_openai_errors_and_the_server_stays_up(server, model_dir):
    c = client(server)
    name = model_dir.name
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="t5")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="t5", max_tokens=101)  # this server's limit is 100
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        # context 128
        c.completions.create(model=name, prompt=" ".join(["t5"] * 120), max_tokens=20)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=" ".join(["t5"] * 130))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="t5", max_tokens="ten")  # type: ignore[arg-type]
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.param == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="t5", temperature=3)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="t5", suffix="t9")
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=name, prompt=[5, 300])  # a token id outside the vocabulary
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=[], max_tokens=3)
    assert e.value.param == "messages"
    assert c.completions.create(model=name, prompt="t5", max_tokens=2).choices[0].text


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_malformed_bodies_with_httpx(server, model_dir):
    url = server.url
    r = httpx.post(url + "/v1/completions", content=b'{"model": "x", "prompt": ', headers=JSON)
    assert r.status_code == 400 and "JSON" in _error(r)["message"]
    r = httpx.post(url + "/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "object" in _error(r)["message"]
    r = httpx.post(
        url + "/v1/completions", content=b'{"prompt": "' + b"t5 " * 30000 + b'"}', headers=JSON
    )
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit applies while reading
        for _ in range(100):
            yield b"x" * 1000

    r = httpx.post(url + "/v1/completions", content=chunked(), headers=JSON)
    assert r.status_code == 413
    r = httpx.get(url + "/v2/nothing")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and _error(r)
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_health_ping_metrics(server, model_dir):
    parser = pytest.importorskip(
        "prometheus_client.parser", reason="the reference parser of the text format"
    )
    text_string_to_metric_families = parser.text_string_to_metric_families

    assert httpx.get(server.url + "/ping").status_code == 200
    health = httpx.get(server.url + "/health").json()
    assert health["model"] == model_dir.name and health["max_batch"] == 4

    def scrape() -> dict:
        text = httpx.get(server.url + "/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = scrape()
    r = client(server).completions.create(
        model=model_dir.name, prompt=PROMPTS[0], max_tokens=5, temperature=0
    )
    httpx.post(server.url + "/v1/completions", content=b"{", headers=JSON)
    after = scrape()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("lmforge_requests_total", route="/v1/completions", status="200") == 1
    assert delta("lmforge_requests_total", route="/v1/completions", status="400") == 1
    assert delta("lmforge_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("lmforge_completion_tokens_total") == r.usage.completion_tokens
    assert delta("lmforge_request_duration_seconds_count", route="/v1/completions") == 2
    assert delta("lmforge_time_to_first_token_seconds_count", route="/v1/completions") == 1
    assert (
        delta("lmforge_engine_prefills_total") == delta("lmforge_engine_prefilled_rows_total") == 1
    )
    assert (
        after[
            (
                "lmforge_request_duration_seconds_bucket",
                (("le", "+Inf"), ("route", "/v1/completions")),
            )
        ]
        >= 2
    )


def test_sagemaker_invocations(server, reference, model_dir):
    url = server.url + "/invocations"
    r = httpx.post(
        url, json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 6, "details": True}}
    )
    assert r.status_code == 200
    # greedy unless do_sample
    assert r.json()[0]["generated_text"] == expected(reference, PROMPTS[0], 6)
    assert r.json()[0]["details"]["generated_tokens"] <= 6
    r = httpx.post(
        url,
        json={"inputs": PROMPTS[:2], "parameters": {"max_new_tokens": 4, "return_full_text": True}},
    )
    assert [x["generated_text"] for x in r.json()] == [
        p + expected(reference, p, 4) for p in PROMPTS[:2]
    ]
    r = httpx.post(
        url,
        json={"messages": [{"role": "user", "content": "t5"}], "max_tokens": 3, "temperature": 0},
    )
    assert r.json()["object"] == "chat.completion"
    r = httpx.post(url, json={"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == expected(reference, PROMPTS[1], 3)
    r = httpx.post(url, json={"inputs": 5})  # TGI's error shape
    assert (
        r.status_code == 422
        and r.json()["error_type"] == "validation"
        and "'inputs'" in r.json()["error"]
    )


def test_api_key(secured, model_dir):
    with pytest.raises(openai.AuthenticationError) as e:
        client(secured, "wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(secured, "wrong").completions.create(model=model_dir.name, prompt="t5", max_tokens=2)
    assert (
        client(secured, API_KEY)
        .completions.create(model=model_dir.name, prompt="t5", max_tokens=2)
        .choices
    )
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(secured.url + path)
        assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    r = httpx.post(secured.url + "/invocations", json={"inputs": "t5"})
    assert r.status_code == 401
    # open: health checks and the page (its API calls send the key)
    for path in ("/health", "/ping", "/"):
        assert httpx.get(secured.url + path).status_code == 200


def _gate(engine, count: int):
    """Hold the engine until `count` requests wait, so they start in one batch whatever the
    timing."""
    step = engine.step

    def gated():
        if engine.queued < count and engine.running == 0:
            time.sleep(0.005)
            return True
        engine.step = step
        return step()

    engine.step = gated


def test_concurrent_streams_are_batched_and_equal_unbatched(server, reference, model_dir):
    # different lengths: rows free up and waiting requests join mid-decode
    lengths = [30, 8, 20, 12, 25, 16]
    engine = server.engine
    steps, rows, prefills = engine.steps, engine.rows_decoded, engine.prefills

    async def one(c, prompt, n):
        stream = await c.completions.create(
            model=model_dir.name, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(c, p, n) for p, n in zip(PROMPTS, lengths)))

    _gate(engine, len(PROMPTS))
    texts = asyncio.run(main())
    assert texts == [expected(reference, p, n) for p, n in zip(PROMPTS, lengths)]
    # 4 rows decoded together at first
    assert (engine.rows_decoded - rows) / (engine.steps - steps) > 2
    # The 4 requests let in at once were prefilled by one forward; the other 2 as rows freed up.
    assert engine.prefills - prefills <= 3


def _raw_stream(server, body: dict, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return sock


def _track(engine):
    """Record the engine requests submitted from now on."""
    seen, submit = [], engine.submit

    def tracked(*a, **kw):
        seen.append(submit(*a, **kw))
        return seen[-1]

    engine.submit = tracked
    return seen, lambda: setattr(engine, "submit", submit)


def test_disconnect_mid_stream_frees_the_row(server, model_dir):
    engine = server.engine
    seen, untrack = _track(engine)
    try:
        with slowed(engine, 0.01):  # ~10 ms a token: the client leaves long before the 100th
            sock = _raw_stream(
                server,
                {
                    "model": model_dir.name,
                    "prompt": "t5 t6",
                    "max_tokens": 100,
                    # only the
                    # client's leaving
                    # ends it
                    "stream": True,
                    "ignore_eos": True,
                },
            )
            got = b""
            while b"data: " not in got:  # the headers come first, then the first token's event
                got += sock.recv(4096)
            sock.close()
            deadline = time.monotonic() + 30
            while seen[0].finish_reason is None and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        untrack()
    assert seen[0].finish_reason == "cancelled" and len(seen[0].output_ids) < 100
    assert httpx.get(server.url + "/health").json()["running"] == 0


def test_a_client_that_does_not_read_blocks_nobody(server, model_dir, reference):
    # 8 choices x 100 tokens (~190 kB of events) into a 2 kB receive buffer, left unread: the
    # server's writes to it stall, while the engine and the other clients go on.
    engine = server.engine
    seen, untrack = _track(engine)
    try:
        slow = _raw_stream(
            server,
            {
                "model": model_dir.name,
                "prompt": "t9 t8",
                "max_tokens": 100,
                "n": 8,
                "stream": True,
                "stop": ["never"],
            },
            rcvbuf=2048,
        )
        deadline = time.monotonic() + 30
        while len(seen) < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        untrack()
    try:
        others = [None] * 3

        def call(i):
            others[i] = (
                client(server)
                .completions.create(
                    model=model_dir.name, prompt=PROMPTS[i], max_tokens=20, temperature=0
                )
                .choices[0]
                .text
            )

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert others == [expected(reference, p, 20) for p in PROMPTS[:3]]
        deadline = time.monotonic() + 30
        while any(r.finish_reason is None for r in seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        # generated unread
        assert len(seen) == 8 and all(r.finish_reason in ("length", "stop") for r in seen)
        raw = b""
        slow.settimeout(30)
        while part := slow.recv(65536):  # Connection: close, so the stream ends with the connection
            raw += part
        # and nothing was lost
        assert raw.count(b'"finish_reason":"') == 8 and b"data: [DONE]" in raw
    finally:
        slow.close()


def test_hostile_values_are_400_not_500(server, model_dir):
    # Each of these once reached the engine or the tokenizer and came back as a 500.
    url, name = server.url, model_dir.name
    lone = (
        b'{"model": "%s", "messages": [{"role": "user", "content": "t5 \\ud800 t6"}]}'
        % name.encode()
    )
    r = httpx.post(url + "/v1/chat/completions", content=lone, headers=JSON)
    assert r.status_code == 400 and "surrogate" in _error(r)["message"]
    deep = b"[" * 30_000 + b"]" * 30_000  # 60 kB: under the 64 kB limit
    r = httpx.post(url + "/v1/completions", content=deep, headers=JSON)
    assert r.status_code == 400 and "nested" in _error(r)["message"]
    for seed in (2**64, -(2**63) - 1):
        r = httpx.post(
            url + "/v1/completions",
            json={"model": name, "prompt": "t5", "max_tokens": 2, "seed": seed},
        )
        assert r.status_code == 400 and _error(r)["param"] == "seed"
    r = httpx.post(url + "/invocations", json={"inputs": "t5", "parameters": {"seed": 2**64}})
    assert r.status_code == 422 and "'parameters.seed'" in r.json()["error"]
    # Non-finite numbers: JSON has none, but Python's json reads (and writes) NaN and Infinity.
    for field, value in [
        ("temperature", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("top_p", "NaN"),
        ("repetition_penalty", "NaN"),
        ("temperature", "-Infinity"),
    ]:
        body = b'{"model": "%s", "prompt": "t5", "max_tokens": 2, "%s": %s}' % (
            name.encode(),
            field.encode(),
            value.encode(),
        )
        r = httpx.post(url + "/v1/completions", content=body, headers=JSON)
        assert r.status_code == 400 and _error(r)["param"] == field, (field, value)
    r = httpx.post(
        url + "/invocations",
        content=b'{"inputs": "t5", "parameters": {"temperature": Infinity}}',
        headers=JSON,
    )
    assert r.status_code == 422 and "'parameters.temperature'" in r.json()["error"]
    c = client(server)
    assert (
        c.completions.create(model=name, prompt="t5", max_tokens=2, seed=2**63 - 1).choices[0].text
    )


def test_generate_and_serve_follow_one_context_rule(server, reference, model_dir):
    # 40 prompt tokens + 100 new do not fit 128: both refuse, both say 88 would.
    prompt = " ".join(["t5"] * 40)
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=model_dir.name, prompt=prompt, max_tokens=100)
    assert (
        e.value.code == "context_length_exceeded"
        and "lower max_tokens to at most 88" in e.value.message
    )
    with pytest.raises(UserError, match="lower max_new_tokens to at most 88"):
        expected(reference, prompt, 100)
    assert (
        client(server)
        .completions.create(
            model=model_dir.name, prompt=prompt, max_tokens=88, temperature=0, stop=["never"]
        )
        .usage.completion_tokens
        <= 88
    )


def test_one_big_request_does_not_hold_the_others(server, model_dir):
    # 24 prompts in one request, then 3 single requests: the engine (4 rows) serves the requests in
    # turn, so each single gets a row in the first round instead of after the 24 (six rounds later).
    engine, name = server.engine, model_dir.name
    seen, untrack = _track(engine)
    results = {}

    def call(key, prompt):
        results[key] = client(server).completions.create(
            model=name, prompt=prompt, max_tokens=6, temperature=0, stop=["never"]
        )

    try:
        _gate(engine, 27)
        big = threading.Thread(target=call, args=("big", [PROMPTS[i % 6] for i in range(24)]))
        big.start()
        deadline = time.monotonic() + 30
        while len(seen) < 24 and time.monotonic() < deadline:
            time.sleep(0.005)
        singles = [threading.Thread(target=call, args=(i, PROMPTS[i])) for i in range(3)]
        for t in singles:
            t.start()
        for t in [big, *singles]:
            t.join(120)
    finally:
        untrack()
    assert len(results["big"].choices) == 24 and all(len(results[i].choices) == 1 for i in range(3))
    first = min(r.admitted_at_step for r in seen)
    # with seen[0], the first four rows
    assert [r.admitted_at_step - first for r in seen[24:]] == [0, 0, 0]
    # the big one's last started rounds later
    assert max(r.admitted_at_step for r in seen[:24]) - first >= 5 * 5
    # A cap on prompts x n per request (the server's default is 128): above it one 400, nothing
    # queued.
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=["t5"] * 200, max_tokens=2)
    assert e.value.param == "prompt" and "200 choices" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=["t5"] * 10, max_tokens=2, n=16)
    assert e.value.param == "n" and "160 choices" in e.value.message
    assert engine.queued == 0
