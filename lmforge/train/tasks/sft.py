"""Supervised fine-tuning on instruction/chat examples: labels -100 on prompts, optionally
packed.

Packed examples attend within themselves (lmforge.models.documents), their positions restarting with
each (`SFT.inputs`). Unpacked, the collator pads on the right, where causal attention alone is exact
for every real token (SDPA's is_causal, no mask to build or apply); the padding's outputs are never
scored.
"""

from __future__ import annotations

import logging

import torch

from lmforge.errors import UserError
from lmforge.train.config import DPOConfig, RunConfig
from lmforge.train.loss import IGNORE_INDEX
from lmforge.train.tasks.base import (
    Batch,
    Epochs,
    Task,
    TaskData,
    data_files,
    total_samples,
    with_padding,
)

log = logging.getLogger(__name__)


def run_chat_template(cfg: RunConfig, tokenizer, logger: logging.Logger = log):
    """data.chat_template resolved against the run's tokenizer folder
    (lmforge.data.sft.resolve_chat_template); what it warns of, said on `logger` (the task's)."""
    from lmforge.data.sft import TRUNCATE, resolve_chat_template

    if cfg.data.truncate not in TRUNCATE:
        raise UserError(
            f"data.truncate='{cfg.data.truncate}' is not valid: choose one of {', '.join(TRUNCATE)}"
        )
    template = resolve_chat_template(
        cfg.data.chat_template, tokenizer, tokenizer.files[0].parent, cfg.data.prompt_template
    )
    if (
        cfg.data.prompt_template is not None
        and template is not None
        and cfg.data.chat_template != "alpaca"
    ):
        logger.warning(
            "data.prompt_template is not used: every record is rendered with the chat template "
            "data.chat_template=%s resolves to (data.chat_template=alpaca prompts with it)",
            cfg.data.chat_template,
        )
    if template is not None and template.stop_strings:
        pieces = len(tokenizer.encode(template.stop_strings[0]))
        logger.warning(
            "the chat template's turn marker %s is no token of this tokenizer: it is trained as text (%d "
            "tokens), and generation stops at the text; data.chat_template=lmforge ends answers with eos",
            template.stop_strings[0],
            pieces,
        )
    return template


class SFT(Task):
    name = "sft"

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        from lmforge.data.sft import SFTDataset

        d = cfg.data
        train_file, valid_file = data_files(cfg)
        if cfg.dpo.beta != DPOConfig().beta:
            log.warning(
                "dpo.beta is not used: it sets data.task=dpo's loss, and this run is data.task=%s",
                cfg.data.task,
            )
        template = run_chat_template(cfg, tokenizer)

        def make(path, max_records=None):
            return SFTDataset(
                path,
                tokenizer,
                d.seq_length,
                packing=d.packing,
                truncate=d.truncate,
                prompt_template=d.prompt_template,
                chat_template=template,
                assistant_only_loss=d.assistant_only_loss,
                max_records=max_records,
            )

        train = make(train_file, d.max_train_examples)
        say_chat_template(template, train.kinds, cfg, tokenizer)
        valid = make(valid_file) if valid_file else None
        if valid is not None and valid.kind != train.kind:
            log.warning(
                "data.valid_file holds %s records, data.train_file %s ones: each kind is rendered by its own "
                "built-in template, so val_loss scores a format the run does not train (nor export): give both "
                "files one kind, or set data.chat_template=NAME to render every record alike",
                valid.kind,
                train.kind,
            )
        data = TaskData(
            Epochs(train, total_samples(cfg), cfg.trainer.seed),
            valid,
            train.collate,
            chat_template=train.export_template,
        )
        return with_padding(data, cfg)

    def inputs(self, batch: Batch):
        # Packed: attention within each example; else right padding, where causal attention alone
        # is exact for every real token (see the module docstring).
        if "segment_ids" in batch:
            inputs = {"segment_ids": batch["segment_ids"], "position_ids": batch["position_ids"]}
        else:
            inputs = {}
        # aligned with the inputs (HF): position t is scored on label t + 1
        labels = batch["labels"]
        labels = torch.cat([labels[:, 1:], labels.new_full((len(labels), 1), IGNORE_INDEX)], 1)
        return batch["input_ids"], labels, inputs


def say_chat_template(template, kinds, cfg: RunConfig, tokenizer) -> None:
    """One line naming what renders the examples (`kinds`: a Counter of their record kinds), as
    generate and serve say theirs: data.chat_template=auto on a folder without a template renders
    by lmforge's built-ins."""
    from lmforge.data.sft import kind_rendering, template_origin

    d, folder = cfg.data, tokenizer.files[0].parent
    if template is not None:
        log.info(
            "chat template: %s (data.chat_template=%s) renders the examples",
            template_origin(d.chat_template, folder),
            d.chat_template,
        )
    else:
        log.info(
            "chat template: %s has none (data.chat_template=%s), so %s",
            folder,
            d.chat_template,
            kind_rendering(kinds, d.prompt_template),
        )
