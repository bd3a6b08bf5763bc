"""Chat messages -> prompt token ids: the model folder's chat template, or a plain fallback.

A folder may carry a Hugging Face chat template (Jinja) in tokenizer_config.json ("chat_template")
or in chat_template.jinja. It is rendered in Jinja's immutable sandbox, as transformers does, with
`messages`, `add_generation_prompt=True`, the special tokens (`bos_token`, `eos_token` ...) and
`raise_exception`. Special tokens that the template writes ("<s>", "<|im_start|>") become their ids;
the same strings typed by a user stay plain text: message contents go into the template as
placeholders and are put back after rendering, so only template text is searched for special tokens
(transformers parses them anywhere, which lets a user forge turns). A template's filters on content
(`| trim`) therefore see the placeholder, not the text.

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

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from lmforge.errors import UserError
from lmforge.serve.protocol import APIError

log = logging.getLogger(__name__)

FALLBACK_STOP = ("\nUser:",)
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")  # private-use characters: never in a template


def read_chat_template(folder: Path) -> str | None:
    """The folder's chat template, or None. A list of named templates picks "default"."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    config = _tokenizer_config(folder)
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path} as JSON ({e}): fix or delete the file") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatFormat:
    """Turns a list of (role, text) messages into prompt ids, with the stop strings that format needs."""

    def __init__(self, tokenizer, folder: str | Path):
        folder = Path(folder)
        self.tokenizer = tokenizer
        source = read_chat_template(folder)
        self.template = None
        self.stop: tuple[str, ...] = () if source else FALLBACK_STOP
        if source is None:
            return
        try:
            from jinja2 import TemplateError  # noqa: F401 (jinja2 is only needed for templated models)
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise UserError(f"{folder} has a chat template but jinja2 is not installed: pip install jinja2") from None
        config = _tokenizer_config(folder)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise UserError(f"the chat template of {folder} does not parse ({e}): fix tokenizer_config.json") from None
        self.variables = {f"{k}_token": _token_text(config.get(f"{k}_token")) or ""
                          for k in ("bos", "eos", "unk", "pad")}
        for key, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
            if not self.variables[f"{key}_token"] and i is not None:
                self.variables[f"{key}_token"] = tokenizer.id_to_token(i) or ""
        names = {*self.variables.values(), *(_token_text(t) for t in config.get("additional_special_tokens") or [])}
        names |= {_token_text(t) for t in (config.get("added_tokens_decoder") or {}).values()
                  if isinstance(t, dict) and t.get("special")}
        self.specials = {s: i for s in names if s and (i := tokenizer.token_to_id(s)) is not None}
        # Longest first, so that "<|im_start|>" is not read as a shorter token inside it.
        self._special_re = re.compile("|".join(map(re.escape, sorted(self.specials, key=len, reverse=True))))
        log.info("chat template from %s (%d special tokens)", folder, len(self.specials))

    def encode(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if self.template is None:
            return self._fallback(messages)
        from jinja2 import TemplateError

        placeholders = [{"role": "system" if role == "developer" else role, "content": f"\ue000{i}\ue001"}
                        for i, (role, _) in enumerate(messages)]
        try:
            rendered = self.template.render(messages=placeholders, add_generation_prompt=True, **self.variables)
        except TemplateError as e:
            raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
        ids, text, at = [], "", 0
        for m in _PLACEHOLDER.finditer(rendered):
            text = self._template_text(rendered[at : m.start()], text, ids) + messages[int(m.group(1))][1]
            at = m.end()
        text = self._template_text(rendered[at:], text, ids)
        return ids + (self.tokenizer.encode(text) if text else [])

    def _template_text(self, part: str, text: str, ids: list[int]) -> str:
        """Append template text to `text`; at each special token, encode the text so far, then the token id."""
        if not self.specials:
            return text + part
        at = 0
        for m in self._special_re.finditer(part):
            text += part[at : m.start()]
            if text:
                ids += self.tokenizer.encode(text)
            ids.append(self.specials[m.group()])
            text, at = "", m.end()
        return text + part[at:]

    def _fallback(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        text = "".join(f"{ROLE_NAMES[role]}: {content.strip()}\n" for role, content in messages) + "Assistant:"
        return self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos_token)


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
