"""Constrained decoding: a request's JSON Schema (or "any JSON object"), or the format of a forced
tool call, as a token mask, by llguidance.

llguidance was chosen by measurement (benchmarks/grammar_libs.py, BENCHMARKS.md; docs/serving.md
says why): it compiles a schema in under a millisecond, fills a row's mask in tens of microseconds
on the CPU, refuses a schema keyword it cannot enforce by name instead of ignoring it, and needs no
other package. It is an optional extra (`pip install 'lmforge[structured]'`).

`Grammars` is the server's: it builds llguidance's view of the vocabulary once (seconds for 50k
tokens, so in a thread, on the first request that needs it) and compiles each schema once (cached by
its JSON text) into a `CompiledGrammar`: a matcher in its start state, built off the engine thread
(llguidance builds its parser there, up to a second for a very large schema). Each engine row takes
a copy of it (`RowGrammar`), asks it for the mask before each token and advances it with the token
chosen. The mask is computed on the host as a bitmask and expanded to a bool row; rows without a
grammar compute nothing. End-of-sequence is in the mask only where the grammar accepts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from lmforge.errors import UserError

log = logging.getLogger(__name__)

INSTALL = "pip install 'lmforge[structured]'"
MAX_CACHED = 256  # compiled grammars kept (least recently used go first)
# Compact JSON (no free whitespace between items): a model cannot pad its answer with whitespace
# until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_module():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401  (the bitmask helpers)
    except ImportError:
        raise UserError(f"response_format needs the llguidance package: {INSTALL}") from None
    return llguidance


def available() -> bool:
    try:
        llguidance_module()
    except UserError:
        return False
    return True


def tokenizer_json(tokenizer) -> str:
    """The tokenizer's tokenizer.json text (llguidance reads each token's bytes from it)."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is None or not hasattr(inner, "to_str"):
        raise UserError(
            "response_format needs a tokenizer.json (Hugging Face tokenizers) tokenizer; this model's "
            f"is {type(tokenizer).__name__}"
        )
    return inner.to_str()


def schema_of(response_format: dict) -> dict:
    """The JSON Schema an OpenAI response_format asks for (json_object: any object)."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise UserError(
            f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise UserError(
            "response_format json_schema must be an object with a 'schema' object (and a 'name')"
        )
    return spec.get("schema") or {}


@dataclass(frozen=True)
class CompiledGrammar:
    """A response_format compiled: the llguidance grammar and a matcher in its start state (never
    advanced)."""

    grammar: str
    start: object  # llguidance.LLMatcher
    vocab_size: int


class Grammars:
    """The vocabulary as llguidance sees it, and compiled grammars cached by schema
    (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = llguidance_module()
                if not self.eos_ids:
                    raise UserError(
                        "response_format needs an end-of-sequence token, and this tokenizer has none"
                    )
                try:
                    self._ll_tokenizer = llg.LLTokenizer(
                        tokenizer_json(self.tokenizer),
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_ids,
                    )
                # a tokenizer.json llguidance cannot map to bytes (no decoder ...)
                except ValueError as e:
                    raise UserError(
                        f"response_format cannot be served with this model's tokenizer: {e}"
                    ) from None
            return self._ll_tokenizer

    def compile(self, response_format: dict) -> CompiledGrammar:
        """The grammar of a response_format; a UserError naming what is wrong with the schema (a
        keyword llguidance does not implement, a $ref that points nowhere). Slow the first time:
        call it off the event loop."""
        llg = llguidance_module()
        schema = schema_of(response_format)
        key = json.dumps(schema, sort_keys=True)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (TypeError, ValueError) as e:
            raise UserError(f"response_format's JSON schema cannot be read: {e}") from None
        return self._compiled(key, grammar, "response_format's JSON schema")

    def compile_lark(self, lark: str, what: str) -> CompiledGrammar:
        """An llguidance Lark grammar (tool calls: lmforge.serve.tool_parsers), its JSON Schemas
        embedded (%json); a UserError naming what is wrong, `what` the request field it came
        from."""
        llg = llguidance_module()
        with self._lock:
            if lark in self._cache:
                self._cache.move_to_end(lark)
                return self._cache[lark]
        try:
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        except (TypeError, ValueError) as e:
            raise UserError(f"{what}' JSON schemas cannot be read: {e}") from None
        return self._compiled(lark, grammar, f"{what}' JSON schemas")

    def _compiled(self, key: str, grammar: str, what: str) -> CompiledGrammar:
        llg = llguidance_module()
        problem = llg.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise UserError(f"{what} is not supported: {' '.join(problem.split())[:300]}")
        start = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if start.is_error():
            raise UserError(f"{what} is not supported: {start.get_error()}")
        compiled = CompiledGrammar(grammar, start, self.vocab_size)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return compiled


class RowGrammar:
    """One request's grammar state: the mask of the tokens it allows next, advanced by each token
    taken."""

    def __init__(self, compiled: CompiledGrammar):
        self.vocab_size = compiled.vocab_size
        self.matcher = compiled.start.deep_copy()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance_module().torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise RuntimeError(
                f"token {token} does not fit the response_format grammar: {self.matcher.get_error() or 'refused'}"
            )


def allowed_tokens(grammars: list[RowGrammar], vocab: int) -> torch.Tensor:
    """The rows' masks (len(grammars), vocab) bool on the host, True where a token is allowed."""
    llg = llguidance_module()
    bitmask = llg.torch.allocate_token_bitmask(len(grammars), vocab)
    for row, g in enumerate(grammars):
        g.fill(bitmask, row)
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).bool().reshape(len(grammars), -1)[:, :vocab]
