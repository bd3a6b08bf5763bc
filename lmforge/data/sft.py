"""Supervised fine-tuning data: instruction and chat records -> token ids with the loss on responses only.

Record kinds, told apart per record (a JSON list file or JSON lines, see `read_json_records`):

* Alpaca: `{"instruction", "input" (optional, may be ""), "output"}`. The prompt is the instruction (and the
  input) put into a template; the response is `output`.
* Self-Instruct seed tasks (Alpaca's `seed_tasks.jsonl`): `{"instruction", "instances": [{"input", "output"}]}`;
  each instance is one Alpaca example.
* chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`. Every assistant turn
  is a response; system and user turns and the role tags are prompt. Turns after the last assistant turn
  teach nothing and are left out.

Templates. The default prompt template is Stanford Alpaca's (`PROMPT_DICT` in tatsu-lab/stanford_alpaca
`train.py`), a variant with and one without input, ending in "### Response:" with no newline, as there.
A user template is one string with `{instruction}` and optionally `{input}` (literal braces doubled). Chat
turns render through `DEFAULT_CHAT_TURN`, "<|{role}|>\\n{content}\\n": the text before `{content}` is the
turn's header, the text after it its footer. The tags are plain text (tokenizers here never parse
special-token strings), so any tokenizer can take them and no embedding rows are added.

Tokens of one example: [bos] prompt response eos (prompt response eos)... The prompt and the response are
tokenized separately and joined, so the boundary between loss and no loss is exact. (Alpaca tokenized
prompt+response as one string; the ids differ only where a response starts with characters that would
merge with the prompt's end, and for SentencePiece, which starts each piece with a word boundary.)
`labels` equal `input_ids` on response tokens and their eos, IGNORE_INDEX (-100) elsewhere: aligned with
`input_ids`, the Hugging Face convention, where the loss shifts them by one. The first token of an example
never has a label, so in a packed sequence no token is trained to predict the next example.

bos: by default the tokenizer's rule, `Tokenizer.add_bos_token` (Llama's <s> yes; GPT-2 and NeoX, whose only
control token is <|endoftext|>, no), the same rule prompts follow at generation. eos: the tokenizer's eos
(else its eod).

Serving a fine-tuned model: `encode_prompt` / `encode_chat_prompt` give the ids of a prompt laid out
exactly as in training (eos after earlier answers included), ending where the model must answer.

Length, `seq_length`: an example longer than it is dropped (`truncate="drop"`, the default, counted in
`num_dropped`), or cut to its first `seq_length` tokens (`truncate="cut"`, counted in `num_cut`; an
example left without a label is then dropped). Without packing, an item is one example and the collator
right-pads a batch to its longest (`pad_id`: the tokenizer's pad, else its eos). With packing, examples
are placed first-fit in order into sequences of exactly `seq_length` tokens; an item then adds
`position_ids` restarting at 0 for each example and `segment_ids` (1, 2, ... per example, 0 on padding),
so attention can be kept within an example.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lmforge.data.collate import IGNORE_INDEX, PadCollator, read_json_records
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

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
DEFAULT_CHAT_TURN = "<|{role}|>\n{content}\n"
CHAT_ROLES = ("system", "user", "assistant")
TRUNCATE = ("drop", "cut")

# One example as (prompt text, response text) turns; eos follows every response.
Turns = list[tuple[str, str]]


def _fields(template: str, what: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise UserError(f"{what} {template!r} is not a valid template ({e}): double literal braces") from None


class PromptTemplate:
    """Alpaca's two templates by default, or one user template with `{instruction}` and `{input}`."""

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


def split_chat_template(turn_template: str) -> tuple[str, str]:
    """A turn template's header and footer: the text before and after `{content}`."""
    names = _fields(turn_template, "chat template")
    if names != {"role", "content"} or turn_template.count("{content}") != 1:
        raise UserError(f"chat template {turn_template!r} needs one {{role}} and one {{content}} placeholder")
    header, footer = turn_template.split("{content}")
    return header, footer


def chat_turns(messages: list, turn_template: str = DEFAULT_CHAT_TURN, where: str = "messages") -> Turns:
    """Split a chat into (prompt, response) turns: each assistant content is a response, the rest prompt."""
    header, footer = split_chat_template(turn_template)
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    turns: Turns = []
    prompt = ""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in CHAT_ROLES:
            raise UserError(
                f"{where}: message {i} must be {{\"role\": one of {', '.join(CHAT_ROLES)}, \"content\": a string}}, "
                f"got {str(m)[:80]}"
            )
        prompt += header.format(role=m["role"])
        if m["role"] == "assistant":
            turns.append((prompt, m["content"]))
            prompt = ""
        else:
            prompt += m["content"]
        prompt += footer.format(role=m["role"])
    if not turns:
        raise UserError(f"{where}: the chat has no assistant message, so nothing to learn: add one or drop it")
    return turns


