"""Chat templates: messages -> token ids, for serving (the prompt) and fine-tuning (which ids are
the assistant's).

A template is Hugging Face's Jinja chat template: a model folder's (chat_template.jinja, else
tokenizer_config.json's "chat_template"), a file, or one of the built-ins below. It is rendered in
Jinja's immutable sandbox, as transformers does, with `messages`, `add_generation_prompt`, the
special tokens (`bos_token`, `eos_token` ...), `tools=None`, `raise_exception`, `strftime_now` and
transformers' `tojson`.

The messages' own text is rendered, so the text is apply_chat_template(tokenize=False)'s whatever
the template does to a content (`| trim`, Qwen3's split at "</think>"). Special tokens that the
template writes ("<s>", "<|im_start|>") become their ids; the same strings typed in a message stay
text: each is marked in the content before rendering, and only unmarked ones are read as tokens
(transformers reads them anywhere, which lets a user forge turns). A template that renders the
marked chat otherwise than the chat (it reads the typed token: `content.split('<|eot_id|>')`) gets
transformers' reading, every such string a token.

Assistant spans (what fine-tuning puts the loss on) come from the template's `{% generation %}`
blocks where it has them (transformers' `return_assistant_tokens_mask` reads the same blocks);
otherwise from rendering the chat turn by turn: the span of assistant message i is what rendering
messages[:i+1] adds to rendering messages[:i] with the generation prompt. Text that the template
writes only to close a whole chat (Phi-3's eos where there is no generation prompt) is in no span. A
template whose renders are not prefixes of each other that way (one that rewrites earlier turns, as
Qwen3's drops the reasoning of answers before the last question) cannot be split so and is refused
for training, with that reason.

Text is tokenized in runs cut at each special token, each run whole (as transformers tokenizes the
rendered text), and a token is in an assistant span when any character it covers is: a served prompt
is then token for token the prompt the model was trained on, earlier answers included. A run after a
special token gets no prefix space from a tokenizer that puts one only at the start of an input
(Metaspace "first", transformers' non-legacy conversion), and gets one from those that put it on
every text (Meta's tokenizer.model, legacy tokenizer.json files): as each of them tokenizes a whole
rendered chat.

The special tokens a template sees (`ChatTemplate.__init__`) are what the tokenizer files declare,
as transformers renders them: a token they name none of is "" (OLMo 2's bos). A bare tokenizer file
declares nothing: its bos and eos are then those lmforge's export writes into tokenizer_config.json
(lmforge.models.hf.tokenizer), as are a built-in template's, which writes eos itself. The tokens
read as tokens in the rendered text are those that transformers'
`tokenizer(rendered, add_special_tokens=False)` reads: the tokenizer's own (transformers 5 keeps
added tokens only in tokenizer.json) and those the config names (transformers 4's
additional_special_tokens and added_tokens_decoder, 5's extra_special_tokens).

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
import string
from collections.abc import Sequence
from pathlib import Path

from lmforge.chat_render import Piece, TemplateRefused, TemplateRender  # noqa: F401 (callers import it here)
from lmforge.errors import UserError
from lmforge.fsutil import folder_file

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# transformers 5's name; it wins over tokenizer_config.json's
CHAT_TEMPLATE_FILE = "chat_template.jinja"

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
        "{% if message['role'] == 'assistant' %}"
        + _ANSWER
        + "{% else %}{{ message['content'] }}{% endif %}"
        "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "plain": (
        "{% for message in messages %}{% if message['role'] == 'assistant' %}"
        + _ANSWER
        + "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
    ),
}
BUILTIN = ("lmforge", "chatml", "alpaca", "plain")


def _jinja_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Jinja string literal


def prompt_template_jinja(prompt_template: str | None) -> str:
    """The Alpaca-style built-in: each user message formatted as `prompt_template`'s instruction
    (Stanford Alpaca's no-input prompt by default), each answer followed by eos."""
    fmt = prompt_template if prompt_template is not None else ALPACA_PROMPT_NO_INPUT
    parts = []
    for literal, field, _, _ in string.Formatter().parse(fmt):
        if literal:
            parts.append(_jinja_literal(literal))
        if field == "instruction":
            parts.append("message['content']")
    prompt = " + ".join(parts) or "''"
    return (
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ " + prompt + " }}"
        "{% elif message['role'] == 'assistant' %}" + _ANSWER + "{% endif %}{% endfor %}"
    )


