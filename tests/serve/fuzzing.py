"""What the fuzz and hostile-body tests share: the OpenAPI document of the server's routes, built
from the request models the server validates with (lmforge.serve.protocol), and the properties every
answer must have.

lmforge serves no /openapi.json (create_app: openapi_url=None), and its POST routes read the raw
body, so FastAPI's own schema of them would hold no request bodies: the document here is the schema
the server admits.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from lmforge.serve.protocol import ChatRequest, CompletionRequest, TGIRequest
from lmforge.serve.tokenize import DetokenizeRequest, TokenizeRequest

JSON_ROUTES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
# The headers a real client sends: a JSON content type and the server's own address as Host.
HEADERS = {"content-type": "application/json", "host": "127.0.0.1:8000"}


def _nullable_fields(schema: dict) -> dict:
    """parse() reads a top-level null as the field's default (OpenAI's schema has it so): the
    document admits it for every field that has one."""
    required = set(schema.get("required", ()))
    props = {
        name: prop if name in required else {"anyOf": [prop, {"type": "null"}]}
        for name, prop in schema.get("properties", {}).items()
    }
    return {**schema, "properties": props}


def openapi_document() -> dict:
    """OpenAPI 3.1 for every route of lmforge.serve.app: the POST bodies are the protocol models'
    JSON schemas; /invocations takes any of TGI's, a chat and a completion body
    (lmforge.serve.sagemaker)."""
    models = [CompletionRequest, ChatRequest, TGIRequest, TokenizeRequest, DetokenizeRequest]
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas = defs["$defs"]
    for m in models:
        schemas[m.__name__] = _nullable_fields(schemas[m.__name__])
    answered = {"responses": {"default": {"description": "any answer; the tests check its shape"}}}

    def post(*names: str) -> dict:
        refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        return {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                },
                **answered,
            }
        }

    name = {
        "name": "name",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1},
    }
    paths = {
        "/v1/completions": post("CompletionRequest"),
        "/v1/chat/completions": post("ChatRequest"),
        "/invocations": post("TGIRequest", "ChatRequest", "CompletionRequest"),
        "/tokenize": post("TokenizeRequest"),
        "/detokenize": post("DetokenizeRequest"),
        "/v1/models/{name}": {"get": {"parameters": [name], **answered}},
    }
    for path in ("/v1/models", "/health", "/ping", "/metrics", "/"):
        paths[path] = {"get": dict(answered)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "lmforge serve", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def request_model(path: str, body: Any) -> type[BaseModel] | None:
    """The model the server reads `body` with on `path` (sagemaker.invocations' dispatch), or
    None."""
    if path == "/invocations":
        if isinstance(body, dict) and "messages" in body:
            return ChatRequest
        return CompletionRequest if isinstance(body, dict) and "prompt" in body else TGIRequest
    return JSON_ROUTES.get(path)


def tgi_shaped(path: str, body: Any) -> bool:
    """Whether an error on `path` for `body` is answered in TGI's shape ({"error": str,
    "error_type": str})."""
    return request_model(path, body) is TGIRequest


def described(method: str, path: str, body: Any, r) -> str:
    """The request and its answer, to reproduce a failure from."""
    sent = body if isinstance(body, bytes | type(None)) else json.dumps(body)
    return f"{method} {path} -> {r.status_code}: {r.text[:400]}\nbody: {str(sent)[:2000]}"


def error_message(r, tgi: bool = False) -> str:
    """The message of an error answer, checked to be OpenAI's error object (TGI's on
    /invocations' TGI bodies) and one line."""
    data = r.json()
    if tgi and isinstance(data.get("error"), str):
        assert set(data) == {"error", "error_type"} and isinstance(data["error_type"], str), r.text
        message = data["error"]
    else:
        err = data["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["type"], str), (
            r.text
        )
        message = err["message"]
    assert isinstance(message, str) and message.strip() and message.splitlines() == [message], (
        r.text
    )
    return message


def check_stream(r) -> None:
    """A streamed 200: server-sent events of JSON chunks ending in [DONE], none an error (a 500
    in disguise)."""
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", r.text[-400:]
    for event in events[:-2]:
        assert event.startswith("data: {"), event[:200]
        chunk = json.loads(event[6:])
        assert "error" not in chunk, event[:400]


def check_answer(method: str, path: str, body: Any, r) -> None:
    """The property of every answer: no 5xx; errors are one-line error objects; streams end
    cleanly."""
    where = described(method, path, body, r)
    assert r.status_code < 500, where
    if r.status_code >= 400:
        if method != "HEAD":
            error_message(r, tgi=tgi_shaped(path, body))
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(r)
    elif r.headers.get("content-type", "").startswith("application/json"):
        r.json()


def parsed(model: type[BaseModel], body: Any) -> BaseModel | None:
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except (ValidationError, AttributeError):
        return None


def reachable(path: str, body: Any, served: str, vocab: int, stream: bool) -> Any:
    """`body` still admitted by the schema, edited to get past the checks in front of the engine:
    the fields the server refuses by name (the model's own unsupported()) left out, `model` the
    one served, content parts text, token ids inside the vocabulary, whole floats integers (JSON
    Schema's integers, strictly validated as floats); streamed when `stream` (TGI bodies cannot
    be)."""
    model = request_model(path, body)
    if model is None or not isinstance(body, dict):
        return body
    body = _whole_floats_as_ints(body)
    if model is TGIRequest:
        params = body.get("parameters")
        checked = parsed(TGIRequest, body)
        if isinstance(params, dict) and checked is not None:
            body["parameters"] = {
                k: v for k, v in params.items() if k not in checked.parameters.unsupported()
            }
        body.pop("stream", None)
        return body
    body["model"] = served
    if isinstance(body.get("messages"), list):
        body["messages"] = [_text_parts(m) for m in body["messages"]]
    if "prompt" in body:
        body["prompt"] = _in_vocab(body["prompt"], vocab)
    if model in (TokenizeRequest, DetokenizeRequest):  # no engine behind them, nothing refused
        if isinstance(body.get("tokens"), list):
            body["tokens"] = _in_vocab(body["tokens"], vocab)
        return body
    checked = parsed(model, body)
    for name in checked.unsupported() if checked is not None else ():
        body.pop(name, None)
    if stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    return body


def _whole_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    return value


def _text_parts(message: Any) -> Any:
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        parts = [{**p, "type": "text"} if isinstance(p, dict) else p for p in message["content"]]
        return {**message, "content": parts}
    return message


def _in_vocab(prompt: Any, vocab: int) -> Any:
    if isinstance(prompt, bool):
        return prompt
    if isinstance(prompt, int):
        return prompt % vocab
    if isinstance(prompt, list):
        return [_in_vocab(p, vocab) for p in prompt]
    return prompt
