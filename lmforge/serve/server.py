"""What the HTTP routes share: the engine requests behind one HTTP request (`Generation`), the
server state and the OpenAI route handlers (`Server`), and server-sent events that end with the
client.

Each HTTP request turns into one engine request per prompt and choice (`n`); their events come back
on one asyncio queue. A stream is written as server-sent events, `data: {chunk}` ... `data: [DONE]`,
in OpenAI's chunk format. When the client goes away (mid-stream or while waiting for a whole
answer), its engine requests are cancelled and their batch rows freed before the next decode step.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmforge.errors import UserError
from lmforge.inference.engine import Engine, EngineBusy, Event, RequestParams
from lmforge.inference.generate import context_overflow
from lmforge.inference.sampling import SamplingParams
from lmforge.serve.chat import ChatFormat
from lmforge.serve.logprobs import TokenText, chat_content, completion_logprobs
from lmforge.serve.metrics import Metrics
from lmforge.serve.prompts import PromptWork
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest
from lmforge.serve.structured import grammar_of
from lmforge.serve.tools import ToolRequest, call_deltas, template_messages


@dataclass
class ServeConfig:
    model_name: str = "lmforge"  # the id clients pass as `model`
    max_tokens_limit: int = 4096  # the most tokens one request may ask to generate
    default_max_tokens: int = 256  # when a request names no max_tokens (capped by the context left)
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    # prompts x n in one request: each is an engine request, all in the waiting queue
    max_choices: int = 128
    read_timeout: float = 10.0  # seconds a request's headers, and then its body, may take to arrive
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open after a response
    # What a request that leaves temperature, top_k, top_p or repetition_penalty out gets instead of
    # OpenAI's defaults: the model folder's generation_config.json's
    # (lmforge.cli.serve.generation_defaults), as vLLM's --generation-config auto. Keys: those four
    # SamplingParams fields.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # Host names answered to besides addresses and localhost ("*": any;
    # lmforge.serve.middleware.HostCheck), and whether this is a SageMaker container, where
    # /invocations takes any content type.
    allowed_hosts: tuple[str, ...] = ()
    sagemaker: bool = False
    # how tool calls are read from the model's text (lmforge.serve.tool_parsers.PARSERS); None:
    # the format the chat template's markers name
    tool_parser: str | None = None


class Generation:
    """The engine requests behind one HTTP request, read as one stream of (choice index, Event)."""

    def __init__(
        self, engine: Engine, jobs: list[tuple[list[int], RequestParams]], prompt_tokens: int
    ):
        loop = asyncio.get_running_loop()
        self.engine, self.queue, self.requests = engine, asyncio.Queue(), []
        # each prompt once, however many choices it has (OpenAI's usage)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens: dict[int, int] = {}
        try:  # one group: the engine gives this request's rows and other requests' rows in turn
            for i, (ids, params) in enumerate(jobs):
                self.requests.append(
                    engine.submit(ids, params, partial(self._put, loop, i), group=self)
                )
        except UserError as e:
            self.close()
            raise APIError(400, str(e), param="prompt") from None
        except EngineBusy as e:
            self.close()
            raise APIError(
                503,
                f"the server is busy ({e}): retry later",
                type="server_error",
                code="overloaded",
            ) from None

    def _put(self, loop: asyncio.AbstractEventLoop, i: int, event: Event) -> None:
        # called from the engine thread
        loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        left = len(self.requests)
        while left:
            i, event = await self.queue.get()
            self.completion_tokens[i] = event.completion_tokens
            left -= event.finish_reason is not None
            yield i, event

    def close(self) -> None:
        for req in self.requests:
            if req.finish_reason is None:
                self.engine.cancel(req)


class EventStream(StreamingResponse):
    """Server-sent events that stop, and release the engine rows, as soon as the client disconnects:
    it listens for the disconnect while waiting for tokens too, not only when a write fails."""

    def __init__(self, chunks: AsyncIterator[str]):
        super().__init__(
            chunks,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:

                async def stream():
                    with suppress(OSError):  # the client went away during a write
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


# A \uD800-\uDFFF escape: the only way a JSON body yields a lone surrogate, which no tokenizer can
# encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def read_json(raw: bytes):
    """The body as a JSON value, or a 400: not JSON, nested past Python's recursion limit, or
    holding a lone UTF-16 surrogate (valid JSON escapes, but not text: the tokenizer would fail
    on it)."""
    try:
        # Decoded strictly first: json.loads(bytes) lets UTF-8-encoded surrogates (ED A0 80)
        # through.
        data = json.loads(raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw)
        if _SURROGATE_ESCAPE.search(raw):
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(
            400, "the request body is nested too deeply: send a flat OpenAI request body"
        ) from None
    except UnicodeEncodeError as e:
        bad = f"\\u{ord(e.object[e.start]):04x}"
        raise APIError(
            400,
            f"the request body holds a lone UTF-16 surrogate ({bad}) in a string: send text as "
            "UTF-8, or a character outside the BMP as a surrogate pair",
        ) from None
    # an integer literal past Python's digit limit (a UnicodeError is caught above)
    except ValueError as e:
        raise APIError(
            400, f"the request body holds a number Python will not read ({e}): send a shorter one"
        ) from None
    return data


def generation_error(ev) -> APIError:
    """A request's generation that ended in error: a 400 where its own settings caused it, else a
    500."""
    if ev.client_error:
        return APIError(400, f"generation stopped: {ev.error}")
    return APIError(500, f"generation failed: {ev.error}", type="server_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class Server:
    """What the routes share: the engine, the tokenizer, the chat format, the settings and the
    metrics."""

    def __init__(self, engine: Engine, tokenizer, chat: ChatFormat, config: ServeConfig):
        self.engine, self.tokenizer, self.chat, self.config = engine, tokenizer, chat, config
        # parsing, rendering, tokenizing: off the event loop
        self.prompts = PromptWork(tokenizer, chat)
        self.metrics = Metrics()
        self.created = int(time.time())  # /v1/models' `created`: when this server loaded the model
        self.token_text = TokenText(tokenizer)  # logprobs' token strings and bytes

    async def read_json(self, request: Request):
        return await self.prompts.body(request, read_json)

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist: this server serves '{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )

    def max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
        scored: bool = False,
    ) -> int:
        """The tokens to generate for a prompt: as requested if it fits, else a 400 naming the
        limit; 0 only where the prompt is `scored` (echo with logprobs: its own log-probabilities
        are the answer)."""
        limit, context = self.config.max_tokens_limit, self.engine.context
        if requested == 0 and not scored:
            raise APIError(
                400,
                f"{param} is 0: ask for at least 1 token (0 only with echo, on /v1/completions)",
                param=param,
            )
        if requested is not None and requested > limit:
            raise APIError(
                400, f"{param} is {requested}, over this server's limit of {limit}", param=param
            )
        problem = context_overflow(prompt_len, requested, context, param)
        if problem:  # the field to change: the prompt where it alone fills the context
            raise APIError(
                400,
                problem,
                param=param if prompt_len < context else prompt_param,
                code="context_length_exceeded",
            )
        return (
            requested
            if requested is not None
            else min(self.config.default_max_tokens, limit, context - prompt_len)
        )

    def start(
        self,
        prompts: list[list[int]],
        requested: int | None,
        sampling: SamplingParams,
        n: int,
        stop: list[str],
        seed: int | None,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
        skip_special_tokens: bool = True,
        extra: dict | None = None,
    ) -> Generation:
        """The engine requests behind one HTTP request; `extra`: more RequestParams fields
        (request_extras)."""
        extra = extra or {}
        choices = len(prompts) * n
        if choices > self.config.max_choices:
            raise APIError(
                400,
                f"this request asks for {choices} choices ({len(prompts)} prompts x n={n}), over this "
                f"server's limit of {self.config.max_choices}: send fewer in each request",
                param="n" if n > 1 else "prompt",
            )
        jobs = []
        for ids in prompts:
            limit = self.max_tokens(
                requested, len(ids), param, prompt_param, extra.get("prompt_logprobs") is not None
            )
            if extra.get("min_tokens", 0) > limit:
                raise APIError(
                    400,
                    f"min_tokens is {extra['min_tokens']}, over the {param} of {limit}: lower it",
                    param="min_tokens",
                )
            for j in range(n):  # the choices of one seeded request differ from each other
                jobs.append(
                    (
                        ids,
                        RequestParams(
                            limit,
                            sampling,
                            stop,
                            None if seed is None else seed + j,
                            skip_special_tokens,
                            **extra,
                        ),
                    )
                )
        return Generation(self.engine, jobs, sum(len(ids) for ids in prompts))

    async def collect(
        self, request: Request, gen: Generation, route: str, start: float
    ) -> dict[int, dict]:
        """Each choice's text and finish reason once all are done; cancelled if the client
        disconnects."""
        out: dict[int, dict] = {}

        async def consume():
            async for i, ev in gen.events():
                if not out:
                    self.metrics.first_token(route, time.perf_counter() - start)
                choice = out.setdefault(i, {"text": "", "finish_reason": None, "logprobs": []})
                choice["text"] += ev.text
                choice["finish_reason"] = ev.finish_reason
                choice["logprobs"] += ev.logprobs or []
                if ev.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = ev.prompt_logprobs
                if ev.stop_string is not None:
                    choice["stop_string"] = ev.stop_string
                if ev.error:
                    raise generation_error(ev)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gen.close()
            gone.cancel()
            self.metrics.tokens(gen.prompt_tokens, sum(gen.completion_tokens.values()))
        if not work.done():
            work.cancel()
            raise APIError(499, "the client closed the connection")
        work.result()  # raises what consume raised
        return out

    async def chunks(
        self,
        gen: Generation,
        include_usage: bool,
        make_chunk,
        route: str,
        start: float,
        role_chunk=None,
    ) -> AsyncIterator[str]:
        """A generation as server-sent events; make_chunk(index, event) -> chunk, (None, None) ->
        the head."""
        started: set[int] = set()
        # logprobs of tokens whose text is held back: sent with the next chunk
        held: dict[int, list] = {}
        try:
            async for i, ev in gen.events():
                if not started:
                    self.metrics.first_token(route, time.perf_counter() - start)
                if role_chunk is not None and i not in started:
                    yield _sse(role_chunk(i))
                started.add(i)
                if ev.error:
                    yield _sse(generation_error(ev).body())
                    return
                if ev.logprobs:
                    held.setdefault(i, []).extend(ev.logprobs)
                if ev.text or ev.finish_reason or ev.prompt_logprobs is not None:
                    ev.logprobs = held.pop(i, None)
                    made = make_chunk(i, ev)  # a chunk, or several (a tool call's)
                    for chunk in made if isinstance(made, list) else [made]:
                        yield _sse(chunk)
            if include_usage:
                yield _sse({**make_chunk(None, None), "choices": [], "usage": usage(gen)})
            yield "data: [DONE]\n\n"
        finally:
            gen.close()
            self.metrics.tokens(gen.prompt_tokens, sum(gen.completion_tokens.values()))

    # ------------------------------------------------------------------ OpenAI routes

    async def completions(self, request: Request, body: CompletionRequest):
        start, route = time.perf_counter(), "/v1/completions"
        if body.model:  # none or "": the model served, as vLLM reads a body's `model`
            self.check_model(body.model)
        texts = body.prompts()
        prompts = await self.prompts.texts(request, texts)
        if not prompts:
            raise APIError(400, "no prompt given", param="prompt")
        requested, param = body.requested_tokens()
        extra = self.request_extras(body, body.logprobs)
        extra["grammar"] = await grammar_of(self.engine, body)
        # the prompt's tokens scored too: what an evaluator sends (with max_tokens 0 or 1)
        if body.echo:
            extra["prompt_logprobs"] = body.logprobs or 0
        gen = self.start(
            prompts,
            requested,
            sampling_of(body, self.config.sampling_defaults),
            body.n,
            body.stop,
            body.seed,
            param,
            skip_special_tokens=body.skip_special_tokens,
            extra=extra,
        )
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
        }

        def echoed(i: int) -> str:  # the prompt as sent (token ids: their text)
            p = texts[i // body.n]
            return p if isinstance(p, str) else self.tokenizer.decode(p)

        offsets: dict[int, int] = {}

        def logprobs(i: int, prompt: list | None, tokens: list | None) -> dict | None:
            if body.logprobs is None:
                return None
            out, offsets[i] = completion_logprobs(
                self.token_text, [*(prompt or []), *(tokens or [])], offsets.get(i, 0)
            )
            return out

        if body.stream:

            def chunk(i, ev):
                if i is None:
                    return dict(head)
                text = (
                    (echoed(i) if ev.prompt_logprobs is not None else "")
                    + ev.text
                    + kept_stop(body, ev.stop_string)
                )
                return {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "text": text,
                            "logprobs": logprobs(i, ev.prompt_logprobs, ev.logprobs),
                            "finish_reason": ev.finish_reason,
                        }
                    ],
                }

            return EventStream(self.chunks(gen, body.include_usage, chunk, route, start))
        out = await self.collect(request, gen, route, start)
        choices = [
            {
                "index": i,
                "text": (echoed(i) if body.echo else "")
                + c["text"]
                + kept_stop(body, c.get("stop_string")),
                "logprobs": logprobs(i, c.get("prompt_logprobs"), c["logprobs"]),
                "finish_reason": c["finish_reason"],
            }
            for i, c in sorted(out.items())
        ]
        return {**head, "choices": choices, "usage": usage(gen)}

    def request_extras(self, body, logprobs: int | None) -> dict:
        """The RequestParams fields a body sets beyond sampling_of's: penalties, logit_bias, stop
        ids, logprobs."""
        vocab = self.engine.model.config.vocab_size
        for name, ids in (
            ("logit_bias", body.logit_bias or ()),
            ("stop_token_ids", body.stop_token_ids or ()),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400,
                    f"invalid value for '{name}': token id {bad[0]} is outside this model's "
                    f"vocabulary [0, {vocab})",
                    param=name,
                )
        return {
            "frequency_penalty": body.frequency_penalty,
            "presence_penalty": body.presence_penalty,
            "logit_bias": body.logit_bias,
            "min_tokens": body.min_tokens,
            "stop_token_ids": tuple(body.stop_token_ids or ()),
            "ignore_eos": body.ignore_eos,
            "logprobs": logprobs,
            "cache_salt": body.cache_salt,
        }

    async def chat_completions(self, request: Request, body: ChatRequest):
        start, route = time.perf_counter(), "/v1/chat/completions"
        if body.model:  # none or "": the model served, as vLLM reads a body's `model`
            self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = ToolRequest.of(body, self.chat, self.config.tool_parser)
        ids = await self.prompts.chat_ids(
            request, template_messages(body), tools.tools if tools else None
        )
        requested, param = body.requested_tokens()
        extra = self.request_extras(body, (body.top_logprobs or 0) if body.logprobs else None)
        extra["grammar"] = (
            await tools.grammar(self.engine, body)
            if tools and tools.forced
            else await grammar_of(self.engine, body)
        )
        # a format whose marker is a special token needs it in the text to read the call
        keep_specials = tools is not None and tools.parser and tools.parser.needs_special_tokens
        gen = self.start(
            [ids],
            requested,
            sampling_of(body, self.config.sampling_defaults),
            body.n,
            [*body.stop, *self.chat.stop],
            body.seed,
            param,
            "messages",
            body.skip_special_tokens and not keep_specials,
            extra,
        )

        def logprobs(entries: list | None) -> dict | None:
            return (
                {"content": chat_content(self.token_text, entries or [])} if body.logprobs else None
            )

        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.config.model_name,
        }
        if body.stream:
            head["object"] = "chat.completion.chunk"
            streams = {}
            called: set[int] = set()

            def delta_chunk(i, delta, logprobs=None, finish_reason=None):
                choice = {"index": i, "delta": delta, "logprobs": logprobs}
                return {**head, "choices": [{**choice, "finish_reason": finish_reason}]}

            def chunk(i, ev):
                if i is None:
                    return dict(head)
                text = ev.text + kept_stop(body, ev.stop_string)
                reading = streams.setdefault(i, tools.stream()) if tools else None
                if reading is None:
                    delta = {"content": text} if text else {}
                    return delta_chunk(i, delta, logprobs(ev.logprobs), ev.finish_reason)
                content, calls = reading.feed(text, ev.finish_reason is not None)
                out = (
                    [delta_chunk(i, {"content": content}, logprobs(ev.logprobs))] if content else []
                )
                out += [
                    delta_chunk(i, {"tool_calls": d})
                    for d in call_deltas(reading.calls - len(calls), calls)
                ]
                if calls:
                    called.add(i)
                if ev.finish_reason is not None:
                    reason = (
                        "tool_calls"
                        if i in called and ev.finish_reason == "stop"
                        else ev.finish_reason
                    )
                    out.append(delta_chunk(i, {}, None, reason))
                return out

            def role(i):
                return delta_chunk(i, {"role": "assistant", "content": ""})

            return EventStream(self.chunks(gen, body.include_usage, chunk, route, start, role))
        out = await self.collect(request, gen, route, start)
        choices = []
        for i, c in sorted(out.items()):
            text = c["text"] + kept_stop(body, c.get("stop_string"))
            content, calls = tools.read(text) if tools else (text, [])
            message = {"role": "assistant", "content": content}
            reason = c["finish_reason"]
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs(c["logprobs"]),
                    "finish_reason": reason,
                }
            )
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage(gen)}

    def model_card(self) -> dict:
        # max_model_len: the tokens a request may hold, prompt and completion (vLLM's field for it).
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "lmforge",
            "max_model_len": self.engine.context,
        }


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "min_p")


def sampling_of(body, defaults: dict[str, float | int] | None = None) -> SamplingParams:
    """The body's sampling fields; one it left out (or sent as null) is the server's default
    where it has one (`defaults`: the model folder's), else OpenAI's. A request's temperature 0
    is greedy whatever the defaults."""
    values = {
        name: getattr(body, name)
        if name in body.model_fields_set
        else (defaults or {}).get(name, getattr(body, name))
        for name in SAMPLING_FIELDS
    }
    return SamplingParams(**values)


def kept_stop(body, stop_string: str | None) -> str:
    """The stop string that ended a choice, to append to its text where the request asks (vLLM's
    include_stop_str_in_output): only one of the request's own, not those the chat format adds."""
    return (
        stop_string
        if stop_string and body.include_stop_str_in_output and stop_string in body.stop
        else ""
    )


def usage(gen: Generation) -> dict:
    completion = sum(gen.completion_tokens.values())
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": gen.prompt_tokens + completion,
    }
