"""Tool calls read from a model's own output format, and the grammar that forces that format.

Three formats, named as vLLM's `--tool-call-parser` names them:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call
                 (Hermes 2 Pro, Qwen2.5, Qwen3), after any text
    llama3_json  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, calls joined
                 by "; " (Llama 3.1-3.3's JSON tool calling); the whole answer or nothing
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] after any text

`parse(text, final)` reads what is decided in a text that may still grow: the content so far and
the calls completed, each a prefix of what a longer text gives (what a stream sends cannot be taken
back); text that may yet be the start of a call is held until it is decided. A call that does not
parse as JSON, names no function the request offered or lacks its arguments ends the reading: it
and all after it are content, as they would be without tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

PARSERS = ("hermes", "llama3_json", "mistral")
# The tool-call markers a chat template writes, the parser they name (the first found wins).
TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)
_DECODER = json.JSONDecoder()


@dataclass
class Reading:
    """What a text holds so far: `content` (decided text, for the user), `calls` ((name,
    arguments as JSON text), complete), and whether the text ended inside a possible call."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _call(obj, names: set[str], key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments"))  # llama3's "parameters"; some write "arguments"
    if isinstance(args, str):  # arguments already as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if obj["name"] not in names or not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _value_end(text: str, at: int) -> int | None:
    """Where the JSON object or array opening at text[at] ends (its closing bracket's index + 1),
    or None where the text ends first: brackets counted outside strings."""
    depth, in_string, escaped = 0, False, False
    for k in range(at, len(text)):
        c = text[k]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _decode(text: str, at: int, final: bool):
    """(value, end) of the JSON object or array at text[at:] past whitespace; None where more text
    may still complete it (not `final`), False where it is not one."""
    at = len(text) - len(text[at:].lstrip())
    if at >= len(text) or text[at] not in "{[":
        return None if at >= len(text) and not final else False
    end = _value_end(text, at)
    if end is None:
        return None if not final else False
    try:
        return json.loads(text[at:end]), end
    except json.JSONDecodeError:
        return False


class ToolParser:
    name: ClassVar[str]
    marker: ClassVar[str]  # the text that opens a call
    # whether the marker must be decoded (a special token skip_special_tokens would drop)
    needs_special_tokens: ClassVar[bool] = False

    def parse(self, text: str, final: bool, names: set[str]) -> Reading:
        raise NotImplementedError

    def grammar(self, call_schema: dict, parallel: bool, token: Callable[[str], int | None]) -> str:
        """An llguidance Lark grammar of a whole answer of calls in this format, each call's
        object validating against `call_schema`; `token(text)`: the id of a marker that is a token
        llguidance holds special (every added token: written <[id]>, the only way to ask for one),
        else None (the marker is spelt in text)."""
        raise NotImplementedError


def _literal(text: str, token: Callable[[str], int | None]) -> str:
    return f"<[{i}]>" if (i := token(text)) is not None else json.dumps(text)


class HermesParser(ToolParser):
    name, marker, close = "hermes", "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool, names: set[str]) -> Reading:
        start = text.find(self.marker)
        if start < 0:
            return Reading(text if final else text[: len(text) - held_back(text, self.marker)])
        out, at = Reading(text[:start]), start
        while True:
            rest = text[at:].lstrip()
            if not rest or (not final and self.marker.startswith(rest)):
                return out  # nothing, or maybe the next call
            if not rest.startswith(self.marker):
                out.content += text[at:]  # text after the calls
                return out
            body = len(text) - len(rest) + len(self.marker)
            end = text.find(self.close, body)
            if end < 0 and not final:
                return out
            call = _block(text[body : end if end >= 0 else len(text)], names, "arguments")
            if call is None:
                out.content += text[at:]
                return out
            out.calls.append(call)
            at = end + len(self.close) if end >= 0 else len(text)

    def grammar(self, call_schema: dict, parallel: bool, token: Callable[[str], int | None]) -> str:
        block = f'{_literal(self.marker, token)} "\\n" call "\\n" {_literal(self.close, token)}'
        start = 'block ("\\n" block)*' if parallel else "block"
        return f"start: {start}\nblock: {block}\ncall: %json {json.dumps(call_schema)}\n"


