"""`lmforge pretrain CONFIG.yaml [key=value ...]` and `lmforge finetune ...`: one Trainer, the recipe's task."""

from __future__ import annotations

import argparse

from lmforge.errors import UserError

FINETUNE_KEYS = """\
data.task            sft (chat / instruction data), dpo (preference pairs), classification, mlm
data.train_file      JSON lines (or a JSON list); data.valid_file the same, for validation
                       sft: {"messages": [{"role", "content"}, ...]}, {"instruction", "input", "output"}
                            (Alpaca) or {"prompt", "completion"}
                       dpo: {"prompt", "chosen", "rejected"} (strings or chat message lists), optionally
                            "ref_chosen_logps" and "ref_rejected_logps"
                       classification: TSV/CSV/JSONL of text and label
data.chat_template   auto (the model's own, else built-ins), model, lmforge, chatml, alpaca, plain, or FILE.jinja
data.assistant_only_loss  true: loss on the assistant's tokens only; false: on every token (sft)
data.packing         true: several examples per sequence, attention kept inside each (sft)
data.truncate        cut (default) or drop: examples longer than data.seq_length (counts in the log)
data.prompt_template Alpaca records' prompt without a chat template, e.g. "Q: {instruction} {input}\\nA:"
lora.rank            turns LoRA on (8); lora.alpha (16), lora.dropout (0), lora.bf16_base (false),
                     lora.base_dtype (fp32; bf16; nf4: QLoRA through torchao, one process or FSDP2)
lora.targets         default (PEFT's: q,v or the fused qkv), all-linear, or names from q,k,v,o,gate,up,down,
                     router, experts (experts.gate_up, experts.down): a mixture of experts' router and experts
dpo.beta             0.1: how far the policy may move from the reference
model.init_from      the HF or lmforge folder (or a training checkpoint) to start from; with a preset, it wins
checkpoint.convert_to_hf  true: RUN_DIR/model, RUN_DIR/hf (merged), and RUN_DIR/hf-adapter (PEFT) under LoRA

recipes: configs/sft-pythia-160m.yaml, configs/lora-pythia-410m.yaml, configs/dpo-pythia-160m.yaml
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    if p.prog.endswith("finetune"):
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.epilog = "task keys (key=value overrides or YAML):\n" + FINETUNE_KEYS
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.train.config import load_run_config
    from lmforge.train.tasks import get_task
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(args.config, args.overrides)
    finetune = args.verb == "finetune"
    if finetune == get_task(cfg.data.task).pretraining:
        from lmforge.train.tasks import TASKS

        fine_tuning = "|".join(name for name, task in TASKS.items() if not task.pretraining)
        fix = f"set data.task={fine_tuning}" if finetune else "use `lmforge finetune`"
        raise UserError(f"`lmforge {args.verb}` got data.task={cfg.data.task}: {fix}")
    trainer = Trainer(cfg)
    last = trainer.fit()
    leave_process_group()
    if trainer.world.is_main:
        print(f"{trainer.summary(last)}; run folder {cfg.run_dir}")


def leave_process_group() -> None:
    """Destroy the default process group once the run is done (every rank gets here after its last collective), as
    torch asks: left alive, its threads meet the interpreter's teardown, and a finished 2-rank gloo run had one
    rank abort at exit ("terminate called without an active exception"), which torchrun reports as a failure."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
