"""Supervised fine-tuning data: instruction and chat records -> token ids with the loss on the
answers only.

Record kinds, told apart per record (a JSON list file or JSON lines, see `read_json_records`):

* chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}` (OpenAI /
  Hugging Face chat format). Every assistant turn is an answer; messages after the last one teach
  nothing and are left out.
* Alpaca: `{"instruction", "input" (optional, may be ""), "output"}`; Self-Instruct seed tasks
  (Alpaca's `seed_tasks.jsonl`): `{"instruction", "instances": [{"input", "output"}]}`, each
  instance one example.
* prompt/completion: `{"prompt", "completion"}`, strings (or, as in TRL, lists of chat messages).

Every record becomes a chat (user, assistant ...) rendered by a chat template
(lmforge.chat_template), which also says which tokens are the assistant's. `chat_template`:

* a ChatTemplate (the model's own, a named built-in or a file: the `data.chat_template` setting):
  every record goes through it; an Alpaca record's user message is its instruction, then a blank
  line and its input if any;
* None (a base model without a template): chats render with the built-in "lmforge" template, Alpaca
  records as Stanford Alpaca's prompt (`PROMPT_DICT` in tatsu-lab/stanford_alpaca `train.py`, with
  and without input, ending in "### Response:"; or a user `prompt_template` with `{instruction}` and
  optionally `{input}`, literal braces doubled), prompt/completion records as their text; each
  answer is followed by eos. `export_template` is then the built-in that reproduces this at serving
  time ("lmforge" for chats, "alpaca" for Alpaca records, "plain" for prompt/completion), so a
  fine-tuned model is served in the format it learned.

Labels equal `input_ids` on the assistant spans (the answer and the end-of-turn tokens the template
writes there), IGNORE_INDEX (-100) elsewhere (`assistant_only_loss=False`: everywhere): aligned with
`input_ids`, the Hugging Face convention, where the loss shifts them by one. The first token of an
example never has a label, so in a packed sequence no token is trained to predict the next example.
bos: where the template writes it (the built-ins: where the tokenizer's texts start with it,
`Tokenizer.add_bos_token`).

Length, `seq_length`: an example longer than it is cut to its first `seq_length` tokens
(`truncate="cut"`, the default, as `data.truncate`'s; counted in `num_cut`; an example left without
a label is then dropped) or dropped (`truncate="drop"`, counted in `num_dropped`). Without packing,
an item is one example and the collator right-pads a batch to its longest (`pad_id`: the tokenizer's
pad, else its eos). With packing, examples are placed first-fit in order into sequences of exactly
`seq_length` tokens; an item then adds `position_ids` restarting at 0 for each example and
`segment_ids` (1, 2, ... per example, 0 on padding), so attention can be kept within an example.
"""

from __future__ import annotations

import collections
import itertools
import logging
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lmforge.chat_template import (
    ALPACA_PROMPT_INPUT,
    ALPACA_PROMPT_NO_INPUT,
    CHAT_TEMPLATE_FILE,
    ChatTemplate,
    TemplateRefused,
    builtin_template,
    check_messages,
    encode_pieces,
)
from lmforge.data.collate import IGNORE_INDEX, PadCollator, read_json_records
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

TRUNCATE = ("drop", "cut")
# How a record kind is rendered when no chat template is given, and the built-in that serves it the
# same way.
KIND_TEMPLATE = {"chat": "lmforge", "alpaca": "plain", "plain": "plain"}
KIND_EXPORT = {"chat": "lmforge", "alpaca": "alpaca", "plain": "plain"}
# KIND_TEMPLATE as a run names it (an Alpaca record's built-in is plain text of Stanford's prompt).
KIND_RENDERING = {
    "chat": "the built-in lmforge",
    "alpaca": "Stanford Alpaca's prompt",
    "plain": "the built-in plain",
}

# One example: its kind ("chat", "alpaca", "plain"), its messages, and where it came from
# (file:line).
Example = tuple[str, list[dict], str]


