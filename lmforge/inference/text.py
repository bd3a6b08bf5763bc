"""The text rules of generation, one copy for `generate_text` and the serving engine: which token
ids end a completion, and how its new tokens become text, all at once (`completion_text`) or as they
arrive (`TextStream`). Both decode the new tokens behind the same few prompt tokens, so a streamed
completion adds up to the text a whole one gives. Whether a prompt starts with bos is the
tokenizer's rule (`Tokenizer.add_bos_token`).

Special tokens a model writes mid-completion (a chat model's `<|im_start|>`, a base model's
`<|endoftext|>` where it is not eos) are left out of the text by default, as vLLM
(`skip_special_tokens=True`), TGI and transformers' pipelines do; stop strings are found in that
text, and a stop string that is the text of one special token ends the completion at that token
(`TextStream`), where the skipped text could never show it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Prompt tokens decoded in front of the completion, so that text depending on its left context
# (SentencePiece's leading space, a multi-byte character split over tokens) comes out right.
CONTEXT_TOKENS = 4


def token_ids(ids: int | Iterable[int] | None) -> set[int]:
    """An id, a list of ids (Hugging Face configs give either for eos) or None, as a set."""
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The ids that end a completion by default: the tokenizer's eos, and those of the model
    config's that are this tokenizer's special tokens (Tokenizer.model_special_ids; the export
    writes the same into config.json, so transformers' generate stops where this does). Without a
    tokenizer, the config's."""
    if tokenizer is None:
        return token_ids(model.config.eos_token_id)
    return token_ids(
        tokenizer.model_special_ids({"eos_token_id": model.config.eos_token_id})["eos_token_id"]
    )


def special_stop_ids(tokenizer, stop: Sequence[str]) -> dict[int, str]:
    """The stop strings that are the text of one special token, by that token's id."""
    ids = {s: tokenizer.token_to_id(s) for s in stop if s}
    return {i: s for s, i in ids.items() if i is not None and tokenizer.is_special(i)}


def _decode_after(tokenizer, context: list[int], head: str, ids: Sequence[int], skip: bool) -> str:
    """The text `ids` add after `context` (whose own text is `head`); decoded alone if that is
    not a prefix."""
    full = tokenizer.decode([*context, *ids], skip_special_tokens=skip)
    return (
        full[len(head) :]
        if full.startswith(head)
        else tokenizer.decode(list(ids), skip_special_tokens=skip)
    )


def completion_text(
    tokenizer, prompt_ids: Sequence[int], new_ids: Sequence[int], skip_special_tokens: bool = True
) -> str:
    """The text that new_ids add after the prompt (special tokens left out unless
    `skip_special_tokens` is off)."""
    context = list(prompt_ids[-CONTEXT_TOKENS:])
    head = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return _decode_after(tokenizer, context, head, new_ids, skip_special_tokens)


class TextStream:
    """A completion's text as its tokens arrive: the part safe to show now, and where a stop string
    ends it.

    Held back until the next token: a trailing incomplete UTF-8 character (decoders show U+FFFD) and
    a tail that may be the start of a stop string, so that streamed text never shows what the final
    text leaves out.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.context = list(prompt_ids[-CONTEXT_TOKENS:])
        self.head = tokenizer.decode(self.context, skip_special_tokens=self.skip)
        self.stop = [s for s in stop if s]
        self.special_stops = special_stop_ids(tokenizer, self.stop) if self.skip else {}
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already handed out
        self.matched: str | None = None  # the stop string that ended the completion
        # stop strings end nothing before this many tokens (vLLM's min_tokens)
        self.min_tokens = min_tokens

    def text(self) -> str:
        return _decode_after(self.tokenizer, self.context, self.head, self.ids, self.skip)

    def push(self, token: int) -> tuple[str, bool]:
        """(text to show now, whether a stop string has ended the completion)."""
        self.ids.append(token)
        # too early to stop: nothing held back for a stop string either
        if len(self.ids) < self.min_tokens:
            text = self.text()
            return self._take(text, len(text.rstrip("\ufffd"))), False
        # a stop string that is this special token's text, which is not shown
        if token in self.special_stops:
            self.matched = self.special_stops[token]
            return self._take(self.text(), None), True
        text = self.text()
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest + 1)
        cut, self.matched = min(
            ((i, s) for s in self.stop if (i := text.find(s, start)) >= 0),
            key=lambda found: found[0],
            default=(-1, None),
        )
        if cut >= 0:
            return self._take(text, cut), True
        safe = len(text.rstrip("\ufffd"))
        hold = max(
            (k for s in self.stop for k in range(1, len(s)) if text[:safe].endswith(s[:k])),
            default=0,
        )
        return self._take(text, safe - hold), False

    def flush(self) -> str:
        """The rest of the text, once no token follows."""
        return self._take(self.text(), None) if self.ids else ""

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
