"""response_format on /v1/chat/completions and /v1/completions: `{"type": "json_object"}` and
`{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`, by
constrained decoding (lmforge.inference.grammar). The schema is compiled in a thread (the first
one also builds the vocabulary's token trie, seconds for a 50k vocabulary), so the event loop and
the engine never wait on it."""

from __future__ import annotations

import asyncio

from lmforge.errors import UserError
from lmforge.inference.grammar import CompiledGrammar
from lmforge.serve.protocol import APIError


async def grammar_of(engine, body) -> CompiledGrammar | None:
    """The compiled grammar of the body's response_format (None for none or text); a 400 naming
    what is wrong."""
    fmt = body.response_format
    if not fmt or fmt.get("type", "text") == "text":
        return None
    if getattr(body, "ignore_eos", False):  # the grammar ends a JSON answer with eos alone
        raise APIError(
            400, "ignore_eos cannot be used with response_format: leave one out", param="ignore_eos"
        )
    try:
        return await asyncio.to_thread(engine.grammars.compile, fmt)
    except UserError as e:
        raise APIError(400, str(e), param="response_format") from None