def builtin_template(name: str, add_bos: bool, prompt_template: str | None = None) -> str:
    """The Jinja source of built-in template `name`, starting with bos where the tokenizer's
    texts do."""
    if name not in BUILTIN:
        raise UserError(
            f"unknown chat template '{name}': choose a built-in ({', '.join(BUILTIN)}), "
            "'auto', 'model' or a .jinja file"
        )
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
    """The tokenizer config of the first folder that has tokenizer_config.json or
    special_tokens_map.json, the latter's tokens over the former's (as transformers reads them);
    None where none has either."""
    for folder in filter(None, folders):
        if any(
            (Path(folder) / name).is_file()
            for name in ("tokenizer_config.json", "special_tokens_map.json")
        ):
            tokens = {
                k: v
                for k, v in tokenizer_config(Path(folder), "special_tokens_map.json").items()
                if v
            }
            return tokenizer_config(Path(folder)) | tokens
    return None


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate(TemplateRender):
    """A Jinja chat template bound to a tokenizer: `source` is its text, `folder` (optional) the
    tokenizer folder whose tokenizer_config.json names the special tokens (else the tokenizer
    file's folder); `builtin`: one of lmforge's templates (BUILTIN)."""

    def __init__(
        self,
        source: str,
        tokenizer,
        folder: str | Path | None = None,
        where: str = "the chat template",
        builtin: bool = False,
    ):
        self.tokenizer = tokenizer
        files = getattr(tokenizer, "files", None)
        declared = declared_tokens(folder, Path(files[0]).parent if files else None)
        config = declared or {}
        # The declared tokens as transformers renders them ("" for one not named: OLMo 2's bos); a
        # bare tokenizer file or a built-in template gets the bos/eos lmforge's export writes.
        variables = {
            f"{k}_token": _token_text(config.get(f"{k}_token")) or ""
            for k in ("bos", "eos", "unk", "pad")
        }
        for key, i in (
            ("bos", tokenizer.bos_id),
            ("eos", tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.eod_id),
        ):
            if (declared is None or builtin) and not variables[f"{key}_token"] and i is not None:
                variables[f"{key}_token"] = tokenizer.id_to_token(i) or ""
        # Every special token transformers reads in the rendered text: the tokenizer's own and those
        # the config names, in transformers 4's and 5's keys (see the module docstring).
        extra = config.get("extra_special_tokens") or []
        named = [
            *variables.values(),
            *(config.get("additional_special_tokens") or []),
            *(extra.values() if isinstance(extra, dict) else extra),
            *(
                t
                for t in (config.get("added_tokens_decoder") or {}).values()
                if isinstance(t, dict) and t.get("special")
            ),
        ]
        specials = dict(tokenizer.special_tokens)
        for name in [
            *(s for s in map(_token_text, named) if s),
            *(("<|im_start|>", "<|im_end|>") if "<|im_start|>" in source else ()),
        ]:
            if name not in specials and (i := tokenizer.token_to_id(name)) is not None:
                specials[name] = i
        super().__init__(source, variables, specials, where)

    @classmethod
    def from_folder(cls, tokenizer, folder: str | Path) -> ChatTemplate | None:
        source = read_chat_template(folder)
        return (
            None
            if source is None
            else cls(source, tokenizer, folder, f"the chat template of {folder}")
        )

    # -- ids ----------------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Ids of a chat so far plus the generation prompt: what the model continues
        (TemplateRefused). Rendered once, without spans: they would only flag the ids, and
        finding them turn by turn renders the chat once per answer."""
        pieces = self.pieces(chat_messages(messages), True, spans=False)
        return encode_pieces(self.tokenizer, [pieces])[0][0]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Turn ends the template writes that are text, not a token, in this tokenizer:
        generation stops at them."""
        return tuple(s for s in ("<|im_end|>",) if s in self.source and s not in self.specials)


def encode_pieces(tokenizer, chats: Sequence[list[Piece]]) -> list[tuple[list[int], list[bool]]]:
    """(ids, in-span flags) per chat. The text between two special tokens is tokenized whole, as
    transformers tokenizes a rendered chat, and a token is in a span when any character it covers
    is (transformers' assistant mask): an answer that starts inside a text run (Llama 2's
    "[/INST] " + answer) gets the tokens the whole text has, not a separately encoded piece's
    (SentencePiece's prefix space again). Every run goes through one batched encode."""
    runs: list[tuple[str, list[tuple[int, int]]]] = []
    # whether a run follows a special token (lmforge.tokenizers: encode_batch_offsets)
    continued: list[bool] = []
    layouts = []
    for pieces in chats:
        # (special id, in span), or the index of a text run
        layout: list[tuple[int, bool] | int] = []
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
            mask += [
                any(a < max(end, start + 1) and start < b for a, b in spans)
                for start, end in offsets
            ]
        out.append((ids, mask))
    return out


def chat_messages(messages: Sequence[tuple[str, str] | dict]) -> list[dict]:
    """(role, text) pairs (or message objects) as a template's `messages`; OpenAI's "developer"
    is the system."""
    out = []
    for m in messages:
        m = m if isinstance(m, dict) else {"role": m[0], "content": m[1]}
        out.append({**m, "role": "system" if m["role"] == "developer" else m["role"]})
    return out


def check_messages(messages, where: str) -> list[dict]:
    """`messages` as {role, content} dicts up to the last assistant message (later turns teach
    nothing)."""
    if not isinstance(messages, list) or not messages:
        raise UserError(
            f"{where}: 'messages' must be a non-empty list of {{role, content}} objects"
        )
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("content"), str)
            or m.get("role") not in ROLES
        ):
            raise UserError(
                f'{where}: message {i} must be {{"role": one of {", ".join(ROLES)}, "content": '
                f"a string}}, got {json.dumps(m, ensure_ascii=False)[:80]}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    last = max((i for i, m in enumerate(out) if m["role"] == "assistant"), default=None)
    if last is None:
        raise UserError(
            f"{where}: the chat has no assistant message, so nothing to learn: add one or drop the record"
        )
    return out[: last + 1]
