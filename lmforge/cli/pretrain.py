"""`lmforge pretrain CONFIG.yaml [key=value ...]` and `lmforge finetune ...`: one Trainer, the
recipe's task."""

from __future__ import annotations

import argparse
import os

from lmforge.errors import UserError

FINETUNE_KEYS = """\
data.task            sft (chat / instruction data), dpo (preference pairs), classification, mlm
data.train_file      JSON lines (or a JSON list); data.valid_file the same, for validation
                       sft: {"messages": [{"role", "content"}, ...]}, {"instruction", "input", "output"}
                            (Alpaca), {"instruction", "instances": [{"input", "output"}, ...]} (seed tasks:
                            one example per instance) or {"prompt", "completion"}
                       dpo: {"prompt", "chosen", "rejected"} (strings or chat message lists), optionally
                            "ref_chosen_logps" and "ref_rejected_logps"
                       classification: TSV/CSV/JSONL of text and label (columns: data.text_key, default
                            sentence or text; data.label_key, default label)
data.chat_template   auto (the model's own, else built-ins), model, lmforge, chatml, alpaca, plain, or FILE.jinja
data.assistant_only_loss  true: loss on the assistant's tokens only; false: on every token (sft)
data.packing         true: several examples per sequence, attention kept inside each (sft)
data.truncate        cut (default) or drop: examples longer than data.seq_length (counts in the log)
data.prompt_template Alpaca records' prompt without a chat template, in YAML quotes inside the shell's:
                     'data.prompt_template="Q: {instruction} {input}\\nA:"'
lora.rank            turns LoRA on (8); lora.alpha (16), lora.dropout (0), lora.bf16_base (false),
                     lora.base_dtype (fp32; bf16; nf4: QLoRA through torchao, one process or FSDP2)
lora.targets         default (PEFT's: q,v or the fused qkv), all-linear, or names from q,k,v,o,gate,up,down,
                     router, experts (experts.gate_up, experts.down): a mixture of experts' router and experts
dpo.beta             0.1: how far the policy may move from the reference
model.init_from      the HF or lmforge folder (or a training checkpoint) to start from; with a preset, it wins
checkpoint.convert_to_hf  true: RUN_DIR/model, RUN_DIR/hf (merged), and RUN_DIR/hf-adapter (PEFT) under LoRA

recipes: configs/sft-pythia-160m.yaml, configs/sft-qwen2.5-0.5b.yaml, configs/lora-pythia-410m.yaml,
         configs/qlora-llama-3.1-8b.yaml, configs/qlora-qwen3-30b-a3b.yaml, configs/dpo-pythia-160m.yaml
"""


RUN_KEYS = """\
model.preset         a built-in architecture (pythia-1b, llama-3.1-8b, qwen3-0.6b, mixtral-8x7b, ...)
model.init_from      an HF or lmforge folder, or a training checkpoint, to start from (continued pretraining)
data.paths           Megatron .bin/.idx prefixes (lmforge preprocess), or a blend [w1, prefix1, w2, prefix2]
data.split           train,valid,test weights, e.g. 969,30,1; data.seq_length tokens per sample
data.valid_paths     held-out prefixes to validate on, weighted as data.paths (then data.paths trains whole)
data.tokenizer       tokenizer.json or its folder (default: model.init_from's)
trainer.max_steps    optimizer steps; trainer.max_minutes stops (validates, saves) after that long
trainer.global_batch_size / micro_batch_size   samples per step / per forward on one data rank
trainer.precision    auto, fp32, bf16-mixed, bf16-sr (bf16 weights, stochastic rounding), bf16
trainer.compile      true: torch.compile each block; trainer.activation_checkpointing none|selective|full
trainer.data_parallel  ddp or fsdp; parallel.tensor, parallel.pipeline, parallel.expert, parallel.sequence_parallel
trainer.float8       true: Float8 matmuls through torchao on a GPU with FP8 units
optim.lr             peak learning rate; optim.min_lr, optim.weight_decay, optim.betas (two, in [0, 1)), optim.eps
optim.warmup_steps   linear warmup W: step n = 1, 2, ... trains at lr * n / W, the peak lr at step W (Megatron and
                     transformers start at 0 and peak at step W + 1; torchtitan and NeMo use lr * n / (W + 1))
optim.schedule       after the warmup: cosine (default) or linear from lr at step W + 1 to min_lr at step D + 1,
                     lr_n = min_lr + (lr - min_lr) * f((n - 1 - W) / (D - W)), D = optim.decay_steps (default
                     trainer.max_steps), f(p) = (1 + cos(pi p)) / 2 or 1 - p; min_lr from step D + 1;
                     constant: lr after the warmup
trainer.log_every_n_steps  a metrics row every N steps (and at each start's first step and each validation); its
                     loss is that one step's, not the mean over the N steps that Megatron and HF Trainer log
checkpoint.every_n_steps  and save_top_k, monitor, save_last, async_save; convert_to_hf: HF folder at the end
eval.tasks           lm-eval tasks run on the live model every eval.every_n_steps (eval.limit, eval.data_dir)
cost.usd_per_hour    the price of the run's devices: tokens per dollar in the log
run_dir              where config.yaml, metrics.jsonl, tensorboard/ and checkpoints/ go (a rerun resumes)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe (see configs/)")
    # default=[]: without one argparse lists an empty `*` positional as required ("required: config,
    # overrides")
    p.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. trainer.max_steps=100"
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    if p.prog.endswith("finetune"):
        p.epilog = (
            "task keys (key=value overrides or YAML):\n"
            + FINETUNE_KEYS
            + "\nrun keys, as for pretraining "
            "(lmforge pretrain --help): trainer.*, optim.*, checkpoint.*, parallel.*, eval.*, run_dir"
        )
    else:
        p.epilog = (
            "common keys (key=value overrides or YAML; every key: the dataclasses in "
            "lmforge/train/config.py):\n" + RUN_KEYS
        )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.train.config import load_run_config
    from lmforge.train.run_files import finished_already
    from lmforge.train.tasks import get_task
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(args.config, args.overrides)
    finetune = args.verb == "finetune"
    if finetune == get_task(cfg.data.task).pretraining:
        from lmforge.train.tasks import TASKS

        fine_tuning = "|".join(name for name, task in TASKS.items() if not task.pretraining)
        fix = f"set data.task={fine_tuning}" if finetune else "use `lmforge finetune`"
        raise UserError(f"`lmforge {args.verb}` got data.task={cfg.data.task}: {fix}")
    if (done := finished_already(cfg)) is not None:  # every rank alike: the same files
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{done}; run folder {cfg.run_dir}")
        return
    trainer = Trainer(cfg)
    last = trainer.fit()
    leave_process_group()
    if trainer.world.is_main:
        print(f"{trainer.summary(last)}; run folder {cfg.run_dir}")


def leave_process_group() -> None:
    """Destroy the default process group once the run is done (every rank gets here after its
    last collective), as torch asks: left alive, its threads meet the interpreter's teardown, and
    a finished 2-rank gloo run had one rank abort at exit ("terminate called without an active
    exception"), which torchrun reports as a failure."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
