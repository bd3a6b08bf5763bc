"""Chat messages -> prompt token ids: the model folder's chat template (lmforge.chat_template), or a plain fallback.

A folder may carry a Hugging Face chat template (Jinja) in chat_template.jinja or tokenizer_config.json
("chat_template"); see lmforge.chat_template for how it is rendered and tokenized (the same way fine-tuning
renders its examples, so a fine-tuned model is prompted exactly as it was trained). It is rendered in a child process
under a time and an output-size limit (lmforge.chat_sandbox), the same for `serve` and `generate --chat`.

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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from lmforge.chat_sandbox import RenderLimits, Sandbox, TemplateLimit
from lmforge.chat_template import (
    ChatTemplate,
    Piece,
    TemplateRefused,
    chat_messages,
    encode_pieces,
    read_chat_template,
)
from lmforge.errors import UserError
from lmforge.serve.protocol import APIError

log = logging.getLogger(__name__)

FALLBACK_STOP = ("\nUser:",)
ROLE_NAMES = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}


class ChatFormat:
    """Turns a list of (role, text) messages into prompt ids, with the stop strings that format
    needs."""

    def __init__(
        self,
        tokenizer,
        folder: str | Path,
        template: ChatTemplate | None = None,
        limits: RenderLimits | None = None,
    ):
        """`template`: use this one instead of the folder's (an adapter folder's, for `serve
        --lora`); `limits`: each render's (lmforge.chat_sandbox)."""
        self.tokenizer = tokenizer
        self.chat = (
            template if template is not None else ChatTemplate.from_folder(tokenizer, Path(folder))
        )
        self.template = self.chat.template if self.chat is not None else None
        self.stop: tuple[str, ...] = FALLBACK_STOP if self.chat is None else self.chat.stop_strings
        self.limits = limits or RenderLimits()
        self.sandbox = Sandbox(self.limits) if self.chat is not None else None
        # whether a system message has been looked for in a rendered prompt
        self._system_checked = False
        if self.chat is not None:
            log.info("chat template from %s (%d special tokens)", folder, len(self.chat.specials))

    def encode(
        self,
        messages: Sequence[tuple[str, str] | dict],
        cancel=None,
        tokenizing: Callable[[str], AbstractContextManager] | None = None,
        add_generation_prompt: bool = True,
        tools: list | None = None,
    ) -> list[int]:
        """The prompt's ids; APIError 400 where the template fails, refuses or passes a limit, or
        the tokenizer fails. `messages`: (role, text) pairs, or the template's message objects
        (lmforge.serve.tools.template_messages: tool calls and results too); `tools`: rendered by
        the template as transformers passes them. `cancel` (a threading.Event): stop the render
        once it is set (RenderCancelled); `tokenizing(param)`: the context every tokenizer call
        runs in (the server's holds its tokenizer lock), else tokenizer_errors;
        add_generation_prompt: open the assistant's turn after the messages."""
        tokenizing = tokenizing or tokenizer_errors
        messages = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        if self.chat is None:
            text = "".join(
                f"{ROLE_NAMES[m['role']]}: {m['content'].strip()}\n" for m in messages
            ) + ("Assistant:" if add_generation_prompt else "")
            # encode_batch: tokenizers lets other threads run meanwhile, encode does
            # not
            with tokenizing("messages"):
                return self.tokenizer.encode_batch([text], add_bos=self.tokenizer.add_bos_token)[0]
        try:
            pieces = self.sandbox.pieces(
                self.chat, chat_messages(messages), add_generation_prompt, cancel, tools
            )
        except TemplateLimit as e:
            raise APIError(400, str(e), param="messages", code="template_limit") from None
        except TemplateRefused as e:
            raise APIError(
                400, f"the model's chat template refused these messages: {e}", param="messages"
            ) from None
        with tokenizing("messages"):
            ids = encode_pieces(self.tokenizer, [pieces])[0][0]
        if not self._system_checked:
            self._say_if_system_is_dropped(messages, pieces)
        return ids

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def _say_if_system_is_dropped(self, messages: Sequence[dict], pieces: list[Piece]) -> None:
        """A template whose format has no system turn (Alpaca's) leaves system messages out: said
        once, at the first request that has one, since a user's --system or system message would
        otherwise vanish unseen."""
        system = [
            m["content"].strip()
            for m in messages
            if m["role"] in ("system", "developer") and m["content"].strip()
        ]
        if not system:
            return
        self._system_checked = True
        rendered = "".join(p for p, _ in pieces if isinstance(p, str))
        if any(text not in rendered for text in system):
            log.warning(
                "the model's chat template leaves system messages out of the prompt (the format it was "
                "trained on has no system turn): they are ignored"
            )


@contextmanager
def tokenizer_errors(param: str = "prompt"):
    """A tokenizer's failure on a request's text as that request's 400. The `tokenizers` library
    panics on some inputs (a pre-tokenizer regex past its backtracking limit), and pyo3's
    PanicException derives from BaseException, not Exception: caught here, as everything but an
    interrupt or exit, and lmforge's own errors, which say theirs."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, UserError, APIError):
        raise
    except BaseException as e:  # noqa: BLE001 (see the docstring)
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise APIError(
            400,
            f"the tokenizer failed on this text ({type(e).__name__}: {detail}): send other text",
            param=param,
            code="tokenizer_error",
        ) from None


__all__ = ["FALLBACK_STOP", "ChatFormat", "read_chat_template", "tokenizer_errors"]
