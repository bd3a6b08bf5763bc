"""What differs between pretraining and fine-tuning: the data and the loss.

    pretrain        Megatron GPT samples (tokens, labels already shifted)
    sft             instruction/chat examples (labels -100 on prompts), optionally packed
    classification  text + label rows, a score/classifier head on the model
    mlm             BERT masked-LM samples from a .bin/.idx prefix

Each loss returns (sum over counted items, number counted) so the trainer can normalise by the
global count of a step: accumulation and data parallelism then give one big batch's gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lmforge.errors import UserError
from lmforge.models.decoder import Decoder
from lmforge.models.layers import VocabProjection
from lmforge.parallel.data_parallel import unwrap
from lmforge.train.config import RunConfig
from lmforge.train.loss import IGNORE_INDEX, linear_cross_entropy


@dataclass
class TaskData:
    train: Dataset
    valid: Dataset | None
    collate: Callable | None = None
    num_labels: int = 0
    label_names: list[str] | None = None


class Epochs(Dataset):
    """`total` samples drawn epoch after epoch from a finite dataset, each epoch reshuffled with
    (seed, epoch): sample g is always the same example, so a run resumes at consumed_samples."""

    def __init__(self, dataset: Dataset, total: int, seed: int):
        self.dataset, self.total, self.seed = dataset, total, seed
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, g: int):
        epoch, i = divmod(int(g), len(self.dataset))
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.RandomState((self.seed, epoch)).permutation(len(self.dataset))
        return self.dataset[int(self._perm[i])]


def _require(path: str | None, key: str) -> str:
    if not path:
        raise UserError(f"{key} is not set: give the file to fine-tune on")
    return path


def pad_multiple(cfg: RunConfig) -> int:
    """data.pad_to_multiple_of, or its default: 64 under trainer.compile, 8 otherwise."""
    multiple = cfg.data.pad_to_multiple_of
    if multiple is None:
        return 64 if cfg.trainer.compile else 8
    if multiple < 1:
        raise UserError(f"data.pad_to_multiple_of must be >= 1, got {multiple}")
    return multiple


def build_task_data(cfg: RunConfig, tokenizer) -> TaskData:
    data = _build_task_data(cfg, tokenizer)
    if data.collate is not None:  # variable-length tasks: few distinct batch shapes
        data.collate = dataclasses.replace(data.collate, pad_to_multiple_of=pad_multiple(cfg),
                                           max_length=cfg.data.seq_length)
    return data


def _build_task_data(cfg: RunConfig, tokenizer) -> TaskData:
    d = cfg.data
    total = cfg.trainer.max_steps * cfg.trainer.global_batch_size
    if d.task == "sft":
        from lmforge.data.sft import SFTDataset

        def make(path):
            return SFTDataset(path, tokenizer, d.seq_length, packing=d.packing, truncate="cut",
                              prompt_template=d.prompt_template)

        train = make(_require(d.train_file, "data.train_file"))
        valid = make(d.valid_file) if d.valid_file else None
        return TaskData(Epochs(train, total, cfg.trainer.seed), valid, train.collate)
    if d.task == "classification":
        from lmforge.data.classification import ClassificationDataset

        special = [tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]")]
        prefix, suffix = ([special[0]], [special[1]]) if None not in special else ([], [])
        train = ClassificationDataset(_require(d.train_file, "data.train_file"), tokenizer, d.seq_length,
                                      prefix_ids=prefix, suffix_ids=suffix)
        valid = ClassificationDataset(d.valid_file, tokenizer, d.seq_length, label_names=train.label_names,
                                      prefix_ids=prefix, suffix_ids=suffix) if d.valid_file else None
        return TaskData(Epochs(train, total, cfg.trainer.seed), valid, train.collate, train.num_labels,
                        train.label_names)
    if d.task == "mlm":
        from lmforge.data.mlm import MLMDataset
        from lmforge.train.data import open_prefixes

        ids = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")}
        if None in ids.values():
            raise UserError("MLM needs a BERT-style tokenizer with [CLS], [SEP], [MASK] and [PAD] tokens")
        indexed, _ = open_prefixes(d.paths[:1])

        def make(data, seed, epochs=1):
            return MLMDataset(data, d.seq_length, tokenizer.vocab_size, ids["[CLS]"], ids["[SEP]"], ids["[MASK]"],
                              ids["[PAD]"], seed=seed, num_epochs=epochs)

        train = make(indexed[0], cfg.trainer.seed)
        if len(train) < total:  # each further epoch masks the same text differently
            train = make(indexed[0], cfg.trainer.seed, -(-total // len(train)))
        valid = make(open_prefixes([d.valid_file])[0][0], cfg.trainer.seed + 1) if d.valid_file else None
        return TaskData(Epochs(train, total, cfg.trainer.seed), valid, train.collate)
    from lmforge.train.data import pretrain_datasets

    train, valid = pretrain_datasets(cfg)
    return TaskData(train, valid)


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention kept inside each packed example: (batch, 1, seq, seq) bool."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    eye = torch.eye(s, dtype=torch.bool, device=segment_ids.device)  # padding rows see themselves
    return ((same & causal & (segment_ids[:, None, :] != 0)) | eye)[:, None]


def task_batch(task: str, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input_ids, labels, keyword inputs) of a collated micro-batch: what the model is called with and
    what its output is scored against (logits_loss)."""
    if task == "classification":
        return batch["input_ids"], batch["label"], {"attention_mask": batch["attention_mask"]}
    if task == "pretrain":
        return batch["tokens"], batch["labels"], {}
    if task == "sft":
        if "segment_ids" in batch:
            inputs = {"attention_mask": segment_mask(batch["segment_ids"]), "position_ids": batch["position_ids"]}
        else:
            inputs = {"attention_mask": batch["attention_mask"]}
        labels = batch["labels"]  # aligned with the inputs (HF): position t is scored on label t + 1
        labels = torch.cat([labels[:, 1:], labels.new_full((len(labels), 1), IGNORE_INDEX)], 1)
        return batch["input_ids"], labels, inputs
    return batch["input_ids"], batch["labels"], {"attention_mask": batch["attention_mask"]}  # mlm


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy in fp32: (batch, classes) logits for classification, (batch, seq, vocab) for the
    LM/MLM tasks (-100: not scored). Vocabulary-sharded DTensor logits work inside loss_parallel()."""
    if logits.dim() == 2:
        return F.cross_entropy(logits.float(), labels, reduction="sum")
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def task_loss(task: str, model: torch.nn.Module, batch: dict[str, torch.Tensor],
              fused_loss: bool = True) -> tuple[torch.Tensor, int, int]:
    """(summed loss, items counted, correct predictions) for one micro-batch on the model's device.

    fused_loss: a decoder's LM loss goes through lmforge.train.loss (no full logits tensor);
    False computes the logits and F.cross_entropy, the reference it is tested against.
    """
    input_ids, labels, inputs = task_batch(task, batch)
    if task == "classification":
        logits = model(input_ids, **inputs).float()
        return logits_loss(logits, labels), len(labels), int((logits.argmax(-1) == labels).sum())
    loss = lm_loss(model, {"input_ids": input_ids, **inputs}, labels, fused_loss)
    return loss, int((labels != IGNORE_INDEX).sum()), 0


def lm_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
            fused: bool = True) -> torch.Tensor:
    """Summed cross-entropy of the model's logits for `inputs` against `labels` (-100: not scored)."""
    inner = unwrap(model)
    # Under tensor parallelism the projection is vocabulary-sharded (lmforge.parallel): plain path.
    if fused and isinstance(inner, Decoder) and type(inner.vocab_projection) is VocabProjection:
        head_fn = partial(linear_cross_entropy, labels=labels, vocab_size=inner.config.vocab_size)
        return model(**inputs, head_fn=head_fn)
    return logits_loss(model(**inputs), labels)


def count_items(task: str, batch: dict[str, torch.Tensor]) -> int:
    """What a step's loss is normalised by: label tokens, or examples for classification."""
    if task == "classification":
        return len(batch["label"])
    labels = batch["labels"][:, 1:] if task == "sft" else batch["labels"]
    return int((labels != -100).sum())


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) input tokens, for throughput."""
    if "tokens" in batch:
        return batch["tokens"].numel()
    return int(batch["attention_mask"].sum())
