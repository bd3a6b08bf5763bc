"""`lmforge eval MODEL --tasks T1,T2 [--lora ADAPTER_DIR]`: lm-evaluation-harness on an lmforge
folder, HF folder or training checkpoint, with a PEFT LoRA adapter merged in as generate and
serve merge it."""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmforge.models.config import ModelConfig

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        help="lmforge model folder, Hugging Face folder, or training checkpoint "
        "(RUN_DIR/checkpoints/step-N, read directly: no export)",
    )
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval task names: lmforge's local ones (wikitext2_local, sst2_local), "
        "yours (--include-path) or lm-eval's own (their data must be on this machine)",
    )
    p.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, e.g. a run's "
        "hf-adapter/) merged into MODEL on load, as generate and serve do: MODEL is its base",
    )
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of lm-eval task YAMLs to add; repeatable",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where local tasks' relative data_files are read (e.g. the folder holding "
        "corpora/wikitext-2/ and classification/sst-2/); default: beside each task's YAML",
    )
    p.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="few-shot examples per prompt (default: the task's)",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=None,
        help="evaluate only the first N documents of each task (a fraction if < 1): for quick checks",
    )
    p.add_argument(
        "--batch-size", default="16", help="sequences per forward (default 16; 'auto' = 16)"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (the accelerator torch reports, else cpu; the default), cpu, cuda, cuda:1 ...",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="cast weights (default: keep)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer file or folder (default: the model folder's; for a checkpoint, its run's)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="context length in tokens (default and most: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--output-path",
        default=None,
        metavar="FILE",
        help="write lm-eval's results JSON here (whole or not at all; missing folders are made)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.eval.harness import require_lm_eval

    require_lm_eval()  # before anything heavy: a missing lm-eval is one line, at once
    from lmforge.eval.harness import (
        check_results_path,
        evaluate,
        load_tasks,
        results_table,
        write_results,
    )
    from lmforge.eval.lm import LMForgeLM, context_length
    from lmforge.models.source import source_config, source_kind

    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    # The options are checked before the tasks' data and the model are read: a bad --output-path,
    # --max-length or --lora is one line at once, not a traceback or changed score at the end.
    output = check_results_path(args.output_path) if args.output_path else None
    # the model's config alone (no weights) says
    if args.max_length is not None or args.lora is not None:
        config = source_config(args.model, named_by="run")
        if args.max_length is not None:
            context_length(args.max_length, config.max_position_embeddings, "--max-length")
        if args.lora is not None:
            check_lora(config, args.lora)
    else:
        # a wrong model path fails before the tasks' data is read
        source_kind(args.model, named_by="run")
    tasks = load_tasks(args.tasks.split(","), args.include_path, args.data_dir)
    lm = LMForgeLM(
        args.model,
        tokenizer_path=args.tokenizer,
        peft=args.lora,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        max_length=args.max_length,
    )
    start = time.perf_counter()
    results = evaluate(lm, tasks, num_fewshot=args.num_fewshot, limit=limit)
    log.info("evaluated in %.1f s", time.perf_counter() - start)
    # before the file: a write that fails late still shows what was measured
    print(results_table(results))
    if output is not None:
        write_results(output, results)
        log.info("wrote %s", output)


def check_lora(config: ModelConfig, folder: str) -> None:
    """The adapter in `folder` against the model's config, on a model of no memory (the meta
    device): one that is not a LoRA adapter, or another base's, is refused before the tasks' data
    and the weights are read."""
    from lmforge.models.build import build
    from lmforge.models.peft_read import check_peft_adapter

    check_peft_adapter(build(config, device="meta"), folder)