def _fields(template: str, what: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise UserError(
            f"{what} {template!r} is not a valid template ({e}): double literal braces"
        ) from None


class PromptTemplate:
    """Alpaca's two templates by default, or one user template with `{instruction}` and
    `{input}`."""

    def __init__(self, template: str | None = None):
        if template is not None:
            names = _fields(template, "prompt template")
            if "instruction" not in names or not names <= {"instruction", "input"}:
                raise UserError(
                    f"prompt template {template!r} has placeholders {sorted(names)}: it needs {{instruction}} "
                    "and may have {input}, nothing else (double literal braces)"
                )
        self.template = template

    def format(self, instruction: str, input: str = "") -> str:
        if self.template is not None:
            return self.template.format(instruction=instruction, input=input)
        if input:
            return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=input)
        return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _turn(value, role: str, key: str, where: str) -> list[dict]:
    """A prompt/completion field as messages: a string is one message of `role`, a list is chat
    messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise UserError(f"{where}: '{key}' must be a string or a list of {{role, content}} messages")


def record_examples(
    rec: dict, where: str, prompt: PromptTemplate, templated: bool
) -> list[Example]:
    """The examples in one record (a seed task holds several). `templated`: a chat template
    renders every kind, so an Alpaca prompt is its instruction (and input) as a user message, not
    the Alpaca prompt text."""
    if "messages" in rec:
        return [("chat", check_messages(rec["messages"], where), where)]
    if "prompt" in rec and "completion" in rec:
        messages = _turn(rec["prompt"], "user", "prompt", where) + _turn(
            rec["completion"], "assistant", "completion", where
        )
        kind = (
            "plain"
            if isinstance(rec["prompt"], str) and isinstance(rec["completion"], str)
            else "chat"
        )
        return [(kind, check_messages(messages, where), where)]
    if "instruction" in rec and ("output" in rec or "instances" in rec):
        instances = rec["instances"] if "output" not in rec else [rec]
        if not isinstance(instances, list):
            raise UserError(f"{where}: 'instances' must be a list of {{input, output}} objects")
        out = []
        for inst in instances:
            values = [
                rec["instruction"],
                inst.get("input", "") if isinstance(inst, dict) else None,
                inst.get("output") if isinstance(inst, dict) else None,
            ]
            if not all(isinstance(v, str) for v in values):
                raise UserError(f"{where}: 'instruction', 'input' and 'output' must be strings")
            instruction, input, output = values
            user = (
                (instruction + (f"\n\n{input}" if input else ""))
                if templated
                else prompt.format(instruction, input)
            )
            out.append(
                (
                    "alpaca",
                    [{"role": "user", "content": user}, {"role": "assistant", "content": output}],
                    where,
                )
            )
        return out
    dpo = (
        " (prompt/chosen/rejected is DPO data: set data.task=dpo)"
        if {"chosen", "rejected"} <= set(rec)
        else ""
    )
    raise UserError(
        f"{where}: unknown record kind with keys {sorted(rec)}: give messages (chat), instruction/input/output "
        f"(Alpaca), instruction/instances (seed tasks) or prompt/completion{dpo}"
    )


def resolve_chat_template(
    setting: str,
    tokenizer: Tokenizer,
    folder: str | Path | None,
    prompt_template: str | None = None,
) -> ChatTemplate | None:
    """The chat template that data.chat_template names: "auto" (the model's own if its tokenizer
    folder has one, else None: the built-ins per record kind), "model" (the model's own,
    required), a built-in's name, or a .jinja file."""
    from lmforge.chat_template import BUILTIN

    if setting in ("auto", "model"):
        template = ChatTemplate.from_folder(tokenizer, folder) if folder is not None else None
        if template is None and setting == "model":
            raise UserError(
                f"data.chat_template=model but {folder or 'the tokenizer'} has no chat template "
                f"(chat_template.jinja or tokenizer_config.json): choose a built-in ({', '.join(BUILTIN)})"
            )
        return template
    if setting.endswith(".jinja") or Path(setting).is_file():
        path = Path(setting)
        if not path.is_file():
            raise UserError(f"data.chat_template: file {path} not found")
        return ChatTemplate(
            path.read_text(encoding="utf-8"), tokenizer, folder, f"chat template {path}"
        )
    source = builtin_template(setting, tokenizer.add_bos_token, prompt_template)
    return ChatTemplate(
        source, tokenizer, folder, f"the built-in chat template {setting}", builtin=True
    )


