"""Chat messages -> prompt token ids: the model folder's chat template (lmforge.chat_template), or a plain fallback.

A folder may carry a Hugging Face chat template (Jinja) in chat_template.jinja or tokenizer_config.json
("chat_template"); see lmforge.chat_template for how it is rendered and tokenized (the same way fine-tuning
renders its examples, so a fine-tuned model is prompted exactly as it was trained).

Without a template (base models: Pythia, GPT-2 ...) the prompt is

    System: {system message}
    User: {user message}
    Assistant: {assistant message}
    User: {user message}
    Assistant:

with each message stripped of surrounding whitespace, and "\\nUser:" is a stop string, so the model does
not go on to write the user's next turn.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from lmforge.chat_template import ChatTemplate, TemplateRefused, read_chat_template
from lmforge.serve.protocol import APIError

log = logging.getLogger(__name__)

FALLBACK_STOP = ("\nUser:",)
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


class ChatFormat:
    """Turns a list of (role, text) messages into prompt ids, with the stop strings that format needs."""

    def __init__(self, tokenizer, folder: str | Path, template: ChatTemplate | None = None):
        """`template`: use this one instead of the folder's (an adapter folder's, for `serve --lora`)."""
        self.tokenizer = tokenizer
        self.chat = template if template is not None else ChatTemplate.from_folder(tokenizer, Path(folder))
        self.template = self.chat.template if self.chat is not None else None
        self.stop: tuple[str, ...] = FALLBACK_STOP if self.chat is None else self.chat.stop_strings
        self._system_checked = False  # whether a system message has been looked for in a rendered prompt
        if self.chat is not None:
            log.info("chat template from %s (%d special tokens)", folder, len(self.chat.specials))

    def encode(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if self.chat is None:
            return self._fallback(messages)
        try:
            ids = self.chat.prompt_ids(messages)
        except TemplateRefused as e:
            raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
        if not self._system_checked:
            self._say_if_system_is_dropped(messages)
        return ids

    def _say_if_system_is_dropped(self, messages: Sequence[tuple[str, str]]) -> None:
        """A template whose format has no system turn (Alpaca's) leaves system messages out: said once, at the first
        request that has one, since a user's --system or system message would otherwise vanish unseen."""
        system = [text.strip() for role, text in messages if role in ("system", "developer") and text.strip()]
        if not system:
            return
        self._system_checked = True
        chat = [{"role": "system" if role == "developer" else role, "content": text} for role, text in messages]
        try:
            rendered = "".join(p for p, _ in self.chat.pieces(chat, True, spans=False) if isinstance(p, str))
        except TemplateRefused:
            return
        if any(text not in rendered for text in system):
            log.warning("the model's chat template leaves system messages out of the prompt (the format it was "
                        "trained on has no system turn): they are ignored")

    def _fallback(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        text = "".join(f"{ROLE_NAMES[role]}: {content.strip()}\n" for role, content in messages) + "Assistant:"
        return self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos_token)


__all__ = ["FALLBACK_STOP", "ChatFormat", "read_chat_template"]
