"""Chat templates: messages -> token ids, for serving (the prompt) and fine-tuning (which ids are the assistant's).

A template is Hugging Face's Jinja chat template: a model folder's (chat_template.jinja, else tokenizer_config.json's
"chat_template"), a file, or one of the built-ins below. It is rendered in Jinja's immutable sandbox, as
transformers does, with `messages`, `add_generation_prompt`, the special tokens (`bos_token`, `eos_token` ...),
`tools=None`, `raise_exception`, `strftime_now` and transformers' `tojson`.

The messages' own text is rendered, so the text is apply_chat_template(tokenize=False)'s whatever the template does
to a content (`| trim`, Qwen3's split at "</think>"). Special tokens that the template writes ("<s>", "<|im_start|>")
become their ids; the same strings typed in a message stay text: each is marked in the content before rendering, and
only unmarked ones are read as tokens (transformers reads them anywhere, which lets a user forge turns). A template
that renders the marked chat otherwise than the chat (it reads the typed token: `content.split('<|eot_id|>')`) gets
transformers' reading, every such string a token.

Assistant spans (what fine-tuning puts the loss on) come from the template's `{% generation %}` blocks where it has
them (transformers' `return_assistant_tokens_mask` reads the same blocks); otherwise from rendering the chat turn
by turn: the span of assistant message i is what rendering messages[:i+1] adds to rendering messages[:i] with the
generation prompt. Text that the template writes only to close a whole chat (Phi-3's eos where there is no
generation prompt) is in no span. A template whose renders are not prefixes of each other that way (one that
rewrites earlier turns, as Qwen3's drops the reasoning of answers before the last question) cannot be split so and
is refused for training, with that reason.

Text is tokenized in runs cut at each special token, each run whole (as transformers tokenizes the rendered text),
and a token is in an assistant span when any character it covers is: a served prompt is then token for token the
prompt the model was trained on, earlier answers included. A run after a special token gets no prefix space from a
tokenizer that puts one only at the start of an input (Metaspace "first", transformers' non-legacy conversion), and
gets one from those that put it on every text (Meta's tokenizer.model, legacy tokenizer.json files): as each of them
tokenizes a whole rendered chat.

Built-in templates (`BUILTIN`), for models without one of their own; each ends an answer with eos:

    lmforge   "<|role|>\\ncontent\\n" per message, the answer followed by eos; the prompt ends with "<|assistant|>\\n"
    chatml    "<|im_start|>role\\ncontent<|im_end|>\\n" (Qwen's layout; where the tokenizer lacks the two tokens
              they are text, and serving stops at "<|im_end|>")
    alpaca    the user message as Stanford Alpaca's instruction prompt, the answer after "### Response:"
    plain     the messages' text as it is, the answer followed by eos (prompt/completion data)
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from lmforge.errors import UserError
from lmforge.fsutil import folder_file

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5's name; it wins over tokenizer_config.json's
# Noncharacters (Unicode keeps U+FDD0..U+FDEF for a program's own use): the edges of an assistant span, the mark
# before a special token's text typed in a message, and the probe that finds where each message's text ends.
_SPAN_START, _SPAN_END, _TYPED, _PROBE = "\ufdd0", "\ufdd1", "\ufdd2", "\ufdd3"
_SPANS = re.compile("[\ufdd0\ufdd1]")
_INTERNAL = re.compile("[\ufdd0-\ufdd3]")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")

# Stanford Alpaca's PROMPT_DICT (tatsu-lab/stanford_alpaca, train.py), verbatim.
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)

_ANSWER = "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
_TEMPLATES = {
    "lmforge": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
        "{% if message['role'] == 'assistant' %}" + _ANSWER + "{% else %}{{ message['content'] }}{% endif %}"
        "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "plain": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}" + _ANSWER +
        "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    ),
}
BUILTIN = ("lmforge", "chatml", "alpaca", "plain")


def _jinja_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Jinja string literal


def prompt_template_jinja(prompt_template: str | None) -> str:
    """The Alpaca-style built-in: each user message formatted as `prompt_template`'s instruction (Stanford Alpaca's
    no-input prompt by default), each answer followed by eos."""
    fmt = prompt_template if prompt_template is not None else ALPACA_PROMPT_NO_INPUT
    parts = []
    for literal, field, _, _ in string.Formatter().parse(fmt):
        if literal:
            parts.append(_jinja_literal(literal))
        if field == "instruction":
            parts.append("message['content']")
    prompt = " + ".join(parts) or "''"
    return ("{% for message in messages %}{% if message['role'] == 'user' %}{{ " + prompt + " }}"
            "{% elif message['role'] == 'assistant' %}" + _ANSWER + "{% endif %}{% endfor %}")


def builtin_template(name: str, add_bos: bool, prompt_template: str | None = None) -> str:
    """The Jinja source of built-in template `name`, starting with bos where the tokenizer's texts do."""
    if name not in BUILTIN:
        raise UserError(f"unknown chat template '{name}': choose a built-in ({', '.join(BUILTIN)}), "
                        "'auto', 'model' or a .jinja file")
    body = prompt_template_jinja(prompt_template) if name == "alpaca" else _TEMPLATES[name]
    return ("{{ bos_token }}" if add_bos else "") + body


