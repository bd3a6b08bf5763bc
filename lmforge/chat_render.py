"""A chat template's render: messages -> text runs and special-token ids, with the assistant spans
marked.

`TemplateRender` needs no tokenizer, only the template's source, the variables it is rendered with
and the special tokens' text and ids, so that lmforge.chat_sandbox can run it in a child process;
lmforge.chat_template's `ChatTemplate` binds it to a tokenizer (module docstring there: how a chat
is rendered and read). Whatever a template does wrong on some messages, Jinja's error or Python's
(ZeroDivisionError, RecursionError, MemoryError ...), or writing more than `max_chars` characters,
is a TemplateRefused saying so.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime

from lmforge.errors import UserError

# Noncharacters (Unicode keeps U+FDD0..U+FDEF for a program's own use): the edges of an assistant
# span, the mark before a special token's text typed in a message, and the probe that finds where
# each message's text ends.
_SPAN_START, _SPAN_END, _TYPED, _PROBE = "\ufdd0", "\ufdd1", "\ufdd2", "\ufdd3"
_SPANS = re.compile("[\ufdd0\ufdd1]")
_INTERNAL = re.compile("[\ufdd0-\ufdd3]")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateRefused(Exception):
    """The template raised (raise_exception) or failed on these messages; the message says why."""


class TemplateTooLong(TemplateRefused):
    """The template wrote more than its render may (`TemplateRender.max_chars`)."""


# A piece of a rendered chat: text to tokenize, or a special token's id; and whether it is in an
# assistant span.
Piece = tuple[str | int, bool]


class TemplateRender:
    """A Jinja chat template, rendered in Jinja's immutable sandbox with `variables` (bos_token
    ...); `specials`: each special token's text and id, the text the template writes that becomes
    those ids."""

    max_chars: int | None = None  # the most characters one render may write

    def __init__(
        self,
        source: str,
        variables: dict[str, str],
        specials: dict[str, int],
        where: str = "the chat template",
    ):
        try:
            from jinja2 import TemplateError, nodes
            from jinja2.ext import Extension, loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise UserError(f"{where} needs jinja2: pip install jinja2") from None

        class Generation(Extension):
            """`{% generation %}...{% endgeneration %}`: marks what it renders as an assistant
            span."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                return _SPAN_START + caller() + _SPAN_END

        self.source, self.variables, self.specials = source, variables, specials
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise UserError(f"{where} does not parse ({e}): fix it") from None
        self.marks_spans = bool(_GENERATION_TAG.search(source))
        # Longest first, so that "<|im_start|>" is not read as a shorter token inside it; one marked
        # typed is text.
        names = "|".join(map(re.escape, sorted(specials, key=len, reverse=True)))
        self._special_re = re.compile(f"{_TYPED}?(?:{names})")

    def render(
        self, messages: Sequence[dict], add_generation_prompt: bool, tools: list | None = None
    ) -> str:
        """The template's text for `messages`, {% generation %} blocks marked as spans
        (TemplateRefused); `tools`: the functions the model may call, as transformers'
        apply_chat_template(tools=...) passes them (OpenAI's {"type": "function", "function":
        {...}} objects)."""
        from jinja2 import TemplateError

        chunks, size = [], 0
        try:
            for chunk in self.template.generate(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.variables,
            ):
                size += len(chunk)
                if self.max_chars is not None and size > self.max_chars:
                    raise TemplateTooLong(
                        f"the model's chat template writes more than {self.max_chars} characters "
                        "for these messages (the limit: --max-template-chars)"
                    )
                chunks.append(chunk)
        except TemplateRefused:
            raise
        except TemplateError as e:
            raise TemplateRefused(str(e)) from None
        except Exception as e:  # noqa: BLE001 (a template is untrusted code: whatever it raises is its failure)
            raise TemplateRefused(
                f"{type(e).__name__}: {str(e)[:200] or 'raised while rendering'}"
            ) from None
        return "".join(chunks)

    def _typed(
        self, messages: Sequence[dict], prompt: bool, tools: list | None = None
    ) -> Sequence[dict]:
        """`messages` with each special token's text in a content marked as typed, where the
        template renders them as it renders `messages` (marks aside); else `messages`, its tokens
        then read as transformers reads them."""
        if not self.specials or not any(self._special_re.search(m["content"]) for m in messages):
            return messages
        typed = [
            {**m, "content": self._special_re.sub(lambda t: _TYPED + t.group(), m["content"])}
            for m in messages
        ]
        try:
            same = self.render(typed, prompt, tools).replace(_TYPED, "") == self.render(
                messages, prompt, tools
            )
        except TemplateTooLong:
            raise
        except TemplateRefused:
            same = False
        return typed if same else messages

    def _spans_by_prefix(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The whole render with each assistant message's span marked, found from renders turn by
        turn."""
        full = self.render(messages, add_generation_prompt)
        out, at = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, after = self.render(messages[:i], True), self.render(messages[: i + 1], False)
            if after == full or not full.startswith(after):
                after = after[: self._closing(messages[: i + 1], after)]
            if not after.startswith(before):
                where = _parting(before, after, ("the prompt", "the answer"), messages)
                raise TemplateRefused(
                    f"the generation prompt is not how the template starts assistant message {i} "
                    f"({where}), so its answer cannot be found turn by turn; give the template "
                    "{% generation %} blocks or choose another data.chat_template"
                )
            if not full.startswith(after) or len(before) < at:
                where = _parting(after, full, ("its turn", "the whole chat"), messages)
                raise TemplateRefused(
                    f"rendering the chat turn by turn does not give prefixes of the whole chat (at "
                    f"message {i}, {where}): the template rewrites earlier turns; give it "
                    "{% generation %} blocks or choose another data.chat_template"
                )
            out += [full[at : len(before)], _SPAN_START, full[len(before) : len(after)], _SPAN_END]
            at = len(after)
        return "".join(out) + full[at:]

    def _closing(self, messages: Sequence[dict], rendered: str) -> int:
        """Where `rendered` (`messages` without the generation prompt) ends before what the
        template writes only to close a whole chat (Phi-3's "{% else %}{{ eos_token }}"): where
        it parts from the render with the generation prompt, at the start of a special token
        split there; no message's text may follow (a probe put at the end of each content must
        come before it). That text closes the chat, it is no answer's: it is in no span, and a
        turn followed by more messages is a prefix of the chat without it."""
        try:
            prompted = self.render(messages, True)
        except TemplateRefused:
            return len(rendered)
        k = len(os.path.commonprefix([rendered, prompted]))
        k = (
            next(
                (m.start() for m in self._special_re.finditer(rendered) if m.start() < k < m.end()),
                k,
            )
            if self.specials
            else k
        )
        if k == len(rendered):
            return k
        try:
            probed = self.render([{**m, "content": m["content"] + _PROBE} for m in messages], False)
        except TemplateRefused:
            return len(rendered)
        return (
            k
            if probed.endswith(rendered[k:]) and _PROBE not in probed[k - len(rendered) :]
            else len(rendered)
        )

    def pieces(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool,
        spans: bool = True,
        tools: list | None = None,
    ) -> list[Piece]:
        """The rendered chat as text runs and special-token ids, each flagged in or out of an
        assistant span.

        spans=False (serving: the ids are the same, spans only flag them): no spans, the text cut at
        special tokens only, from one render; only then are `tools` (render) rendered.
        """
        for i, m in enumerate(messages):
            if found := _INTERNAL.search(m["content"]):
                raise TemplateRefused(
                    f"message {i} holds the character U+{ord(found.group()):04X}, a Unicode "
                    "noncharacter that lmforge uses to mark the render: remove it from the text"
                )
        messages = self._typed(messages, add_generation_prompt, tools)
        if self.marks_spans or not spans:
            rendered = self.render(messages, add_generation_prompt, tools)
        else:
            rendered = self._spans_by_prefix(messages, add_generation_prompt)
        if not spans:
            rendered = _SPANS.sub("", rendered)
        out: list[Piece] = []
        in_span, at = False, 0
        for m in [*_SPANS.finditer(rendered), None]:
            self._template_text(rendered[at : m.start() if m else len(rendered)], in_span, out)
            if m:
                in_span, at = m.group() == _SPAN_START, m.end()
        return out

    def _template_text(self, part: str, in_span: bool, out: list[Piece]) -> None:
        """Append rendered text to `out`: text runs cut at each special token the template wrote,
        and its id."""
        at = 0
        for m in self._special_re.finditer(part) if self.specials else ():
            if not m.group().startswith(_TYPED):
                if text := part[at : m.start()].replace(_TYPED, ""):
                    out.append((text, in_span))
                out.append((self.specials[m.group()], in_span))
                at = m.end()
        if text := part[at:].replace(_TYPED, ""):
            out.append((text, in_span))


def _parting(one: str, other: str, names: tuple[str, str], messages: Sequence[dict]) -> str:
    """Where two renders part, for an error: each one's text there, messages' contents named."""
    k = len(os.path.commonprefix([one, other]))
    index = {
        m["content"]: f"{{message {i}}}"
        for i, m in reversed(list(enumerate(messages)))
        if m["content"]
    }
    named = (
        re.compile("|".join(map(re.escape, sorted(index, key=len, reverse=True))))
        if index
        else None
    )

    def show(text: str) -> str:
        text = named.sub(lambda m: index[m.group()], text[k:]) if named else text[k:]
        return repr(text.replace(_TYPED, "")[:40])

    return f"{names[0]} has {show(one)} where {names[1]} has {show(other)}"


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters ("<" as "\u003c"), which a chat must
    # not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