def record_turns(rec: dict, where: str, prompt: PromptTemplate, turn_template: str = DEFAULT_CHAT_TURN) -> list[Turns]:
    """The examples in one record (a seed task holds several), each as its turns."""
    if "messages" in rec:
        return [chat_turns(rec["messages"], turn_template, where)]
    if "instruction" in rec and ("output" in rec or "instances" in rec):
        instances = rec["instances"] if "output" not in rec else [rec]
        if not isinstance(instances, list):
            raise UserError(f"{where}: 'instances' must be a list of {{input, output}} objects")
        out = []
        for inst in instances:
            values = [rec["instruction"], inst.get("input", "") if isinstance(inst, dict) else None,
                      inst.get("output") if isinstance(inst, dict) else None]
            if not all(isinstance(v, str) for v in values):
                raise UserError(f"{where}: 'instruction', 'input' and 'output' must be strings")
            out.append([(prompt.format(values[0], values[1]), values[2])])
        return out
    raise UserError(
        f"{where}: unknown record kind with keys {sorted(rec)}: give instruction/input/output (Alpaca), "
        "instruction/instances (seed tasks) or messages (chat)"
    )


def tokenize_turns(
    examples: Sequence[Turns], tokenizer: Tokenizer, add_bos: bool
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) per example; every text goes through one `encode_batch`, the tokenizer's fast path."""
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.eod_id
    if eos is None:
        raise UserError(f"tokenizer {tokenizer.files[0]} has no eos or end-of-document token to end responses")
    texts = [text for turns in examples for turn in turns for text in turn]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    out = []
    for turns in examples:
        ids = [tokenizer.bos_id] if add_bos else []
        labels = [IGNORE_INDEX] * len(ids)
        for _ in turns:
            prompt, response = next(encoded), [*next(encoded), eos]
            ids += prompt + response
            labels += [IGNORE_INDEX] * len(prompt) + response
        if labels:
            labels[0] = IGNORE_INDEX  # see the module docstring: never learn across a packing boundary
        out.append((np.array(ids, np.int64), np.array(labels, np.int64)))
    return out


def encode_prompt(turns: Turns, tokenizer: Tokenizer, add_bos: bool | None = None) -> list[int]:
    """Generation-time ids: `turns` as in training, up to where the model must write the last response.

    The last turn's response is ignored (give ""); a served model thus sees exactly the token layout it was
    fine-tuned on, eos after earlier answers included.
    """
    add_bos = tokenizer.add_bos_token if add_bos is None else add_bos
    *history, (last_prompt, _) = turns
    ids, _ = tokenize_turns([[*history, (last_prompt, "")]], tokenizer, add_bos)[0]
    return ids[:-1].tolist()  # the eos that ended the empty response


def encode_chat_prompt(
    messages: list, tokenizer: Tokenizer, turn_template: str = DEFAULT_CHAT_TURN, add_bos: bool | None = None
) -> list[int]:
    """Ids of a chat so far plus the assistant header: what a model fine-tuned on `turn_template` continues."""
    return encode_prompt(chat_turns([*messages, {"role": "assistant", "content": ""}], turn_template),
                         tokenizer, add_bos)


def pack_first_fit(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Example indices per sequence: each example, in order, goes into the first sequence with room for it."""
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
    """Instruction / chat examples, tokenized at construction; see the module docstring for the rules."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer | str | Path,
        seq_length: int,
        packing: bool = False,
        truncate: str = "drop",
        prompt_template: str | None = None,
        chat_template: str = DEFAULT_CHAT_TURN,
        add_bos: bool | None = None,
    ):
        if truncate not in TRUNCATE:
            raise UserError(f"truncate must be one of {', '.join(TRUNCATE)}, not {truncate!r}")
        if seq_length < 2:
            raise UserError(f"seq_length must be at least 2, not {seq_length}")
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        if add_bos is None:
            add_bos = tok.add_bos_token
        self.path, self.seq_length, self.packing = Path(path), seq_length, packing
        self.pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id if tok.eos_id is not None else tok.eod_id
        self.collate = PadCollator(self.pad_id)

        prompt = PromptTemplate(prompt_template)
        split_chat_template(chat_template)  # a bad template fails now, not at the first chat record
        records = read_json_records(path)
        examples = [turns for where, rec in records for turns in record_turns(rec, where, prompt, chat_template)]
        self.num_dropped = self.num_cut = 0
        self.examples: list[tuple[np.ndarray, np.ndarray]] = []
        for ids, labels in tokenize_turns(examples, tok, add_bos):
            if len(ids) > seq_length:
                if truncate == "drop" or (labels[:seq_length] == IGNORE_INDEX).all():
                    self.num_dropped += 1
                    continue
                ids, labels = ids[:seq_length], labels[:seq_length]
                self.num_cut += 1
            self.examples.append((ids, labels))
        if not self.examples:
            raise UserError(f"{path}: no example fits seq_length {seq_length}: raise it or pass truncate='cut'")
        self.num_tokens = sum(len(ids) for ids, _ in self.examples)
        self.packs = pack_first_fit([len(ids) for ids, _ in self.examples], seq_length) if packing else None
        logger.info(
            "%s: %d examples, %d tokens (%d dropped, %d cut at seq_length %d)%s", path, len(self.examples),
            self.num_tokens, self.num_dropped, self.num_cut, seq_length,
            f", packed into {len(self.packs)} sequences ({self.packing_efficiency:.1%} tokens, not padding)"
            if packing else "",
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
            return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                    "attention_mask": torch.ones(len(ids), dtype=torch.int64)}
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