def _block(body: str, names: set[str], key: str) -> tuple[str, str] | None:
    try:
        return _call(json.loads(body), names, key)
    except json.JSONDecodeError:
        return None


class Llama3JsonParser(ToolParser):
    name, marker = "llama3_json", "<|python_tag|>"

    def parse(self, text: str, final: bool, names: set[str]) -> Reading:
        lead = text.lstrip()
        if not final and self.marker.startswith(lead):
            return Reading()  # nothing yet, or the tag's start
        body = lead[len(self.marker) :] if lead.startswith(self.marker) else lead
        if not final and not body.strip():
            return Reading()
        if not body.lstrip().startswith("{"):
            return Reading(text)  # an answer, not a call
        out, at = Reading(), len(text) - len(body)
        while True:
            got = _decode(text, at, final)
            if got is None:
                return out
            call = _call(got[0], names, "parameters") if got else None
            if call is None:  # a JSON answer that is no call is the answer
                out.content = text if not out.calls else text[at:]
                return out
            out.calls.append(call)
            rest = text[got[1] :].lstrip()
            if rest and not rest.startswith(";"):
                out.content = text[got[1] :]
                return out
            if not rest:
                return out
            at = len(text) - len(rest) + 1

    def grammar(self, call_schema: dict, parallel: bool, token: Callable[[str], int | None]) -> str:
        start = 'call ("; " call)*' if parallel else "call"
        return f"start: {start}\ncall: %json {json.dumps(call_schema)}\n"


class MistralParser(ToolParser):
    name, marker, needs_special_tokens = "mistral", "[TOOL_CALLS]", True

    def parse(self, text: str, final: bool, names: set[str]) -> Reading:
        start = text.find(self.marker)
        if start < 0:
            return Reading(text if final else text[: len(text) - held_back(text, self.marker)])
        out = Reading(text[:start])
        got = _decode(text, start + len(self.marker), final)
        if got is None:
            return out
        value = got[0] if got else None
        calls = [_call(c, names, "arguments") for c in value] if isinstance(value, list) else []
        if not calls or None in calls:
            out.content += text[start:]
            return out
        out.calls = calls
        out.content += text[got[1] :] if text[got[1] :].strip() else ""
        return out

    def grammar(self, call_schema: dict, parallel: bool, token: Callable[[str], int | None]) -> str:
        array = {"type": "array", "items": call_schema, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        if "x-guidance" in call_schema:
            array["x-guidance"] = call_schema["x-guidance"]
        return f"start: {_literal(self.marker, token)} %json {json.dumps(array)}\n"


PARSER_CLASSES: dict[str, type[ToolParser]] = {
    c.name: c for c in (HermesParser, Llama3JsonParser, MistralParser)
}


def parser_named(name: str) -> ToolParser:
    return PARSER_CLASSES[name]()


def parser_of_template(source: str | None) -> str | None:
    """The format a chat template's own markers name (TEMPLATE_MARKERS), or None."""
    if not source:
        return None
    found = [(source.find(m), name) for m, name in TEMPLATE_MARKERS if m in source]
    if not found and "ipython" in source and '"parameters"' in source:
        return "llama3_json"  # Llama 3.2's template, which names no python tag
    return min(found)[1] if found else None


class ToolStream:
    """One streamed choice's reading: each `feed(text)` the content and the calls decided since
    the last."""

    def __init__(self, parser: ToolParser, names: set[str], parallel: bool):
        self.parser, self.names, self.parallel = parser, names, parallel
        self.text, self.sent, self.calls = "", 0, 0

    def feed(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        self.text += text
        reading = self.parser.parse(self.text, final, self.names)
        calls = reading.calls[: 1 if not self.parallel else None]
        content, new = reading.content[self.sent :], calls[self.calls :]
        self.sent, self.calls = len(reading.content), len(calls)
        return content, new
