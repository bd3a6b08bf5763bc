"""The Task protocol, and what the tasks share: the epoch sampler, the LM and classification losses.

Each loss returns (sum over counted items, number counted) so the trainer can normalise by the
global count of a step: accumulation and data parallelism then give one big batch's gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lmforge.errors import UserError
from lmforge.models.decoder import Decoder
from lmforge.models.layers import VocabProjection
from lmforge.parallel.data_parallel import unwrap
from lmforge.train.config import RunConfig
from lmforge.train.loss import IGNORE_INDEX, SCORED_ROWS, linear_cross_entropy

Batch = dict[str, torch.Tensor]
# a count or statistic of a micro-batch: a number, or a scalar left on the device
Count = torch.Tensor | int

log = logging.getLogger(__name__)


@dataclass
class TaskData:
    train: Dataset
    valid: Dataset | None
    collate: Callable | None = None
    num_labels: int = 0
    label_names: list[str] | None = None
    # the Jinja chat template the examples were rendered with: the export carries it
    chat_template: str | None = None


class Task:
    """One kind of run. The defaults are a language-model task (pretrain, sft, mlm): summed token
    cross-entropy over labels != -100, validation loss and perplexity.

    A run gets its own instance (get_task), so a task may keep what build_data and prepare learn
    about the run."""

    name: ClassVar[str]
    # Fixed-length Megatron samples: no tokenizer needed, validation on a fixed number of samples
    # (the same ones every time), `lmforge pretrain` rather than `lmforge finetune`.
    pretraining: ClassVar[bool] = False
    # How many statistics `loss` returns after the loss and the count (a tuple when > 1), summed
    # over micro-batches and ranks, then handed to `metrics` (validation) and `train_metrics`.
    num_stats: ClassVar[int] = 1

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        raise NotImplementedError

    # Another model the task holds beside the run's, laid out like it (DPO's frozen reference): a
    # ParallelModel.
    reference = None

    def prepare(self, model: torch.nn.Module, cfg: RunConfig, layout, device: torch.device) -> None:
        """Called with the run's built model (adapters applied) before it is laid out over
        `layout`; another model of the run is built with lmforge.train.setup.init_model."""

    def lay_out(self, lay_out: Callable) -> None:
        """Called once the run's model is laid out, with `lay_out(model, fill)` -> ParallelModel,
        which lays out another model of the task (DPO's frozen reference) as the run's: the same
        shards, no gradients, no optimizer. `fill`: what init_model returned with a meta-device
        model, else None."""

    def before_step(self, micro: list, training, step: int) -> list:
        """A step's micro-batches as its forward takes them, given the laid-out model (a
        ParallelTraining) at step `step`: GRPO samples its rollouts here, on the training
        weights. The others hand them on as they are."""
        return micro

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(input_ids, labels, keyword inputs) of a collated micro-batch: what the model is
        called with and what its output is scored against (logits_loss)."""
        return batch["input_ids"], batch["labels"], {"attention_mask": batch["attention_mask"]}

    def count(self, batch: Batch) -> int:
        """What a step's loss is normalised by: the labelled tokens."""
        return int((self.inputs(batch)[1] != IGNORE_INDEX).sum())

    def loss(
        self, model: torch.nn.Module, batch: Batch, fused: bool = True
    ) -> tuple[torch.Tensor, Count, Count]:
        """(summed loss, items counted, correct predictions) for one micro-batch on the model's
        device; the counts are numbers or scalars on the device (the trainer reads them once per
        step: never read them here).

        fused: a decoder's LM loss goes through lmforge.train.loss (no full logits tensor); False
        computes the logits and F.cross_entropy, the reference it is tested against.
        """
        input_ids, labels, inputs = self.inputs(batch)
        loss = lm_loss(
            model, {"input_ids": input_ids, **inputs}, labels, fused, batch.get(SCORED_ROWS)
        )
        return loss, (labels != IGNORE_INDEX).sum(), 0

    def pipeline_target(self, pm, batch: Batch) -> torch.Tensor:
        """Under pipeline parallelism: what the last stage scores each microbatch's logits
        against (the schedule splits it by rows with the batch), computed before the step from
        the local batch: the labels."""
        return self.inputs(batch)[1]

    def pipeline_loss(
        self, logits: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, Count, Count]:
        """`loss` from the last pipeline stage's logits of one microbatch and its rows of
        pipeline_target."""
        return (
            logits_loss(logits, target),
            (target != IGNORE_INDEX).sum(),
            self.correct(logits, target),
        )

    def correct(self, logits: torch.Tensor, labels: torch.Tensor) -> Count:
        """Correct predictions among `logits` (pipeline validation scores the last stage's
        logits)."""
        return 0

    def metrics(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        """Validation metrics from the summed loss, items scored and correct predictions."""
        val_loss = loss_sum / count
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def train_metrics(self, count: float, *stats: float) -> dict[str, float]:
        """Metrics of a training step beyond its loss, from its global count and summed
        statistics."""
        return {}

    def validation_samples(self, cfg: RunConfig, valid: Dataset, unit: int) -> int:
        """How many validation rows one validation reads, in whole steps of `unit` rows
        (micro-batch x data-parallel ranks, x microbatches under a pipeline): the whole
        validation file, the last step filled up with blanks (see `blank`) so that every rank
        runs the same batches (FSDP, tensor and pipeline parallelism exchange tensors in each)
        and every example is scored exactly once."""
        if len(valid) == 0:
            raise UserError(
                "the validation file has no examples: give one with examples or unset data.valid_file"
            )
        return -(-len(valid) // unit) * unit

    def blank(self, example: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`example` with nothing to score: a row that fills up the last validation step, run
        through the model like the others (same shapes) and counted nowhere: its labels are all
        IGNORE_INDEX."""
        return {**example, "labels": torch.full_like(example["labels"], IGNORE_INDEX)}


class Blanks(Dataset):
    """`dataset` and then blanks up to `total` rows: row i >= len(dataset) is `blank(dataset[i %
    len])`."""

    def __init__(self, dataset: Dataset, total: int, blank: Callable[[dict], dict]):
        self.dataset, self.total, self.blank = dataset, total, blank

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int):
        n = len(self.dataset)
        return self.dataset[i] if i < n else self.blank(self.dataset[i % n])


class Epochs(Dataset):
    """`total` samples drawn epoch after epoch from a finite dataset, each epoch reshuffled with
    (seed, epoch): sample g is always the same example, so a run resumes at consumed_samples."""

    def __init__(self, dataset: Dataset, total: int, seed: int):
        self.dataset, self.total, self.seed = dataset, total, seed
        self._epoch, self._perm = -1, None
        if len(dataset):  # what TRL's num_train_epochs says, in a run that counts steps
            log.info(
                "trainer.max_steps x global_batch_size = %d samples: %.2f epochs of the %d %s",
                total,
                total / len(dataset),
                len(dataset),
                "sequences"
                if getattr(dataset, "packing", False)
                else "pairs"
                if hasattr(dataset, "pairs")
                else "examples",
            )

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, g: int):
        epoch, i = divmod(int(g), len(self.dataset))
        if epoch != self._epoch:
            self._epoch, self._perm = (
                epoch,
                np.random.RandomState((self.seed, epoch)).permutation(len(self.dataset)),
            )
        return self.dataset[int(self._perm[i])]


def data_files(cfg: RunConfig) -> tuple[str, str | None]:
    """(data.train_file, data.valid_file), both checked before either is read: a wrong validation
    path stops the run before the training file is tokenized, not after."""
    d = cfg.data
    if not d.train_file:
        raise UserError("data.train_file is not set: give the file to fine-tune on")
    for key, path in (("data.train_file", d.train_file), ("data.valid_file", d.valid_file)):
        if path and not Path(path).is_file():
            raise UserError(f"{key}: data file {path} not found: check the path")
    return d.train_file, d.valid_file


def total_samples(cfg: RunConfig) -> int:
    return cfg.trainer.max_steps * cfg.trainer.global_batch_size


def pad_multiple(cfg: RunConfig) -> int:
    """data.pad_to_multiple_of, or its default: 64 under trainer.compile, 8 otherwise. The
    default is logged: an eager and a compiled run of one config pad their batches differently
    (other shapes, other padding to compute)."""
    multiple = cfg.data.pad_to_multiple_of
    if multiple is None:
        multiple, why = (
            (64, "trainer.compile=true: few lengths, few graphs to compile; eager runs pad to 8")
            if (cfg.trainer.compile)
            else (8, "trainer.compile=false; compiled runs pad to 64, fewer lengths to compile")
        )
        log.info(
            "data.pad_to_multiple_of unset: batches padded to a multiple of %d tokens (%s); set it to choose, "
            "the same in runs to compare (data.pad_to_multiple_of=%d = data.seq_length: every batch at full "
            "length, one shape)",
            multiple,
            why,
            cfg.data.seq_length,
        )
        return multiple
    if multiple < 1:
        raise UserError(f"data.pad_to_multiple_of must be >= 1, got {multiple}")
    return multiple


def with_padding(data: TaskData, cfg: RunConfig) -> TaskData:
    """Variable-length tasks: batches padded to a few distinct lengths (data.pad_to_multiple_of)."""
    data.collate = dataclasses.replace(
        data.collate, pad_to_multiple_of=pad_multiple(cfg), max_length=cfg.data.seq_length
    )
    return data


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy in fp32: (batch, classes) logits for classification, (batch, seq,
    vocab) for the LM/MLM tasks (-100: not scored). Vocabulary-sharded DTensor logits work inside
    loss_parallel()."""
    if logits.dim() == 2:  # a blank validation row's label is IGNORE_INDEX
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def lm_loss(
    model: torch.nn.Module,
    inputs: Batch,
    labels: torch.Tensor,
    fused: bool = True,
    scored_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of the model's logits for `inputs` against `labels` (-100: not
    scored; `scored_rows`: the flat indices of the others, where known)."""
    nll = fused_head_loss(model) if fused else None
    if nll is not None:
        return model(**inputs, head_fn=partial(nll, labels=labels, scored_rows=scored_rows))
    return logits_loss(model(**inputs), labels)


def fused_head_loss(model: torch.nn.Module):
    """linear_cross_entropy bound to the model's vocabulary and logit cap, for a decoder's
    head_fn; None where the logits must be formed: under tensor parallelism the projection is
    vocabulary-sharded (lmforge.parallel)."""
    inner = unwrap(model)
    if not isinstance(inner, Decoder) or not isinstance(inner.vocab_projection, VocabProjection):
        return None
    return partial(
        linear_cross_entropy,
        vocab_size=inner.config.vocab_size,
        softcap=inner.vocab_projection.softcap,
    )


def count_tokens(batch: Batch) -> int:
    """Real (non-padding) input tokens, for throughput."""
    if "tokens" in batch:
        return batch["tokens"].numel()
    return int(batch["attention_mask"].sum())


def reference_forward(
    reference, model: torch.nn.Module, forward: Callable[[torch.nn.Module], torch.Tensor]
):
    """`forward(module)` on a task's frozen reference: its own laid-out model where it holds one
    (DPO, GRPO with beta > 0; FSDP2's root unit is resharded after, as it stays gathered after a
    forward), else the policy itself with its LoRA adapters off, in eval mode and not through DDP
    (a forward without a backward)."""
    if reference is not None:
        out = forward(reference.parts[0])
        reference.reshard()
        return out
    from lmforge.models.lora import adapters_disabled

    inner = unwrap(model)
    training = inner.training
    inner.eval()
    try:
        with adapters_disabled(inner):
            return forward(inner)
    finally:
        inner.train(training)


def pipeline_reference(reference, pm, ids: torch.Tensor, labels: torch.Tensor, collect, **inputs):
    """A forward-only pass of a task's frozen reference through the pipeline (pipeline_eval's
    `collect(logits, labels)` on the last stage): its own laid-out stages where it holds them,
    else the policy's stages with their LoRA adapters off, in eval mode."""
    from lmforge.models.lora import adapters_disabled
    from lmforge.parallel.pipeline import pipeline_eval

    with contextlib.ExitStack() as stack:
        if reference is None:
            for part in pm.parts:
                stack.enter_context(adapters_disabled(part))
            stack.callback(pm.train, pm.parts[0].training)
            pm.eval()
        pipeline_eval(reference if reference is not None else pm, ids, labels, collect, **inputs)
