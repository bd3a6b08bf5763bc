"""Downstream evals inside a training run: lm-evaluation-harness tasks (lmforge.eval) on the live
model.

    eval:
      tasks: [wikitext2_local, sst2_local]   # any `lmforge eval --tasks` name
      every_n_steps: 500                     # and at the last step; 0: the last step only
      data_dir: /data                        # --data-dir of lmforge eval

The tasks and their data are loaded when the run starts, so a missing file fails before any compute.
Rank 0 evaluates: the model itself where one process holds it whole (one process, DDP), else the
whole model gathered from its shards (FSDP, tensor or pipeline parallel; every rank takes part in
the gather) and built on rank 0's device for the evaluation. The random states are those of before,
so a run with evals trains exactly as one without. Each task's metrics come back as
"eval/<task>/<metric>" for TensorBoard and metrics.jsonl.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from lmforge.errors import UserError

log = logging.getLogger(__name__)


class DownstreamEval:
    def __init__(self, cfg, tokenizer, is_main: bool):
        """`cfg`: the run's EvalConfig (tasks set); `tokenizer`: the run's."""
        if tokenizer is None:
            raise UserError(
                "eval.tasks needs the run's tokenizer: set data.tokenizer (or model.init_from a folder "
                "with tokenizer files)"
            )
        self.cfg, self.tokenizer, self.is_main = cfg, tokenizer, is_main
        self.tasks = None
        if is_main:
            from lmforge.eval.harness import load_tasks

            self.tasks = load_tasks(cfg.tasks, cfg.include_path, cfg.data_dir)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether `step` (steps done) is an eval step."""
        every = self.cfg.every_n_steps
        return step == max_steps or bool(every and step % every == 0)

    def run(self, training, mcfg, device: torch.device) -> dict[str, float]:
        """The tasks' metrics on rank 0 ({} elsewhere). Every rank must call it."""
        model = training.model
        whole = not training.pm.pipelined and not any(
            isinstance(p, _dtensor()) for p in model.parameters()
        )
        full = None if whole else training.full_state_dict()  # a collective: every rank
        metrics: dict[str, float] = {}
        if self.is_main:
            if not whole:
                from lmforge.models.io import materialize

                model = materialize(mcfg, full.items(), device, next(iter(full.values())).dtype)
            metrics = self._evaluate(model)
        if dist.is_initialized():
            dist.barrier()
        return metrics

    def _evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        from lmforge.eval.harness import evaluate, preserved_rng, quiet_task_bars, scalar_metrics
        from lmforge.eval.lm import LMForgeLM

        was_training = model.training
        start = time.perf_counter()
        try:
            with preserved_rng(), quiet_task_bars():
                lm = LMForgeLM(
                    model=model.eval(),
                    tokenizer=self.tokenizer,
                    batch_size=self.cfg.batch_size,
                    progress=False,
                )
                limit = self.cfg.limit
                results = evaluate(
                    lm,
                    self.tasks,
                    num_fewshot=self.cfg.num_fewshot,
                    limit=int(limit) if limit is not None and limit >= 1 else limit,
                )
        finally:
            model.train(was_training)
        metrics = scalar_metrics(results)
        log.info(
            "downstream eval (%.1f s): %s",
            time.perf_counter() - start,
            ", ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in metrics.items()),
        )
        return metrics


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor
