"""Direct preference optimisation (Rafailov et al. 2023) on preference pairs, against a frozen
reference.

Per pair, with the summed log-probabilities of the chosen and rejected answers under the policy (pc,
pr) and the reference (rc, rr), as TRL's DPOTrainer computes them (its default "sigmoid" loss):

    loss = -log sigmoid(beta * ((pc - pr) - (rc - rr)))
    reward_chosen = beta * (pc - rc),  reward_rejected = beta * (pr - rr)

reported as reward_accuracy (the share of pairs where the chosen reward is the larger),
reward_margin (chosen minus rejected) and the mean rewards, every step and at validation (val_*).
The reference is, in this order: the log-probabilities in the data file (ref_chosen_logps /
ref_rejected_logps), the base model without its adapters under LoRA (no second model), or a frozen
copy of the run's initial model (model.init_from), laid out like the policy (FSDP2 and
tensor-parallel shards, pipeline stages: each rank holds its own, without gradients or optimizer
state). It runs in eval mode: no dropout.

Under a pipeline (`DPO.pipeline_target`) the last stage scores each microbatch's logits against its
rows of pipeline_target: the labels with each row's reference log-probability as one more column
(the schedule splits one tensor by rows; a float64 column holds the labels exactly). The reference's
log-probabilities come first, from a forward-only pass of the pipelined reference (or of the policy
with its adapters off) over the whole local batch.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from lmforge.errors import UserError
from lmforge.train.config import RunConfig
from lmforge.train.loss import IGNORE_INDEX, SCORED_PER_ROW, SCORED_ROWS
from lmforge.train.tasks.base import (
    Batch,
    Epochs,
    Task,
    TaskData,
    data_files,
    fused_head_loss,
    pipeline_reference,
    reference_forward,
    total_samples,
    with_padding,
)
from lmforge.train.tasks.sft import SFT, run_chat_template, say_chat_template

log = logging.getLogger(__name__)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair from the four summed log-probabilities
    (TRL's sigmoid)."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * logits)
    return (
        losses,
        (beta * (policy_chosen - ref_chosen)).detach(),
        (beta * (policy_rejected - ref_rejected)).detach(),
    )


def sequence_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    inputs: dict,
    fused: bool = True,
    scored: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Summed log-probability of each row's labels (-100: not scored), (rows,) in fp32. `scored`:
    each row's scored positions where known (row_positions), so the fused loss need not find them
    on the device."""
    nll = fused_head_loss(model) if fused else None
    if nll is not None:

        def head_fn(h, weight, bias):  # the fused loss per row: no (rows, seq, vocab) logits
            return -torch.stack(
                [
                    nll(h[i], weight, bias, labels[i], scored_rows=scored[i] if scored else None)
                    for i in range(len(labels))
                ]
            )

        return model(input_ids, **inputs, head_fn=head_fn)
    return row_logps(model(input_ids, **inputs), labels)