def template_origin(setting: str, folder: str | Path) -> str:
    """Where the template that resolve_chat_template(setting, tokenizer, folder) found comes
    from, as a run says it: the model's file (chat_template.jinja wins over
    tokenizer_config.json, as read_chat_template reads them), a .jinja file, or a built-in."""
    if setting in ("auto", "model"):
        path = Path(folder) / CHAT_TEMPLATE_FILE
        return f"the model's, from {path if path.is_file() else Path(folder) / 'tokenizer_config.json'}"
    if setting.endswith(".jinja") or Path(setting).is_file():
        return f"file {setting}"
    return f"the built-in {setting}"


def kind_rendering(kinds: collections.Counter, prompt_template: str | None = None) -> str:
    """What renders each record kind of `kinds` without a chat template (KIND_TEMPLATE), most
    common first."""
    said = (
        {**KIND_RENDERING, "alpaca": "data.prompt_template"} if prompt_template else KIND_RENDERING
    )
    (first, _), *others = kinds.most_common()
    return ", ".join(
        [
            f"{said[first]} renders the {first} examples",
            *(f"{said[kind]} the {kind} examples" for kind, _ in others),
        ]
    )


def tokenize_examples(
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    assistant_only_loss: bool = True,
    prompt_template: str | None = None,
    context_answers: Sequence[int] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) per example, rendered by `template` (None: the built-in of each
    example's kind).

    context_answers: per example, how many of its first assistant messages are context, not
    trained on (a DPO prompt's earlier turns)."""
    builtins: dict[str, ChatTemplate] = {}
    chats = []
    for e, (kind, messages, where) in enumerate(examples):
        t = template
        if t is None:
            name = KIND_TEMPLATE[kind]
            if name not in builtins:
                builtins[name] = ChatTemplate(
                    builtin_template(name, tokenizer.add_bos_token, prompt_template),
                    tokenizer,
                    where=f"the built-in chat template {name}",
                    builtin=True,
                )
            t = builtins[name]
        try:
            pieces = t.pieces(messages, False)
        except TemplateRefused as e:
            raise UserError(f"{where}: the chat template cannot render this chat ({e})") from None
        if context_answers and context_answers[e]:
            pieces = _drop_spans(pieces, context_answers[e])
        last = max((i for i, (_, in_span) in enumerate(pieces) if in_span), default=None)
        if last is None:
            raise UserError(
                f"{where}: the chat template marks no assistant tokens in this chat: check that it "
                "renders assistant messages"
            )
        chats.append(pieces[: last + 1])  # what follows the last answer teaches nothing
    out = []
    for ids, mask in encode_pieces(tokenizer, chats):
        ids_array = np.array(ids, np.int64)
        labels = ids_array.copy()
        if assistant_only_loss:
            labels[~np.array(mask, bool)] = IGNORE_INDEX
        labels[0] = IGNORE_INDEX  # see the module docstring: never learn across a packing boundary
        out.append((ids_array, labels))
    return out


def _ends_turn(tok: Tokenizer, trained: np.ndarray, stop_strings: tuple[str, ...] = ()) -> bool:
    """Whether an answer's trained tokens end in an end-of-turn token: eos, eod or another
    special one, whitespace after it aside (ChatML's "<|im_end|>\\n", Gemma's "<end_of_turn>\\n"
    are trained to the newline); or in one of the template's `stop_strings`, turn ends that are
    text in this tokenizer, at which generation stops."""
    for i in trained[::-1].tolist():
        if i in (tok.eos_id, tok.eod_id) or tok.is_special(i):
            return True
        if tok.decode([i]).strip():
            break
    if not stop_strings:
        return False
    # Decoded, not matched token by token: the text's first piece may merge with the answer's end
    # (Llama's ".<"). a token holds a character at least
    tail = trained[-(max(map(len, stop_strings)) + 8) :].tolist()
    return tok.decode(tail).rstrip().endswith(stop_strings)


def _drop_spans(pieces: list, count: int) -> list:
    """`pieces` with their first `count` assistant spans marked out of span."""
    out, spans, inside = [], 0, False
    for p, in_span in pieces:
        if in_span and not inside:
            spans += 1
        inside = in_span
        out.append((p, in_span and spans > count))
    return out


def pack_first_fit(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Example indices per sequence: each example, in order, goes into the first sequence with
    room for it."""
    free = np.zeros(max(len(lengths), 1), np.int64)  # room left in each open sequence
    packs: list[list[int]] = []
    for i, n in enumerate(lengths):
        if n > seq_length:
            raise ValueError(f"example {i} has {n} tokens, more than seq_length {seq_length}")
        fits = free[: len(packs)] >= n
        j = int(fits.argmax()) if fits.any() else len(packs)
        if j == len(packs):
            packs.append([])
            free[j] = seq_length
        packs[j].append(i)
        free[j] -= n
    return packs


class SFTDataset(Dataset):
    """Instruction / chat examples, tokenized at construction; see the module docstring for the
    rules."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer | str | Path,
        seq_length: int,
        packing: bool = False,
        truncate: str = "cut",
        prompt_template: str | None = None,
        chat_template: ChatTemplate | str | None = None,
        assistant_only_loss: bool = True,
        max_records: int | None = None,
    ):
        """chat_template: a ChatTemplate, the name of a built-in, or None (see the module
        docstring); max_records: the file's first N records only."""
        if truncate not in TRUNCATE:
            raise UserError(f"truncate must be one of {', '.join(TRUNCATE)}, not {truncate!r}")
        if seq_length < 2:
            raise UserError(f"seq_length must be at least 2, not {seq_length}")
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        if isinstance(chat_template, str):
            chat_template = resolve_chat_template(chat_template, tok, None, prompt_template)
        self.path, self.seq_length, self.packing = Path(path), seq_length, packing
        self.pad_id = (
            tok.pad_id
            if tok.pad_id is not None
            else tok.eos_id
            if tok.eos_id is not None
            else tok.eod_id
        )
        self.collate = PadCollator(self.pad_id)

        prompt = PromptTemplate(prompt_template)
        templated = chat_template is not None
        records = list(itertools.islice(read_json_records(path), max_records))
        examples = [
            ex for where, rec in records for ex in record_examples(rec, where, prompt, templated)
        ]
        # the records' kind whose built-in template the export carries (none:
        # chat_template's)
        self.kind = None
        self.kinds = kinds = collections.Counter(kind for kind, _, _ in examples)
        if chat_template is not None:
            self.export_template = chat_template.source
        else:  # the built-in that serves the most common kind as it was trained (chats first)
            kind = self.kind = next(k for k in ("chat", "alpaca", "plain") if k in kinds)
            self.export_template = builtin_template(
                KIND_EXPORT[kind], tok.add_bos_token, prompt_template
            )
            if len(kinds) > 1:
                logger.warning(
                    "%s mixes record kinds (%s), each rendered by its own built-in template; the export "
                    "carries %s's (%s), so the others are served in a format they were not trained in: set "
                    "data.chat_template=NAME to render every record alike",
                    self.path,
                    ", ".join(f"{n} {k}" for k, n in kinds.most_common()),
                    kind,
                    KIND_EXPORT[kind],
                )
            with_input = sum(isinstance(rec, dict) and bool(rec.get("input")) for _, rec in records)
            if kind == "alpaca" and with_input:
                logger.warning(
                    "%s: %d Alpaca records have an input, trained with Stanford's with-input prompt, "
                    "which a chat request cannot ask for: served, instruction and input arrive as one user "
                    "message in the no-input prompt (data.chat_template=alpaca trains them that way too)",
                    self.path,
                    with_input,
                )
        self.num_dropped = self.num_cut = 0
        self.examples: list[tuple[np.ndarray, np.ndarray]] = []
        for ids, labels in tokenize_examples(
            examples, tok, chat_template, assistant_only_loss, prompt_template
        ):
            if len(ids) > seq_length:
                if truncate == "drop" or (labels[:seq_length] == IGNORE_INDEX).all():
                    self.num_dropped += 1
                    continue
                ids, labels = ids[:seq_length], labels[:seq_length]
                self.num_cut += 1
            self.examples.append((ids, labels))
        if not self.examples:
            raise UserError(
                f"{path}: no example fits seq_length {seq_length}: raise it or pass truncate='cut'"
            )
        scored = (labels[labels != IGNORE_INDEX] for _, labels in self.examples)
        stops = chat_template.stop_strings if chat_template is not None else ()
        if assistant_only_loss and not any(_ends_turn(tok, s, stops) for s in scored if len(s)):
            logger.warning(
                "%s: no answer ends in an end-of-turn token (eos or another special one): the chat "
                "template writes none inside the answer's span, so the model does not learn to stop; a "
                "template that ends answers with eos (the built-ins do) teaches it",
                self.path,
            )
        self.num_tokens = sum(len(ids) for ids, _ in self.examples)
        self.packs = (
            pack_first_fit([len(ids) for ids, _ in self.examples], seq_length) if packing else None
        )
        longer = self.num_dropped + self.num_cut
        logger.info(
            "%s: %d of %d examples kept, %d tokens; %d longer than seq_length %d: %d cut to it, %d dropped "
            "(truncate=%s%s)%s",
            path,
            len(self.examples),
            len(self.examples) + self.num_dropped,
            self.num_tokens,
            longer,
            seq_length,
            self.num_cut,
            self.num_dropped,
            truncate,
            ": cut examples left without an answer token are dropped" if truncate == "cut" else "",
            f"; packed into {len(self.packs)} sequences ({self.packing_efficiency:.1%} tokens, not padding)"
            if packing
            else "",
        )

    @property
    def packing_efficiency(self) -> float:
        """Share of packed positions holding a real token."""
        return self.num_tokens / (len(self.packs) * self.seq_length) if self.packs else 1.0

    def __len__(self) -> int:
        return len(self.packs) if self.packs is not None else len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.packs is None:
            ids, labels = self.examples[i]
            return {
                "input_ids": torch.from_numpy(ids),
                "labels": torch.from_numpy(labels),
                "attention_mask": torch.ones(len(ids), dtype=torch.int64),
            }
        n = self.seq_length
        item = {
            "input_ids": torch.full((n,), self.pad_id, dtype=torch.int64),
            "labels": torch.full((n,), IGNORE_INDEX, dtype=torch.int64),
            "attention_mask": torch.zeros(n, dtype=torch.int64),
            "position_ids": torch.zeros(n, dtype=torch.int64),
            "segment_ids": torch.zeros(n, dtype=torch.int64),
        }
        start = 0
        for segment, e in enumerate(self.packs[i], start=1):
            ids, labels = self.examples[e]
            end = start + len(ids)
            item["input_ids"][start:end] = torch.from_numpy(ids)
            item["labels"][start:end] = torch.from_numpy(labels)
            item["attention_mask"][start:end] = 1
            item["position_ids"][start:end] = torch.arange(len(ids))
            item["segment_ids"][start:end] = segment
            start = end
        return item
