"""GRPO's prompts: a JSON-lines file, one prompt per record, and the record's other fields for the rewards.

    {"prompt": "What is 6 x 7? Answer in \\\\boxed{}.", "answer": "42"}
    {"prompt": [{"role": "user", "content": "What is 6 x 7?"}], "answer": "#### 42"}
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}], "answer": "4"}

A text prompt is tokenized as it is (bos as the tokenizer's rule says), as TRL uses a plain prompt. A chat prompt (a
`prompt` list of messages, or `messages`) is rendered with the chat template and its generation prompt, in Jinja's
sandbox as fine-tuning renders its chats (lmforge.chat_template); it ends with a user (or system) turn, the
completion being the model's. Every other field is kept and handed to the reward functions by name, one value per
completion; chat prompts' completions reach them as `[{"role": "assistant", "content": text}]`, as in TRL.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.chat_render import TemplateRefused
from lmforge.chat_template import ROLES, ChatTemplate, encode_pieces
from lmforge.errors import UserError
from lmforge.inference.text import completion_text

PROMPT_KEYS = ("prompt", "messages")


@dataclass
class PromptRecord:
    prompt: str | list[dict]  # as in the file: what reward functions get as `prompts`
    ids: list[int]  # the tokens the model continues
    columns: dict = field(default_factory=dict)  # the record's other fields

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(
            f"{where}: a chat prompt must be a non-empty list of {{role, content}} messages"
        )
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            shown = json.dumps(m, ensure_ascii=False)[:80]
            raise UserError(
                f'{where}: message {i} must be {{"role": one of {", ".join(ROLES)}, "content": a string}}, got {shown}'
            )
    if value[-1]["role"] == "assistant":
        raise UserError(
            f"{where}: the chat prompt ends with an assistant message: end it with the user's turn "
            "(the model writes the completion)"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_prompts(
    path: str | Path,
    tokenizer,
    template: ChatTemplate | None = None,
    context: int | None = None,
    max_completion_length: int = 0,
) -> list[PromptRecord]:
    """The records of a prompts JSONL file. `template`: renders the chat prompts (a file with one
    and no template is refused). `context`: the model's, which each prompt and
    max_completion_length new tokens must fit."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file {path} not found: check the path")
    records: list[PromptRecord] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{where}: not a JSON object ({e.msg}): one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise UserError(f"{where}: not a JSON object: one JSON object per line")
            records.append(
                _record(record, where, tokenizer, template, context, max_completion_length)
            )
    if not records:
        raise UserError(f"{path} has no records: give one JSON object with a prompt per line")
    return records


def _record(
    record: dict, where: str, tokenizer, template, context, max_completion_length
) -> PromptRecord:
    key = next((k for k in PROMPT_KEYS if k in record), None)
    if key is None:
        fields = ", ".join(sorted(record)) or "none"
        raise UserError(
            f"{where}: the record has no 'prompt' (text or chat messages) or 'messages' (fields: "
            f"{fields}): give each record its prompt"
        )
    value = record[key]
    columns = {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    if isinstance(value, str) and key == "prompt":
        if not value:
            raise UserError(f"{where}: the prompt is empty: give it some text")
        ids = tokenizer.encode(value, add_bos=tokenizer.add_bos_token)
        prompt: str | list[dict] = value
    else:
        prompt = _messages(value, where)
        if template is None:
            raise UserError(
                f"{where}: a chat prompt needs a chat template and this run has none: set "
                "data.chat_template (a built-in, a .jinja file, or model for the model's own)"
            )
        try:
            pieces = template.pieces(prompt, True, spans=False)
        except TemplateRefused as e:
            raise UserError(f"{where}: the chat template cannot render this prompt ({e})") from None
        ids = encode_pieces(tokenizer, [pieces])[0][0]
    if context is not None and len(ids) + max_completion_length > context:
        raise UserError(
            f"{where}: the prompt's {len(ids)} tokens and grpo.max_completion_length "
            f"{max_completion_length} do not fit the model's context of {context}: shorten the prompt "
            "or lower grpo.max_completion_length"
        )
    return PromptRecord(prompt, ids, columns)


def reward_inputs(
    records: Sequence[PromptRecord], num_generations: int
) -> tuple[list, dict[str, list]]:
    """(prompts, columns) for the reward functions: each record's repeated once per completion,
    rows grouped by prompt as the rollout's; a field some records lack is None in theirs."""
    rows = [r for r in records for _ in range(num_generations)]
    names = list(dict.fromkeys(k for r in records for k in r.columns))
    return [r.prompt for r in rows], {k: [r.columns.get(k) for r in rows] for k in names}


def reward_completions(
    tokenizer,
    records: Sequence[PromptRecord],
    completions: Sequence[Sequence[int]],
    num_generations: int,
    stop_token_ids: Sequence[int] = (),
) -> list:
    """The completions' text for the reward functions (a final stop token and special tokens left
    out); a chat prompt's as one assistant message."""
    stops = set(stop_token_ids)
    out = []
    for i, ids in enumerate(completions):
        record = records[i // num_generations]
        ids = list(ids[:-1]) if ids and ids[-1] in stops else list(ids)
        text = completion_text(tokenizer, record.ids, ids)
        out.append([{"role": "assistant", "content": text}] if record.chat else text)
    return out