def read_chat_template(folder: str | Path) -> str | None:
    """The folder's chat template, or None. A list of named templates picks "default"."""
    folder = Path(folder)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return folder_file(folder, CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


def tokenizer_config(folder: Path, name: str = "tokenizer_config.json") -> dict:
    path = Path(folder) / name
    if not path.is_file():
        return {}
    folder_file(folder, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path} as JSON ({e}): fix or delete the file") from None
    return data if isinstance(data, dict) else {}


def declared_tokens(*folders: str | Path | None) -> dict | None:
    """The tokenizer config of the first folder that has tokenizer_config.json or special_tokens_map.json, the
    latter's tokens over the former's (as transformers reads them); None where none has either."""
    for folder in filter(None, folders):
        if any((Path(folder) / name).is_file() for name in ("tokenizer_config.json", "special_tokens_map.json")):
            tokens = {k: v for k, v in tokenizer_config(Path(folder), "special_tokens_map.json").items() if v}
            return tokenizer_config(Path(folder)) | tokens
    return None


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class TemplateRefused(Exception):
    """The template raised (raise_exception) or failed on these messages; the message says why."""


# A piece of a rendered chat: text to tokenize, or a special token's id; and whether it is in an assistant span.
Piece = tuple[str | int, bool]


class ChatTemplate:
    """A Jinja chat template bound to a tokenizer: `source` is its text, `folder` (optional) the tokenizer folder
    whose tokenizer_config.json names the special tokens (else the tokenizer file's folder); `builtin`: one of
    lmforge's templates (BUILTIN)."""

    def __init__(self, source: str, tokenizer, folder: str | Path | None = None, where: str = "the chat template",
                 builtin: bool = False):
        try:
            from jinja2 import TemplateError, nodes
            from jinja2.ext import Extension, loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise UserError(f"{where} needs jinja2: pip install jinja2") from None

        class Generation(Extension):
            """`{% generation %}...{% endgeneration %}`: marks what it renders as an assistant span."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                return _SPAN_START + caller() + _SPAN_END

        self.source, self.tokenizer = source, tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, Generation])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise UserError(f"{where} does not parse ({e}): fix it") from None
        self.marks_spans = bool(_GENERATION_TAG.search(source))
        files = getattr(tokenizer, "files", None)
        declared = declared_tokens(folder, Path(files[0]).parent if files else None)
        config = declared or {}
        # What the tokenizer files declare, as transformers renders them: a token they name none of is "" (OLMo 2's
        # bos). A bare tokenizer file declares nothing: its bos and eos are then those lmforge's export writes into
        # tokenizer_config.json (lmforge.models.hf.tokenizer), as are a built-in template's, which writes eos itself.
        self.variables = {f"{k}_token": _token_text(config.get(f"{k}_token")) or ""
                          for k in ("bos", "eos", "unk", "pad")}
        for key, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id if tokenizer.eos_id is not None
                                                           else tokenizer.eod_id)):
            if (declared is None or builtin) and not self.variables[f"{key}_token"] and i is not None:
                self.variables[f"{key}_token"] = tokenizer.id_to_token(i) or ""
        # Every special token, as transformers' tokenizer(rendered, add_special_tokens=False) reads the template's
        # text: the tokenizer's own (transformers 5 keeps added tokens only in tokenizer.json) and those the config
        # names (transformers 4's additional_special_tokens and added_tokens_decoder, 5's extra_special_tokens).
        extra = config.get("extra_special_tokens") or []
        named = [*self.variables.values(), *(config.get("additional_special_tokens") or []),
                 *(extra.values() if isinstance(extra, dict) else extra),
                 *(t for t in (config.get("added_tokens_decoder") or {}).values()
                   if isinstance(t, dict) and t.get("special"))]
        self.specials = dict(tokenizer.special_tokens)
        self._add_specials([s for s in map(_token_text, named) if s])
        self._add_specials(("<|im_start|>", "<|im_end|>") if "<|im_start|>" in source else ())
        # Longest first, so that "<|im_start|>" is not read as a shorter token inside it; one marked typed is text.
        names = "|".join(map(re.escape, sorted(self.specials, key=len, reverse=True)))
        self._special_re = re.compile(f"{_TYPED}?(?:{names})")

    def _add_specials(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in self.specials and (i := self.tokenizer.token_to_id(name)) is not None:
                self.specials[name] = i

    @classmethod
    def from_folder(cls, tokenizer, folder: str | Path) -> ChatTemplate | None:
        source = read_chat_template(folder)
        return None if source is None else cls(source, tokenizer, folder, f"the chat template of {folder}")

    # -- rendering ----------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's text for `messages`, {% generation %} blocks marked as spans (TemplateRefused)."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.variables)
        except TemplateError as e:
            raise TemplateRefused(str(e)) from None

    def _typed(self, messages: Sequence[dict], prompt: bool) -> Sequence[dict]:
        """`messages` with each special token's text in a content marked as typed, where the template renders them as
        it renders `messages` (marks aside); else `messages`, its tokens then read as transformers reads them."""
        if not self.specials or not any(self._special_re.search(m["content"]) for m in messages):
            return messages
        typed = [{**m, "content": self._special_re.sub(lambda t: _TYPED + t.group(), m["content"])} for m in messages]
        try:
            same = self.render(typed, prompt).replace(_TYPED, "") == self.render(messages, prompt)
        except TemplateRefused:
            same = False
        return typed if same else messages

    def _spans_by_prefix(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The whole render with each assistant message's span marked, found from renders turn by turn."""
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
                raise TemplateRefused(f"the generation prompt is not how the template starts assistant message {i} "
                                      f"({where}), so its answer cannot be found turn by turn; give the template "
                                      "{% generation %} blocks or choose another data.chat_template")
            if not full.startswith(after) or len(before) < at:
                where = _parting(after, full, ("its turn", "the whole chat"), messages)
                raise TemplateRefused(f"rendering the chat turn by turn does not give prefixes of the whole chat (at "
                                      f"message {i}, {where}): the template rewrites earlier turns; give it "
                                      "{% generation %} blocks or choose another data.chat_template")
            out += [full[at : len(before)], _SPAN_START, full[len(before) : len(after)], _SPAN_END]
            at = len(after)
        return "".join(out) + full[at:]

    def _closing(self, messages: Sequence[dict], rendered: str) -> int:
        """Where `rendered` (`messages` without the generation prompt) ends before what the template writes only to
        close a whole chat (Phi-3's "{% else %}{{ eos_token }}"): where it parts from the render with the generation
        prompt, at the start of a special token split there; no message's text may follow (a probe put at the end of
        each content must come before it). That text closes the chat, it is no answer's: it is in no span, and a turn
        followed by more messages is a prefix of the chat without it."""
        try:
            prompted = self.render(messages, True)
        except TemplateRefused:
            return len(rendered)
        k = len(os.path.commonprefix([rendered, prompted]))
        k = next((m.start() for m in self._special_re.finditer(rendered) if m.start() < k < m.end()), k) \
            if self.specials else k
        if k == len(rendered):
            return k
        try:
            probed = self.render([{**m, "content": m["content"] + _PROBE} for m in messages], False)
        except TemplateRefused:
            return len(rendered)
        return k if probed.endswith(rendered[k:]) and _PROBE not in probed[k - len(rendered) :] else len(rendered)

    def pieces(self, messages: Sequence[dict], add_generation_prompt: bool, spans: bool = True) -> list[Piece]:
        """The rendered chat as text runs and special-token ids, each flagged in or out of an assistant span.

        spans=False (serving a template without {% generation %} blocks that cannot be split turn by turn):
        no spans, the text cut at special tokens only.
        """
        for i, m in enumerate(messages):
            if found := _INTERNAL.search(m["content"]):
                raise TemplateRefused(f"message {i} holds the character U+{ord(found.group()):04X}, a Unicode "
                                      "noncharacter that lmforge uses to mark the render: remove it from the text")
        messages = self._typed(messages, add_generation_prompt)
        if self.marks_spans or not spans:
            rendered = self.render(messages, add_generation_prompt)
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
        """Append rendered text to `out`: text runs cut at each special token the template wrote, and its id."""
        at = 0
        for m in self._special_re.finditer(part) if self.specials else ():
            if not m.group().startswith(_TYPED):
                if text := part[at : m.start()].replace(_TYPED, ""):
                    out.append((text, in_span))
                out.append((self.specials[m.group()], in_span))
                at = m.end()
        if text := part[at:].replace(_TYPED, ""):
            out.append((text, in_span))

    # -- ids ----------------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Ids of a chat so far plus the generation prompt: what the model continues (TemplateRefused)."""
        chat = [{"role": "system" if role == "developer" else role, "content": content} for role, content in messages]
        try:
            pieces = self.pieces(chat, True)
        except TemplateRefused:  # a template that rewrites earlier turns: no spans to cut at, as transformers
            pieces = self.pieces(chat, True, spans=False)
        return encode_pieces(self.tokenizer, [pieces])[0][0]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Turn ends the template writes that are text, not a token, in this tokenizer: generation stops at them."""
        return tuple(s for s in ("<|im_end|>",) if s in self.source and s not in self.specials)


def encode_pieces(tokenizer, chats: Sequence[list[Piece]]) -> list[tuple[list[int], list[bool]]]:
    """(ids, in-span flags) per chat. The text between two special tokens is tokenized whole, as transformers
    tokenizes a rendered chat, and a token is in a span when any character it covers is (transformers'
    assistant mask): an answer that starts inside a text run (Llama 2's "[/INST] " + answer) gets the tokens the
    whole text has, not a separately encoded piece's (SentencePiece's prefix space again). Every run goes through
    one batched encode."""
    runs: list[tuple[str, list[tuple[int, int]]]] = []
    continued: list[bool] = []  # whether a run follows a special token (lmforge.tokenizers: encode_batch_offsets)
    layouts = []
    for pieces in chats:
        layout: list[tuple[int, bool] | int] = []  # (special id, in span), or the index of a text run
        text, spans = "", []
        for p, in_span in [*pieces, (None, False)]:
            if isinstance(p, str):
                if in_span:
                    spans.append((len(text), len(text) + len(p)))
                text += p
                continue
            if text:
                continued.append(bool(layout))
                layout.append(len(runs))
                runs.append((text, spans))
            text, spans = "", []
            if p is not None:
                layout.append((p, in_span))
        layouts.append(layout)
    encoded = tokenizer.encode_batch_offsets([text for text, _ in runs], continued) if runs else []
    out = []
    for layout in layouts:
        ids: list[int] = []
        mask: list[bool] = []
        for item in layout:
            if isinstance(item, tuple):
                ids.append(item[0])
                mask.append(item[1])
                continue
            got, offsets = encoded[item]
            spans = runs[item][1]
            ids += got
            # A token that covers no characters (a prefix space of its own) counts where it stands.
            mask += [any(a < max(end, start + 1) and start < b for a, b in spans) for start, end in offsets]
        out.append((ids, mask))
    return out


def check_messages(messages, where: str) -> list[dict]:
    """`messages` as {role, content} dicts up to the last assistant message (later turns teach nothing)."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, \"content\": "
                            f"a string}}, got {json.dumps(m, ensure_ascii=False)[:80]}")
        out.append({"role": m["role"], "content": m["content"]})
    last = max((i for i, m in enumerate(out) if m["role"] == "assistant"), default=None)
    if last is None:
        raise UserError(f"{where}: the chat has no assistant message, so nothing to learn: add one or drop the record")
    return out[: last + 1]


def _parting(one: str, other: str, names: tuple[str, str], messages: Sequence[dict]) -> str:
    """Where two renders part, for an error: each one's text there, messages' contents named."""
    k = len(os.path.commonprefix([one, other]))
    index = {m["content"]: f"{{message {i}}}" for i, m in reversed(list(enumerate(messages))) if m["content"]}
    named = re.compile("|".join(map(re.escape, sorted(index, key=len, reverse=True)))) if index else None

    def show(text: str) -> str:
        text = named.sub(lambda m: index[m.group()], text[k:]) if named else text[k:]
        return repr(text.replace(_TYPED, "")[:40])

    return f"{names[0]} has {show(one)} where {names[1]} has {show(other)}"


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters ("<" as "\u003c"), which a chat must not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
