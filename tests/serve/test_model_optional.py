"""A request body's `model` is optional, as in vLLM: left out, null or "", it is the model
served; another name is still a 404 naming the one served."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.test_server import PROMPTS, client, expected

openai = pytest.importorskip("openai")


def _post(server, route: str, **body) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def test_a_request_without_model_is_answered_by_the_model_served(server, reference, model_dir):
    """Refused with "'model' is required": clients written for vLLM (and curl one-liners) leave
    it out."""
    want = expected(reference, PROMPTS[0], 6)
    for model in ({}, {"model": None}, {"model": ""}):
        r = _post(
            server, "/v1/completions", prompt=PROMPTS[0], max_tokens=6, temperature=0, **model
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model_dir.name and r.json()["choices"][0]["text"] == want
    messages = [{"role": "user", "content": "t5 t6"}]
    named = _post(
        server,
        "/v1/chat/completions",
        model=model_dir.name,
        messages=messages,
        max_tokens=4,
        temperature=0,
    )
    r = _post(server, "/v1/chat/completions", messages=messages, max_tokens=4, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model_dir.name
    assert r.json()["choices"][0]["message"] == named.json()["choices"][0]["message"]
    # Streamed too, and through the openai client, which leaves a field it is not given out of the
    # body.
    stream = client(server).completions.create(
        model=openai.NOT_GIVEN, prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert {ch.model for ch in chunks} == {model_dir.name}
    reply = client(server).chat.completions.create(
        model=openai.NOT_GIVEN, messages=messages, max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content == named.json()["choices"][0]["message"]["content"]


def test_a_wrong_model_name_is_still_a_404_naming_the_model_served(server, model_dir):
    for route, body in (
        ("/v1/completions", {"prompt": "t5"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]}),
    ):
        r = _post(server, route, model="gpt-4", max_tokens=2, **body)
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": f"the model 'gpt-4' does not exist: this server serves '{model_dir.name}'",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    with pytest.raises(openai.NotFoundError) as e:
        # not empty: a name, and not ours
        client(server).completions.create(model=" ", prompt="t5", max_tokens=2)
    assert e.value.code == "model_not_found"
    # a wrong type stays a 400
    r = _post(server, "/v1/completions", model=5, prompt="t5", max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
