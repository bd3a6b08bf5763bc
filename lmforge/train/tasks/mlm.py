"""BERT masked-LM samples from a .bin/.idx prefix, masked anew in every epoch."""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.train.config import RunConfig
from lmforge.train.data import check_data_tokenizer, check_token_ids, open_prefixes
from lmforge.train.tasks.base import Epochs, Task, TaskData, total_samples, with_padding


class MaskedLM(Task):
    name = "mlm"

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        from lmforge.data.mlm import MLMDataset

        d, total = cfg.data, total_samples(cfg)
        ids = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")}
        if None in ids.values():
            raise UserError(
                "MLM needs a BERT-style tokenizer with [CLS], [SEP], [MASK] and [PAD] tokens"
            )
        indexed, _ = open_prefixes(d.paths)
        if len(indexed) > 1:  # it read the first and dropped the others without a word
            raise UserError(
                f"data.task=mlm trains on one data prefix, got {len(indexed)} in data.paths: give one (a "
                "blend of several is pretraining's, data.task=pretrain)"
            )
        valid_indexed = open_prefixes([d.valid_file])[0] if d.valid_file else []
        check_token_ids(
            indexed + valid_indexed,
            cfg.model.resolve().vocab_size,
            d.cache_dir,
            fixed_vocab=bool(cfg.model.init_from),
        )
        check_data_tokenizer(indexed + valid_indexed, tokenizer)

        def make(data, seed, epochs=1):
            return MLMDataset(
                data,
                d.seq_length,
                tokenizer.vocab_size,
                ids["[CLS]"],
                ids["[SEP]"],
                ids["[MASK]"],
                ids["[PAD]"],
                seed=seed,
                num_epochs=epochs,
            )

        train = make(indexed[0], cfg.trainer.seed)
        if len(train) < total:  # each further epoch masks the same text differently
            train = make(indexed[0], cfg.trainer.seed, -(-total // len(train)))
        valid = make(valid_indexed[0], cfg.trainer.seed + 1) if d.valid_file else None
        return with_padding(
            TaskData(Epochs(train, total, cfg.trainer.seed), valid, train.collate), cfg
        )

    def validation_samples(self, cfg: RunConfig, valid, unit: int) -> int:
        """trainer.val_batches global batches, as pretraining validates (the whole file where it
        is smaller, or with val_batches 0): BERT's held-out text is a corpus, and scoring all of
        it at every validation took longer than the steps between."""
        whole = super().validation_samples(cfg, valid, unit)
        if not cfg.trainer.val_batches:
            return whole
        return min(
            whole, -(-cfg.trainer.val_batches * cfg.trainer.global_batch_size // unit) * unit
        )
