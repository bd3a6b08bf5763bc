"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, and the
calls and results in a chat's history.

The tools are rendered by the model's chat template, passed as transformers'
apply_chat_template(tools=...) passes them (the request's {"type": "function", "function": {...}}
objects as sent). An assistant message's calls reach the template as transformers' chat format has
them, each call's arguments an object (OpenAI sends a JSON text: it is read, as vLLM does for the
Hermes and Llama templates), and a tool message keeps its tool_call_id.

The answer is read by the parser of the model's own format (lmforge.serve.tool_parsers): the one the
template's markers name, or `serve --tool-parser`. `tool_choice`: "auto" (the default with tools)
reads calls where the model writes them; "none" reads none (the tools are still rendered, as vLLM
does); "required" and a named function constrain decoding to the format (lmforge.inference.grammar):
an answer that is nothing but calls, each naming an offered function (the named one) with
arguments that validate against its `parameters`. `parallel_tool_calls: false` keeps one call (one
in the grammar too).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from functools import partial

from lmforge.errors import UserError
from lmforge.inference.grammar import CompiledGrammar
from lmforge.serve.protocol import APIError, ChatRequest
from lmforge.serve.tool_parsers import (
    PARSERS,
    ToolParser,
    ToolStream,
    parser_named,
    parser_of_template,
)

# A forced call's JSON: one space after ':' and ',', as the formats' own examples write it
# (json.dumps's defaults), and no other whitespace.
CALL_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_messages(body: ChatRequest) -> list[dict]:
    """The request's messages as the chat template reads them; a 400 naming a malformed call or
    result."""
    out = []
    for i, m in enumerate(body.messages):
        msg = {"role": m.role, "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id or call_id(),
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments, i, k),
                    },
                }
                for k, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError(
                    400,
                    f"messages.{i} is a tool result without 'tool_call_id': name the call it answers",
                    param=f"messages.{i}.tool_call_id",
                )
            msg["tool_call_id"] = m.tool_call_id
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out


def _arguments(arguments: str | dict, i: int, k: int) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        value = e
    if not isinstance(value, dict):
        raise APIError(
            400,
            f"messages.{i}.tool_calls.{k}.function.arguments is not a JSON object text: send the "
            "arguments as OpenAI returns them",
            param=f"messages.{i}.tool_calls.{k}.function.arguments",
        )
    return value


@dataclass
class ToolRequest:
    """A chat request's tools: what the template renders, how the answer is read, what is
    forced."""

    tools: list[dict]  # as the template gets them
    parser: ToolParser | None  # None: tool_choice "none" (nothing read)
    names: set[str]  # the functions a call may name
    forced: bool  # "required" or a named function: decoding constrained
    parallel: bool

    @classmethod
    def of(cls, body: ChatRequest, chat, parser_name: str | None) -> ToolRequest | None:
        """None where the request has no tools; a 400 naming the field that cannot be served."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(
                    400, "tool_choice needs tools: send the functions too", param="tool_choice"
                )
            return None
        if chat.chat is None:
            raise APIError(
                400,
                "this model has no chat template, so tools cannot be shown to it: serve a model "
                "whose chat template renders tools",
                param="tools",
            )
        tools = body.tools
        offered = [t["function"]["name"] for t in tools]
        if len(set(offered)) < len(offered):
            raise APIError(400, "two tools have the same function name", param="tools")
        names = set(offered)
        if choice is not None and not isinstance(choice, str):
            name = choice.function.get("name")
            if name not in names:
                raise APIError(
                    400,
                    f"tool_choice names the function '{name}', which is not in tools",
                    param="tool_choice",
                )
            names = {name}
        if choice == "none":
            return cls(tools, None, names, False, body.parallel_tool_calls)
        name = parser_name or parser_of_template(chat.chat.source)
        if name is None:
            raise APIError(
                400,
                "the model's chat template writes no tool-call format lmforge reads (<tool_call>, "
                "<|python_tag|>, [TOOL_CALLS]): start the server with --tool-parser "
                f"{'|'.join(PARSERS)}",
                param="tools",
            )
        forced = choice not in (None, "auto")
        return cls(tools, parser_named(name), names, forced, body.parallel_tool_calls)

    def call_schema(self, body: ChatRequest) -> dict:
        """The JSON Schema of one call object in the parser's format: any offered function (the
        named one) with its parameters."""
        key = "parameters" if self.parser.name == "llama3_json" else "arguments"
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    key: t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in self.tools
            if t["function"]["name"] in self.names
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": CALL_JSON}

    async def grammar(self, engine, body: ChatRequest) -> CompiledGrammar:
        """The forced format's grammar, compiled off the event loop; a 400 naming a parameters
        schema llguidance cannot enforce."""
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(
                400,
                "response_format cannot be used with a tool_choice that forces a call: leave one out",
                param="response_format",
            )
        if body.ignore_eos:
            raise APIError(
                400,
                "ignore_eos cannot be used with a tool_choice that forces a call: leave one out",
                param="ignore_eos",
            )
        return await asyncio.to_thread(self._compile, engine, body)

    def _compile(self, engine, body: ChatRequest) -> CompiledGrammar:
        try:
            lark = self.parser.grammar(
                self.call_schema(body), self.parallel, partial(marker_token, engine)
            )
            return engine.grammars.compile_lark(lark, "tools")
        except UserError as e:
            raise APIError(400, str(e), param="tools") from None

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer: content None where calls leave no text."""
        if self.parser is None:
            return text, []
        reading = self.parser.parse(text, True, self.names)
        calls = reading.calls[: None if self.parallel else 1]
        if not calls:
            return text, []
        content = reading.content if reading.content.strip() else None
        return content, [openai_call(name, args) for name, args in calls]

    def stream(self) -> ToolStream | None:
        return ToolStream(self.parser, self.names, self.parallel) if self.parser else None


def marker_token(engine, text: str) -> int | None:
    """The token a format's marker is, where llguidance holds it special (it holds every added
    token so, Qwen's non-special <tool_call> too): a grammar can ask for it by id only."""
    i = engine.tokenizer.token_to_id(text)
    ll = engine.grammars.ll_tokenizer
    return (
        i if i is not None and i < engine.grammars.vocab_size and ll.is_special_token(i) else None
    )


def openai_call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def call_deltas(first: int, calls: list[tuple[str, str]]) -> list[list[dict]]:
    """Streamed calls as OpenAI sends them, a delta's tool_calls each: the first names the call
    (index, id, type, function.name, arguments ""), the next carries its arguments."""
    deltas = []
    for k, (name, args) in enumerate(calls, first):
        head = openai_call(name, "")
        deltas.append([{"index": k, **head}])
        deltas.append([{"index": k, "function": {"arguments": args}}])
    return deltas
