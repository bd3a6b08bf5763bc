"""A chat template or a large body cannot freeze the server: templates render in a child process
under a time and an output-size limit (lmforge.chat_sandbox), prompts are tokenized on worker
threads, and /health answers meanwhile. A template's own failures (not only Jinja's) are the
request's 400, in OpenAI's error object."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from lmforge.chat_sandbox import RenderLimits
from tests.serve.conftest import serve

# What the last message says picks the trap; any other message renders plainly.
HOSTILE = (
    "{% macro deeper() %}{{ deeper() }}{% endmacro %}"
    "{% set c = messages[-1]['content'] %}"
    "{% if c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif c == 'zero' %}{{ 1 // (c | length - 4) }}"
    "{% elif c == 'overflow' %}{{ 2.0 ** (c | length * 10000) }}"
    "{% elif c == 'recursion' %}{{ deeper() }}"
    "{% elif c == 'memory' %}{{ 'x' * 2 ** (c | length + 56) }}"
    "{% elif c == 'huge' %}{{ 'x' * 10 ** 7 }}"
    "{% endif %}"
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
)
# seconds /health may take while a hostile request runs (it takes milliseconds alone)
HEALTH_WITHIN = 2.0


@pytest.fixture(scope="module")
def hostile_dir(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile") / "tiny-neox"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(HOSTILE)
    return folder


@pytest.fixture(scope="module")
def hostile(hostile_dir):
    limits = RenderLimits(timeout=3.0, max_chars=1_000_000)
    with serve(hostile_dir, template_limits=limits, max_body_bytes=2 << 20) as s:
        yield s


def _chat(server, content: str, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    return httpx.post(
        server.url + "/v1/chat/completions", json=body, timeout=kw.pop("timeout", 120), **kw
    )


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


class HealthWatch:
    """Asks /health every 0.1 s on its own thread; `slowest` is the longest answer (or wait for
    one) it saw."""

    def __init__(self, server):
        self.url, self.times, self.stop = server.url + "/health", [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                start = time.monotonic()
                assert c.get(self.url).status_code == 200
                self.times.append(time.monotonic() - start)
                time.sleep(0.1)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(90)

    @property
    def slowest(self) -> float:
        return max(self.times)


def test_a_template_loop_is_stopped_at_the_time_limit_and_health_answers_meanwhile(hostile):
    with HealthWatch(hostile) as watch:
        start = time.monotonic()
        r = _chat(hostile, "loop")
        took = time.monotonic() - start
    assert r.status_code == 400, r.text
    err = _error(r)
    assert (
        "3 s" in err["message"]
        and "--template-timeout" in err["message"]
        and err["param"] == "messages"
    )
    assert took < 60  # the loop alone runs for hours
    assert len(watch.times) >= 3 and watch.slowest < HEALTH_WITHIN
    assert _chat(hostile, "t5 t6").status_code == 200  # the next render gets a fresh renderer


@pytest.mark.parametrize(
    "trap, name",
    [
        ("zero", "ZeroDivisionError"),
        ("overflow", "OverflowError"),
        ("recursion", "RecursionError"),
        ("memory", "MemoryError"),
    ],
)
def test_a_template_that_fails_outside_jinja_is_a_400(hostile, trap, name):
    r = _chat(hostile, trap)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert (
        name in err["message"]
        and err["param"] == "messages"
        and err["type"] == "invalid_request_error"
    )


def test_a_render_past_the_size_limit_is_a_400(hostile):
    r = _chat(hostile, "huge")
    assert r.status_code == 400
    assert (
        "1000000 characters" in _error(r)["message"]
        and "--max-template-chars" in _error(r)["message"]
    )


def test_eight_large_chat_bodies_do_not_hold_health(hostile):
    text = "t5 t6 " * 170_000  # ~1 MB each
    results: list[int] = []

    def send():
        results.append(_chat(hostile, text).status_code)

    senders = [threading.Thread(target=send) for _ in range(8)]
    with HealthWatch(hostile) as watch:
        for t in senders:
            t.start()
        for t in senders:
            t.join(300)
    # the prompt is far past the context: context_length_exceeded, each in full
    assert results == [400] * 8
    assert watch.times and watch.slowest < HEALTH_WITHIN


def test_a_client_that_leaves_stops_its_render(hostile_dir):
    """One renderer and a minute's limit: the render of a client that left must be stopped, or
    the next chat waits behind it."""
    with serve(hostile_dir, template_limits=RenderLimits(timeout=60.0, workers=1)) as s:
        with pytest.raises(httpx.ReadTimeout):
            _chat(s, "loop", timeout=1.0)
        start = time.monotonic()
        assert _chat(s, "t5 t6").status_code == 200
        assert time.monotonic() - start < 30


def test_generate_chat_stops_a_hostile_template_in_one_line(hostile_dir, capsys):
    from lmforge.cli import main

    rc = main(
        [
            "generate",
            str(hostile_dir),
            "--chat",
            "--prompt",
            "loop",
            "--template-timeout",
            "1",
            "--max-new-tokens",
            "2",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "--template-timeout" in last
