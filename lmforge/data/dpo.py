"""Preference pairs for DPO: `{"prompt", "chosen", "rejected"}` records -> a chosen and a rejected
sequence each.

`prompt` is a string or a list of chat messages (earlier turns included); `chosen` and `rejected`
are strings or lists of messages (TRL's conversational form: `[{"role": "assistant", "content":
...}]`). Each side is the prompt followed by its answer, rendered exactly as SFT renders a chat
(lmforge.data.sft: the model's chat template, a built-in, or, without one, the prompt text followed
by the answer and eos); its labels are the answer's tokens only (the assistant span of the answer,
not of earlier turns in the prompt).

Optional `ref_chosen_logps` and `ref_rejected_logps` (numbers, TRL's names) give the reference
model's summed log-probabilities of the two answers: when every record has them, no reference model
is run.

Length: a pair where either side is longer than `seq_length` has both sides cut to it
(`truncate="cut"`, the default, as `data.truncate`'s; a pair with a side left without an answer
token is then dropped) or is dropped (`truncate="drop"`); the log counts both.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lmforge.chat_template import ChatTemplate, builtin_template, check_messages
from lmforge.data.collate import IGNORE_INDEX, PadCollator, read_json_records
from lmforge.data.sft import KIND_EXPORT, TRUNCATE, tokenize_examples
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _messages(value, role: str, key: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return value
    raise UserError(
        f"{where}: '{key}' must be a string or a non-empty list of {{role, content}} messages"
    )


def pair_examples(rec: dict, where: str) -> tuple[list, list[int]]:
    """The chosen and rejected examples of one record (kind, messages, where) and their context
    answer counts."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
    if missing:
        sft = [k for k in ("messages", "instruction", "completion") if k in rec]
        raise UserError(
            f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; "
            f"{', '.join(repr(k) for k in missing)} {'is' if len(missing) == 1 else 'are'} missing"
            + (
                f" (its '{sft[0]}' is SFT data: set data.task=sft)"
                if sft and len(missing) > 1
                else ""
            )
        )
    prompt = _messages(rec["prompt"], "user", "prompt", where)
    plain = (
        isinstance(rec["prompt"], str)
        and isinstance(rec["chosen"], str)
        and isinstance(rec["rejected"], str)
    )
    context = sum(m.get("role") == "assistant" for m in prompt if isinstance(m, dict))
    examples = []
    for key in ("chosen", "rejected"):
        answer = _messages(rec[key], "assistant", key, where)
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in answer):
            raise UserError(f"{where}: '{key}' has no assistant message")
        examples.append(
            ("plain" if plain else "chat", check_messages(prompt + answer, where), where)
        )
    return examples, [context, context]


class PreferenceDataset(Dataset):
    """Preference pairs, tokenized at construction; an item is a pair (see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        seq_length: int,
        truncate: str = "cut",
        chat_template: ChatTemplate | None = None,
        max_records: int | None = None,
    ):
        if truncate not in TRUNCATE:
            raise UserError(f"truncate must be one of {', '.join(TRUNCATE)}, not {truncate!r}")
        self.path, self.seq_length = Path(path), seq_length
        pad = (
            tokenizer.pad_id
            if tokenizer.pad_id is not None
            else tokenizer.eos_id
            if tokenizer.eos_id is not None
            else tokenizer.eod_id
        )
        self.collate = PairCollator(pad)
        examples, context, refs = [], [], []
        for where, rec in itertools.islice(read_json_records(path), max_records):
            pair, counts = pair_examples(rec, where)
            examples += pair
            context += counts
            ref = [rec.get(k) for k in REF_KEYS]
            if any(
                r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)))
                for r in ref
            ):
                raise UserError(f"{where}: {' and '.join(REF_KEYS)} must be numbers")
            refs.append(ref)
        with_refs = sum(None not in r for r in refs)
        if 0 < with_refs < len(refs):
            raise UserError(
                f"{path}: {with_refs} of {len(refs)} records have {' and '.join(REF_KEYS)}: give them "
                "for every record or for none"
            )
        self.has_reference = with_refs == len(refs)
        sequences = tokenize_examples(examples, tokenizer, chat_template, context_answers=context)
        # what renders them, said by the run
        self.kinds = collections.Counter(k for k, _, _ in examples)
        kind = "chat" if self.kinds["chat"] else "plain"
        self.export_template = (
            chat_template.source
            if chat_template is not None
            else builtin_template(KIND_EXPORT[kind], tokenizer.add_bos_token)
        )
        self.pairs: list[tuple] = []
        self.num_dropped = self.num_cut = 0
        for i in range(len(refs)):
            sides = sequences[2 * i : 2 * i + 2]
            if any(len(ids) > seq_length for ids, _ in sides):
                cut = [(ids[:seq_length], labels[:seq_length]) for ids, labels in sides]
                # The file's reference log-probs are of the whole answers: a cut pair's would not
                # match its policy's.
                if (
                    truncate == "drop"
                    or self.has_reference
                    or any((labels == IGNORE_INDEX).all() for _, labels in cut)
                ):
                    self.num_dropped += 1
                    continue
                sides = cut
                self.num_cut += 1
            self.pairs.append((*sides, refs[i] if self.has_reference else None))
        if not self.pairs:
            raise UserError(
                f"{path}: no preference pair fits seq_length {seq_length}: raise it or set "
                "data.truncate=cut"
            )
        tokens = sum(len(ids) for pair in self.pairs for ids, _ in pair[:2])
        logger.info(
            "%s: %d of %d preference pairs kept, %d tokens; %d longer than seq_length %d (prompt and answer "
            "cut from the end, both sides alike): %d cut to it, %d dropped (truncate=%s%s)%s",
            path,
            len(self.pairs),
            len(refs),
            tokens,
            self.num_dropped + self.num_cut,
            seq_length,
            self.num_cut,
            self.num_dropped,
            truncate,
            ": a pair cut to no answer token is dropped" if truncate == "cut" else "",
            "; reference log-probs from the file (which cover whole answers: a pair that does not fit is "
            "dropped, never cut)"
            if self.has_reference
            else "",
        )

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        (chosen, chosen_labels), (rejected, rejected_labels), ref = self.pairs[i]
        item = {
            "chosen_ids": torch.from_numpy(chosen),
            "chosen_labels": torch.from_numpy(chosen_labels),
            "rejected_ids": torch.from_numpy(rejected),
            "rejected_labels": torch.from_numpy(rejected_labels),
        }
        if ref is not None:
            item["ref_logps"] = torch.tensor(ref, dtype=torch.float32)
        return item


@dataclasses.dataclass(frozen=True)
class PairCollator(PadCollator):
    """Pairs -> one batch of 2 x pairs rows, chosen and rejected interleaved (row 2i chosen, 2i +
    1 rejected, so batches concatenated row-wise keep their pairs), right-padded as PadCollator
    pads; `ref_logps` (2 x pairs,)."""

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        rows = []
        for item in items:
            for side in ("chosen", "rejected"):
                ids = item[f"{side}_ids"]
                rows.append(
                    {
                        "input_ids": ids,
                        "labels": item[f"{side}_labels"],
                        "attention_mask": torch.ones(len(ids), dtype=torch.int64),
                    }
                )
        batch = super().__call__(rows)
        if "ref_logps" in items[0]:
            batch["ref_logps"] = torch.stack([item["ref_logps"] for item in items]).reshape(-1)
        return batch
