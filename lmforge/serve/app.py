"""The ASGI app: OpenAI's completions, chat completions and models routes, SageMaker's /ping and
/invocations, vLLM's /tokenize and /detokenize, /health, /metrics, and the chat page at /, over one
`Server` (lmforge.serve.server)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from html import escape
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from lmforge.inference.engine import Engine
from lmforge.serve.chat import ChatFormat
from lmforge.serve.metrics import MetricsMiddleware
from lmforge.serve.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostCheck,
    HostCheckMiddleware,
    JsonContentTypeMiddleware,
)
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, parse
from lmforge.serve.sagemaker import invocations
from lmforge.serve.server import ServeConfig, Server, error_response, read_json
from lmforge.serve.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)

ROUTES = {
    "/",
    "/health",
    "/ping",
    "/metrics",
    "/invocations",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
}
# POST bodies, read as JSON
JSON_ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/invocations",
    "/tokenize",
    "/detokenize",
}


def create_app(
    engine: Engine, tokenizer, chat: ChatFormat, config: ServeConfig | None = None
) -> FastAPI:
    """The ASGI app. The engine thread starts with the app's lifespan and stops with it."""
    server = Server(engine, tokenizer, chat, config or ServeConfig())
    config, metrics = server.config, server.metrics
    page = Path(__file__).with_name("chat.html").read_text(encoding="utf-8")
    # The page asks for what leaves half the context to the conversation (64 tokens of a 128-token
    # model): a fixed 256 failed the quickstart model's first message.
    page_max_tokens = max(
        1, min(config.default_max_tokens, config.max_tokens_limit, engine.context // 2)
    )
    for key, value in {
        "MODEL": escape(config.model_name),
        "AUTH": "1" if config.api_key else "",
        "CONTEXT": str(engine.context),
        "MAX_TOKENS": str(page_max_tokens),
    }.items():
        page = page.replace("{{" + key + "}}", value)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        # the template's renderers, so that the first chat does not wait for them
        if chat.sandbox is not None:
            await asyncio.to_thread(chat.sandbox.start)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)
            server.prompts.close()
            chat.close()

    app = FastAPI(
        title="lmforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(
            APIError(
                exc.status_code,
                f"{request.method} {request.url.path}: {exc.detail}",
                code="not_found" if exc.status_code == 404 else None,
            )
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(
            APIError(
                500,
                f"internal error ({type(exc).__name__}): see the server log",
                type="server_error",
            )
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await server.prompts.body(
            request, lambda raw: parse(CompletionRequest, read_json(raw))
        )
        return await server.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await server.prompts.body(request, lambda raw: parse(ChatRequest, read_json(raw)))
        return await server.chat_completions(request, body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        server.check_model(name)
        return server.model_card()

    @app.post("/invocations")
    async def invocations_route(request: Request):
        return await invocations(server, request, await server.read_json(request))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(server, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(server, request)

    @app.get("/health")
    async def health():
        body = {
            "status": "ok" if engine.alive else "engine stopped",
            "model": config.model_name,
            "running": engine.running,
            "waiting": engine.queued,
            "max_batch": engine.config.max_batch,
        }
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/ping")
    async def ping():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(
            metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/")
    async def chat_page():
        return HTMLResponse(page)

    # Added last runs first: count everything, then check the Host, the key, the content type, the
    # body size, then route. Inside SageMaker, /invocations takes what its callers send (the
    # platform signs every request).
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, read_timeout=config.read_timeout
    )
    json_routes = JSON_ROUTES - {"/invocations"} if config.sagemaker else JSON_ROUTES
    app.add_middleware(JsonContentTypeMiddleware, routes=json_routes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(HostCheckMiddleware, check=HostCheck(config.allowed_hosts))
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=ROUTES)
    return app