def row_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's labels from (rows, seq, vocab) logits, (rows,) in
    fp32.

    A per-token cross-entropy, which loss_parallel computes on vocabulary-sharded logits (tensor
    parallelism): a replicated DTensor then, every rank's the same, whose local copy the rest of
    the loss takes."""
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    logps = -nll.view(labels.shape).sum(-1)
    return logps.to_local() if hasattr(logps, "to_local") else logps


def row_positions(batch: Batch) -> list[torch.Tensor] | None:
    """Each row's scored positions, cut from the batch's flat SCORED_ROWS by the per-row counts
    the host found with them (lmforge.train.step): no device read. None where the batch came
    without them."""
    flat, counts = batch.get(SCORED_ROWS), batch.get(SCORED_PER_ROW)
    if flat is None or counts is None:
        return None
    length = batch["input_ids"].shape[1]
    return [part - i * length for i, part in enumerate(flat.split(counts.tolist()))]


def scored_pairs(labels: torch.Tensor) -> torch.Tensor:
    """(pairs,) bool: the pairs of a batch with labels to score. Every pair of the data has some
    (one with none is dropped when read); a validation blank has none."""
    return (labels[0::2] != IGNORE_INDEX).any(-1)


class DPO(Task):
    name = "dpo"
    # chosen reward > rejected, and the sums of the margin, the chosen and the rejected
    # rewards
    num_stats = 4

    beta = 0.1
    reference = None  # a frozen model laid out like the policy (lmforge.parallel.ParallelModel)
    lora_reference = False
    # Whether the data files carry the reference's log-probabilities (build_data reads them);
    # lmforge plan, which reads no data, sizes the reference model.
    precomputed = False

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        from lmforge.data.dpo import PreferenceDataset

        d = cfg.data
        train_file, valid_file = data_files(cfg)
        if cfg.dpo.beta <= 0:
            raise UserError(f"dpo.beta must be > 0, got {cfg.dpo.beta}")
        self.beta = cfg.dpo.beta
        template = run_chat_template(cfg, tokenizer, log)

        def make(path, max_records=None):
            return PreferenceDataset(
                path, tokenizer, d.seq_length, d.truncate, template, max_records
            )

        train = make(train_file, d.max_train_examples)
        say_chat_template(template, train.kinds, cfg, tokenizer)
        valid = make(valid_file) if valid_file else None
        self.precomputed = train.has_reference and (valid is None or valid.has_reference)
        data = TaskData(
            Epochs(train, total_samples(cfg), cfg.trainer.seed),
            valid,
            train.collate,
            chat_template=train.export_template,
        )
        return with_padding(data, cfg)

    def prepare(self, model: torch.nn.Module, cfg: RunConfig, layout, device: torch.device) -> None:
        if self.precomputed:
            log.info("DPO reference: the log-probabilities in the data files")
        elif cfg.lora is not None:
            self.lora_reference = True
            log.info("DPO reference: the base model without its adapters")
        else:
            from lmforge.train.setup import init_model

            # Laid out like the policy in lay_out (sharded: built on meta, each rank fills its own).
            # Said first: reading it again repeats the policy's "weights from model.init_from" line.
            log.info(
                "DPO reference: a frozen copy of %s, read again and laid out like the policy",
                cfg.model.init_from or "the initial model",
            )
            dtype = cfg.precision_for(device).param_dtype
            reference, fill = init_model(cfg, meta=layout.shards_model, device=device, dtype=dtype)
            if fill is None:
                reference.to(device, dtype)
            self._unlaid = (reference.eval().requires_grad_(False), fill)

    def lay_out(self, lay_out) -> None:
        if getattr(self, "_unlaid", None) is not None:
            self.reference, self._unlaid = lay_out(*self._unlaid), None

    inputs = SFT.inputs

    def count(self, batch: Batch) -> int:
        return int(scored_pairs(self.inputs(batch)[1]).sum())  # pairs (blanks not counted)

    def blank(self, example: Batch) -> Batch:
        return {
            **example,
            "chosen_labels": torch.full_like(example["chosen_labels"], IGNORE_INDEX),
            "rejected_labels": torch.full_like(example["rejected_labels"], IGNORE_INDEX),
        }

    def reference_logps(
        self,
        model: torch.nn.Module,
        batch: Batch,
        fused: bool,
        scored: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        ids, labels, inputs = self.inputs(batch)
        return reference_forward(
            self.reference, model, lambda m: sequence_logps(m, ids, labels, inputs, fused, scored)
        )

    def loss(self, model: torch.nn.Module, batch: Batch, fused: bool = True):
        ids, labels, inputs = self.inputs(batch)
        scored = row_positions(batch)
        with torch.no_grad():
            ref = self.reference_logps(model, batch, fused, scored)
        policy = sequence_logps(model, ids, labels, inputs, fused, scored)
        return self.pair_loss(policy, ref, labels, batch.get(SCORED_PER_ROW))

    # Under a pipeline the labels carry each row's reference log-probability as one more float64
    # column, split by rows with the batch (see the module docstring).

    def pipeline_target(self, pm, batch: Batch) -> torch.Tensor:
        labels = self.inputs(batch)[1]
        ref = (
            batch["ref_logps"]
            if "ref_logps" in batch
            else self._pipelined_reference_logps(pm, batch)
        )
        return torch.cat([labels.double(), ref.double()[:, None]], 1)

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor):
        labels = target[:, :-1].long()
        return self.pair_loss(row_logps(logits, labels), target[:, -1].float(), labels)

    def _pipelined_reference_logps(self, pm, batch: Batch) -> torch.Tensor:
        """Each row's reference log-probability on the pipeline's last stage (zeros on the other
        stages)."""
        ids, labels, inputs = self.inputs(batch)
        rows: list[torch.Tensor] = []

        def collect(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            rows.append(row_logps(logits, y))
            return torch.zeros((), device=y.device)

        pipeline_reference(self.reference, pm, ids, labels, collect, **inputs)
        return rows[-1] if rows else torch.zeros(len(ids), device=ids.device)

    def pair_loss(
        self,
        policy: torch.Tensor,
        ref: torch.Tensor,
        labels: torch.Tensor,
        per_row: torch.Tensor | None = None,
    ):
        """(summed loss, pairs, reward statistics) from each row's policy and reference
        log-probabilities; `per_row`: each row's count of scored labels, where the host knows it."""
        losses, chosen, rejected = dpo_loss(
            policy[0::2], policy[1::2], ref[0::2], ref[1::2], self.beta
        )
        # Blank pairs filling up the last validation step are not counted: known on the host where
        # the batch says how many labels each row scores, else read from the device.
        keep = per_row[0::2] > 0 if per_row is not None else scored_pairs(labels)
        if not bool(keep.all()):
            kept = keep.nonzero().squeeze(1).to(losses.device)
            losses, chosen, rejected = (t.index_select(0, kept) for t in (losses, chosen, rejected))
        stats = tuple(
            t.detach()
            for t in (
                (chosen > rejected).sum(),
                (chosen - rejected).sum(),
                chosen.sum(),
                rejected.sum(),
            )
        )
        return losses.sum(), len(losses), stats

    def metrics(
        self,
        loss_sum: float,
        count: float,
        correct: float,
        margin: float = 0.0,
        chosen: float = 0.0,
        rejected: float = 0.0,
    ) -> dict[str, float]:
        return {
            "val_" + k: v
            for k, v in self.train_metrics(count, correct, margin, chosen, rejected).items()
        } | {"val_loss": loss_sum / count}

    def train_metrics(self, count: float, *stats: float) -> dict[str, float]:
        if not count or len(stats) < 4:
            return {}
        correct, margin, chosen, rejected = stats
        return {
            "reward_accuracy": correct / count,
            "reward_margin": margin / count,
            "rewards_chosen": chosen / count,
            "rewards_rejected": rejected / count,
        }
