"""`lmforge pretrain CONFIG.yaml [key=value ...]` and `lmforge finetune ...`: one Trainer, the recipe's task."""

from __future__ import annotations

import argparse

from lmforge.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.train.config import load_run_config
    from lmforge.train.tasks import get_task
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(args.config, args.overrides)
    finetune = args.verb == "finetune"
    if finetune == get_task(cfg.data.task).pretraining:
        fix = "set data.task=sft|classification|mlm" if finetune else "use `lmforge finetune`"
        raise UserError(f"`lmforge {args.verb}` got data.task={cfg.data.task}: {fix}")
    trainer = Trainer(cfg)
    last = trainer.fit()
    if trainer.world.is_main:
        shown = {k: round(v, 4) for k, v in last.items() if k in ("loss", "val_loss", "val_ppl", "tokens_per_second")}
        print(f"finished at step {trainer.state['step']}: {shown}; run folder {cfg.run_dir}")
