"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` and the completions API's
`{tokens, token_logprobs, top_logprobs, text_offset}`.

A token's text is its own decoding (special tokens included); its `bytes` are the bytes it stands
for: for a byte-level BPE token that holds part of a multi-byte character (whose text alone is
U+FFFD) those are read from the token itself, through the byte-to-character table GPT-2's BPE uses.
"""

from __future__ import annotations

from lmforge.inference.logprobs import TokenLogprob


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the others are shifted past 255, in byte order."""
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, shift = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shift)] = b
            shift += 1
    return table


BYTE_LEVEL = _byte_table()


class TokenText:
    """Each token's text and bytes, decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.known:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text:
                piece = self.tokenizer.id_to_token(token) or ""
                if piece and all(c in BYTE_LEVEL for c in piece):
                    raw = bytes(BYTE_LEVEL[c] for c in piece)
            self.known[token] = (text, list(raw))
        return self.known[token]


def chat_content(text: TokenText, entries: list[TokenLogprob]) -> list[dict]:
    """`choices[i].logprobs.content` of a chat completion (or of one streamed chunk)."""
    out = []
    for e in entries:
        token, raw = text(e.token)
        top = [dict(zip(("token", "bytes"), text(t)), logprob=lp) for t, lp in e.top]
        out.append({"token": token, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(
    text: TokenText, entries: list[TokenLogprob], offset: int = 0
) -> tuple[dict, int]:
    """The completions API's `logprobs` object for these tokens, their text offsets counted from
    `offset`; and the offset after them. An echoed prompt's first token has no log-probability:
    null, as OpenAI and vLLM give."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for e in entries:
        token = text(e.token)[0]
        out["tokens"].append(token)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(None if e.top is None else {text(t)[0]: lp for t, lp in e.top})
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset
