"""vLLM's /tokenize and /detokenize: a prompt (or chat messages, rendered by the model's template)
as the ids the server would feed the model, and ids back to text.

    POST /tokenize    {"prompt": TEXT, "add_special_tokens": true}
                      {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
        -> {"count": N, "max_model_len": CONTEXT, "tokens": [...], "token_strs": null}
    POST /detokenize  {"tokens": [...]} -> {"prompt": TEXT}

As vLLM reads them: a prompt's special-token text is those tokens, and add_special_tokens (default
true) adds the tokenizer's bos where its prompts start with one; messages are rendered by the chat
template, which writes its own bos, so add_special_tokens defaults to false there (true adds bos
where the template did not). /detokenize decodes every id, special ones included. Both go through
the server's worker threads, under its key, body limit and template limits, like the other routes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmforge.serve.protocol import APIError, Message, parse
from lmforge.serve.server import read_json


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # messages: open the assistant's turn after them
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False  # each id's token string as well

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


async def tokenize(server, request) -> dict:
    body = await server.prompts.body(request, lambda raw: parse(TokenizeRequest, read_json(raw)))
    if body.model:
        server.check_model(body.model)
    tokenizer, prompts = server.tokenizer, server.prompts
    if body.messages is not None:
        async with prompts.renders:
            ids = await prompts.run(
                request,
                lambda cancel: server.chat.encode(
                    [(m.role, m.text()) for m in body.messages],
                    cancel,
                    prompts.tokenizing,
                    body.add_generation_prompt,
                ),
            )
        bos = tokenizer.bos_id
        if body.add_special_tokens and tokenizer.add_bos_token and ids[:1] != [bos]:
            ids = [bos, *ids]
    else:
        add = body.add_special_tokens is not False and tokenizer.add_bos_token

        def encode(_):
            with prompts.tokenizing("prompt"), tokenizer.reading_special_tokens():
                return tokenizer.encode_batch([body.prompt], add_bos=add)[0]

        ids = await prompts.run(request, encode)
    strs = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": server.engine.context,
        "tokens": ids,
        "token_strs": strs,
    }


async def detokenize(server, request) -> dict:
    body = await server.prompts.body(request, lambda raw: parse(DetokenizeRequest, read_json(raw)))
    if body.model:
        server.check_model(body.model)
    vocab = server.tokenizer.vocab_size
    bad = [i for i in body.tokens if not 0 <= i < vocab]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {vocab})",
            param="tokens",
        )

    def decode(_):
        with server.prompts.tokenizing("tokens"):
            return server.tokenizer.decode(body.tokens, skip_special_tokens=False)

    return {"prompt": await server.prompts.run(request, decode)}
