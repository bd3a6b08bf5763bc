"""The training loop: setup() checks everything before any compute, fit() trains.

One loop serves pretraining, continued pretraining and fine-tuning; what differs is the data
and where the weights come from (config.model.init_from).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path

import torch

from lmforge.chat_template import CHAT_TEMPLATE_FILE
from lmforge.checkpoint import CheckpointManager
from lmforge.checkpoint.rng import seed_all
from lmforge.devices import set_tf32, synchronize
from lmforge.models.config import ModelConfig
from lmforge.parallel.data_parallel import init_world
from lmforge.parallel.mesh import ParallelConfig, build_mesh
from lmforge.train.checkpointing import TrainCheckpoints, tokenizer_files
from lmforge.train.config import Precision, RunConfig, parallel_layout, run_dict, to_yaml
from lmforge.train.config_checks import schedule_warning
from lmforge.train.data import loader_workers, micro_batches
from lmforge.train.downstream import DownstreamEval
from lmforge.train.export import export_run
from lmforge.train.meters import RunMeters
from lmforge.train.metrics import MetricSink, nodes_from_env
from lmforge.train.optim import lr_at
from lmforge.train.policies import (
    CheckpointCadence,
    LogCadence,
    StopCheck,
    TimeLimit,
    ValidationDue,
    check_skips,
)
from lmforge.train.progress import Progress
from lmforge.train.resume import ConfigDiff
from lmforge.train.run_files import begin_training, end_step, remove_run_leftovers, write_finished
from lmforge.train.run_lock import hold_run_dir
from lmforge.train.setup import (
    check_fit,
    check_tokenizer,
    init_model,
    load_run_tokenizer,
    stand_in_source,
    tokenizer_copy,
    warn_about_the_start,
)
from lmforge.train.step import check_pipeline_batch
from lmforge.train.stopping import Stopped, StopSignals
from lmforge.train.tasks import get_task
from lmforge.train.tasks.base import Blanks
from lmforge.train.transforms import check_layout, lay_out_model, placement

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, planned: RunConfig | None = None):
        """`planned`: the run this one prepares (lmforge compile's throwaway steps): its schedule
        is the one to warn of, not these few steps'."""
        self.started = time.perf_counter()
        self.cfg, t = cfg, cfg.trainer
        self.planned = planned or cfg
        self.save_at_end = True  # lmforge compile's throwaway steps: False, nothing to resume from
        self.task = get_task(cfg.data.task)
        self.world = init_world(cfg.trainer.device, cfg.trainer.dist_backend)
        self.run_dir = Path(cfg.run_dir)
        # One run per folder, from before the resume cleans it up until fit() ends (rank 0 holds
        # it).
        self.run_lock = hold_run_dir(self.run_dir, t.lock_wait)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        """The set-up in phases, each checking what it can before the next spends anything."""
        layout, newest = self._check_layout()
        self._read_data(newest)
        precision = self._precision()
        model, fill, self.layout = self._build_model(layout, precision)
        self._lay_out(model, fill, precision)
        self._resume()
        self._meters(precision)

    def _check_layout(self) -> tuple[ParallelConfig, Path | None]:
        """The run folder's leftovers gone; the layout, the device's and torch's support of it,
        and the batch checked before any compute. (the layout, the newest checkpoint or None)"""
        cfg = self.cfg
        if self.world.is_main:
            remove_run_leftovers(
                self.run_dir, held=self.run_lock is not None and self.run_lock.held
            )
        # A resume reads its model's config and tokenizer from its checkpoint where model.init_from
        # is gone.
        newest = CheckpointManager(self.run_dir / "checkpoints").latest()
        cfg.model.stand_in = stand_in_source(cfg, newest)
        # before any compute: the world must fit the layout
        layout = parallel_layout(cfg, self.world.size)
        check_layout(cfg, layout, self.world.device)
        return layout, newest

    def _read_data(self, newest: Path | None) -> None:
        """The tokenizer (the checkpoint's copy where its source is gone), the task's data and
        the eval tasks'."""
        cfg = self.cfg
        self.tokenizer = load_run_tokenizer(
            cfg, needed=not self.task.pretraining, resume_copy=tokenizer_copy(newest)
        )
        # Each checkpoint holds a copy of the tokenizer: resumed, exported or served with its source
        # gone.
        self.tokenizer_files = tokenizer_files(self.tokenizer) if self.world.is_main else {}
        self.data = self.task.build_data(cfg, self.tokenizer)
        # The eval tasks' data is read now: a missing file fails before any compute.
        self.downstream = (
            DownstreamEval(cfg.eval, self.tokenizer, self.world.is_main) if cfg.eval.tasks else None
        )

    def _precision(self) -> Precision:
        t, device = self.cfg.trainer, self.world.device
        precision = self.cfg.precision_for(device)
        if t.precision == "auto" and self.world.is_main:
            from lmforge.devices import bf16_matmul

            log.info("trainer.precision=auto: %s (%s)", precision.name, bf16_matmul(device)[1])
        if set_tf32(device, t.tf32) and self.world.is_main:
            log.info(
                "fp32 matrix products on %s: %s",
                device.type,
                "TF32 (trainer.tf32=false for full fp32)"
                if t.tf32
                else "full fp32 (trainer.tf32=false)",
            )
        return precision

    def _build_model(self, layout: ParallelConfig, precision: Precision):
        """The model built (on the meta device where the layout shards it), the batch checked
        against it. (model, its fill or None, the layout with its pipeline microbatches)"""
        cfg, t = self.cfg, self.cfg.trainer
        # dropout, data order, Python, NumPy: the same run draws the same (weights seed
        # their own)
        seed_all(t.seed)
        meta, base_dtype = placement(cfg, layout, precision)
        model, fill = init_model(
            cfg, self.data.num_labels, meta=meta, device=self.world.device, dtype=base_dtype
        )
        self.mcfg: ModelConfig = model.config
        self.grad_accum = check_fit(cfg, self.mcfg, layout.data_parallel)
        layout = check_pipeline_batch(
            layout, self.grad_accum, t.micro_batch_size, t.global_batch_size, layout.data_parallel
        )
        check_tokenizer(self.tokenizer, self.mcfg, from_scratch=not cfg.model.init_from)
        if self.world.is_main:
            warn_about_the_start(cfg, self.mcfg)
        if fill is None:
            model.to(self.world.device, base_dtype)
        return model, fill, layout

    def _lay_out(self, model: torch.nn.Module, fill, precision: Precision) -> None:
        """The model's transforms and parallel plans, in their order (lmforge.train.transforms),
        and its optimizer."""
        mesh = build_mesh(self.layout, self.mcfg, device_type=self.world.device.type)
        self.training = lay_out_model(
            model,
            fill,
            self.cfg,
            self.layout,
            mesh,
            self.task,
            precision,
            self.world.device,
            self.run_dir,
            self.world.is_main,
        )
        self.optimizer = self.training.optimizer
        self.dp_rank, self.dp_size = self.training.dp_rank, self.training.dp_size

    def _resume(self) -> None:
        """The newest checkpoint that verifies, once its config is compared with this run's
        (lmforge.train.resume)."""
        cfg, t, c = self.cfg, self.cfg.trainer, self.cfg.checkpoint
        self.checkpoints = TrainCheckpoints(
            self.run_dir / "checkpoints", c.save_top_k, c.monitor, c.mode, c.save_last, c.async_save
        )
        self.state = {
            "step": 0,
            "consumed_samples": 0,
            "skipped_steps": 0,
            "consecutive_skips": 0,
            "metrics": {},
            "elapsed": 0.0,
            "tokens": 0.0,
        }
        diff = ConfigDiff(cfg, self.mcfg, self.run_dir, self.world.size)
        resumed = self.checkpoints.resume(self.training, self.optimizer, check=diff)
        self.resumed_from, self.changes = None, diff.changes
        if resumed is not None:
            self.resumed_from, state = resumed
            # what the checkpoint says of its run
            for key in ("run_config", "working_dir", "processes"):
                state.pop(key, None)
            self.state = {"elapsed": 0.0, **state}
            log.info("resumed from %s at step %d", self.resumed_from, self.state["step"])
        # A rerun: fit() does nothing. The step the run ended at may be past its newest checkpoint
        # (run_files.end_step).
        self.end_step = (
            end_step(self.run_dir, self.state["step"], t.max_steps, self.world.is_main)
            if resumed
            else 0
        )
        self.finished = resumed is not None and self.end_step >= t.max_steps
        if self.world.is_main and not self.finished and (warning := schedule_warning(self.planned)):
            log.warning(warning)  # a finished run's rerun trains nothing: no schedule to warn of

    def _meters(self, precision: Precision) -> None:
        """The run's clock, and what its throughput and MFU are measured against
        (lmforge.train.meters)."""
        # The wall clock of the run goes on from the checkpoint's: a resumed run's `elapsed`
        # continues its curve.
        self.clock_zero = self.started - self.state["elapsed"]
        self.meters = RunMeters.of(
            self.cfg,
            self.mcfg,
            precision,
            self.world.device,
            self.world.size,
            self.state["step"],
            nodes_from_env(),
            trains=not self.finished,
        )

    def close(self) -> None:
        """Let go of the run folder (fit() does at its end; a process that dies lets go of it
        anyway)."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained (the pipeline stages' ParallelModel under a pipeline)."""
        return self.training.model

    def elapsed(self) -> float:
        """Seconds of wall clock since the run started: set-up, steps, validation and checkpoint
        writes."""
        return time.perf_counter() - self.clock_zero

    # -- one step ---------------------------------------------------------------------------

    def train_step(self, batches) -> dict[str, float]:
        micro = [next(batches) for _ in range(self.grad_accum)]
        micro = self.task.before_step(micro, self.training, self.state["step"])  # GRPO's rollouts
        counts = self.training.global_counts(micro)
        loss, grad_norm = self.training.step(micro, counts, self.cfg.trainer.grad_clip)
        task_metrics = self.task.train_metrics(*self.training.step_stats)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.state["consecutive_skips"] = 0
        else:
            self.state["skipped_steps"] += 1
            self.state["consecutive_skips"] += 1
            log.warning(
                "step %d: non-finite loss %s / grad norm %s: update skipped",
                self.state["step"],
                loss,
                grad_norm,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "skipped": 0.0 if finite else 1.0,
            **task_metrics,
            **self.training.router_metrics,
            "_tokens": self.training.step_tokens,
        }

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        t = self.cfg.trainer
        valid = self.data.valid
        # Whole steps of the validation stream: micro x data-parallel rows (x microbatches under a
        # pipeline).
        unit = (
            t.micro_batch_size
            * self.dp_size
            * (self.layout.num_microbatches if self.layout.pipeline > 1 else 1)
        )
        total = self.task.validation_samples(self.cfg, valid, unit)
        # the last step's rows past the file are blanks: every example scored once
        if total > len(valid):
            valid = Blanks(valid, total, self.task.blank)
        batches = micro_batches(
            valid, 0, total, t.micro_batch_size, self.dp_rank, self.dp_size, 0, self.data.collate
        )
        loss_sum, count, *stats = self.training.evaluate(batches).tolist()
        return self.task.metrics(loss_sum, count, *stats)

    # -- the run ----------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        try:
            with StopSignals(self.world.is_main) as stop:
                return self._fit(stop)
        except BaseException:
            # a checkpoint still being written (checkpoint.async_save) is finished
            # first
            self.checkpoints.close()
            raise
        finally:
            self.close()  # then the run folder is let go

    def _fit(self, stop: StopSignals) -> dict[str, float]:
        cfg, t, world = self.cfg, self.cfg.trainer, self.world
        start = self.state["step"]
        # a rerun of a finished run: nothing to train, nothing to write (summary says so)
        if self.finished:
            # Its export was cut short: written again from the end step's checkpoint (where
            # retention kept it).
            if (
                cfg.checkpoint.convert_to_hf
                and not (self.run_dir / "hf").is_dir()
                and start >= t.max_steps
            ):
                # an export is no step: Ctrl-C stops it at once (its temporary
                # folder goes with it)
                stop.restore()
                self.export_hf(self.run_dir / "hf")
            return {}
        if world.is_main:
            begin_training(
                self.run_dir,
                start,
                to_yaml(cfg),
                self.resumed_from,
                self.changes,
                self.state["consumed_samples"],
            )
        # TensorBoard hides events at steps >= purge_step: those a killed run logged past the
        # checkpoint, not its own.
        sink = MetricSink(self.run_dir, enabled=world.is_main, purge_step=start + 1)
        if world.is_main:
            log.info("%s", self.meters.describe(world.size))
        batches = micro_batches(
            self.data.train,
            self.state["consumed_samples"],
            t.max_steps * t.global_batch_size,
            t.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            loader_workers(cfg.data.num_workers, world.device),
            self.data.collate,
            pin_memory=world.device.type == "cuda",
        )
        # A bar on a terminal, plain lines in a log file; trainer.progress_bar=false: plain lines on
        # a terminal too.
        progress = (
            Progress(
                t.max_steps,
                start,
                terminal=None if t.progress_bar else False,
                max_seconds=60 * t.max_minutes if t.max_minutes else None,
            )
            if world.is_main
            else None
        )
        logged = LogCadence(t.log_every_n_steps, start)
        validation = ValidationDue.of(self.data.valid, t.val_check_interval, t.max_steps)
        cadence = CheckpointCadence(cfg.checkpoint.every_n_steps, t.max_steps)
        self.model.train()
        last: dict[str, float] = {}
        stopped: Stopped | None = None
        timed_out = False  # stopped by trainer.max_minutes
        stopping = StopCheck(
            stop, world.device, TimeLimit(t.max_minutes, t.max_steps, time.perf_counter)
        )
        for step in range(start, t.max_steps):
            last, done = self._step(step, batches), step + 1
            if step == start:  # start-up cost: setup, data, compilation, the first step
                last["time_to_first_step"] = time.perf_counter() - self.started
            if validation.due(done):
                self._validate_into(last)
            evals = self.downstream is not None and self.downstream.due(done, t.max_steps)
            if evals:
                last.update(self.downstream.run(self.training, self.mcfg, world.device))
            # Each start's first step is logged: its time_to_first_step is the start-up `lmforge
            # compare` shows.
            if world.is_main and (logged.due(done) or "val_loss" in last or evals):
                sink.log(done, {**last, "elapsed": self.elapsed()})
            if progress is not None:
                progress.update(done, last)
            saved = None
            # Ctrl-C, SIGTERM: save this step (kept by retention) and stop; trainer.max_minutes:
            # validate, save, stop
            signum, out_of_time = stopping.after(done)
            if cadence.due(done, out_of_time):
                saved = self.save(wait=False, resume_point=signum is not None)
                if signum is None:
                    signum = stopping.signal()
            if signum is not None:
                stopped = self._stop(signum, saved, done)
                break
            if out_of_time:  # the end's save below writes this step
                log.info("trainer.max_minutes=%s reached at step %d: stopping", t.max_minutes, done)
                timed_out = True
                if validation.before_stop(last):
                    self._validate_into(last)
                    if world.is_main:
                        sink.log(done, {**last, "elapsed": self.elapsed()})
                break
        if progress is not None:
            progress.close()
        if stopped is not None:
            sink.close()
            raise stopped
        if self.save_at_end and (self.state["step"] > start or self.checkpoints.latest() is None):
            self.save(resume_point=timed_out)
        sink.close()
        if cfg.checkpoint.convert_to_hf:
            stop.restore()
            self.export_hf(self.run_dir / "hf")
        # the run's clock at its end: finished.json and the last line give this one time
        self.ended = self.elapsed()
        if world.is_main:
            write_finished(
                self.run_dir,
                self.state["step"],
                self.ended,
                self.state.get("tokens"),
                self.meters.usd_per_hour_paid,
                self.checkpoints.latest(),
            )
        return last

    def _step(self, step: int, batches) -> dict[str, float]:
        """Step `step` trained at its learning rate and counted: its metrics, throughput
        included."""
        t = self.cfg.trainer
        # A checkpoint records the validation of its own step, or none: one carrying an earlier
        # step's val_loss was ranked by it, and retention dropped better checkpoints for it
        # (lmforge.checkpoint.manager).
        self.state["metrics"] = {}
        lr = lr_at(step, self.cfg.optim, t.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        synchronize(self.world.device)
        t0 = time.perf_counter()
        out = self.train_step(batches)
        synchronize(self.world.device)
        step_time = time.perf_counter() - t0
        self.state["step"] = step + 1
        self.state["consumed_samples"] += t.global_batch_size
        check_skips(
            self.state["consecutive_skips"], t.max_consecutive_skips, step, self.checkpoints.latest
        )
        tokens = out.pop("_tokens")  # a count for throughput, not a metric of its own
        # (None: resumed from a checkpoint that did not count them)
        if self.state.get("tokens") is not None:
            self.state["tokens"] += tokens
        return {**out, "lr": lr, **self.meters.step(step_time, tokens)}

    def _validate_into(self, last: dict[str, float]) -> None:
        last.update(self.validate())
        self.state["metrics"] = {k: v for k, v in last.items() if k.startswith("val_")}

    def _stop(self, signum: int, saved: Path | None, done: int) -> Stopped:
        """A signal's stop: the checkpoint of step `done` written (unless a periodic one was, and
        retention kept it)."""
        self.checkpoints.wait()
        if not self.checkpoints.kept(saved):  # none, or one retention has let go of since
            saved = self.save(resume_point=True)
        return Stopped(
            f"stopped by {signal.Signals(signum).name} at step {done}: saved checkpoint {saved}; run the "
            "same command again to resume",
            signum,
        )

    def summary(self, last: dict[str, float]) -> str:
        """The run's last line: this invocation's steps, tokens, time, average tokens/s and MFU,
        final losses."""
        if self.finished:
            step, max_steps = self.end_step, self.cfg.trainer.max_steps
            return (
                f"the run is at step {step} already (trainer.max_steps={max_steps}): nothing to train, nothing "
                "written; raise trainer.max_steps to train it further"
            )
        wall = self.ended - (self.started - self.clock_zero)  # this invocation's part of the clock
        return self.meters.summary(self.state["step"], wall, last)

    def save(self, wait: bool = True, resume_point: bool = False) -> Path | None:
        """Checkpoint the run; with checkpoint.async_save and `wait` false, return while it is
        written. A `resume_point` (the run stops before its end) is kept by retention until a
        newer checkpoint exists. None where retention would have deleted it at once (nothing
        written: CheckpointManager.dropped_at_once)."""
        self.state["elapsed"] = self.elapsed()
        # What a resume compares its config and world size with, and the folder its relative paths
        # are from (a checkpoint read from elsewhere finds its model.init_from and tokenizer:
        # lmforge.models.source.run_path).
        state = {
            **self.state,
            "run_config": run_dict(self.cfg),
            "working_dir": os.getcwd(),
            "processes": self.world.size,
        }
        # The chat template the examples were rendered with: an export or `serve` of the checkpoint
        # prompts as trained.
        template = (
            {CHAT_TEMPLATE_FILE: self.data.chat_template}
            if self.data.chat_template is not None
            else {}
        )
        path = self.checkpoints.save(
            self.state["step"],
            self.training,
            self.optimizer,
            state,
            self.mcfg,
            {**self.tokenizer_files, **template},
            resume_point=resume_point,
        )
        if wait:
            self.checkpoints.wait()
        return path

    def export_hf(self, out: Path) -> None:
        """Write the final weights as an lmforge model folder (RUN_DIR/model) and a Hugging Face
        folder `out` beside it (a LoRA run's adapter too). Every rank takes part (sharded tensors
        are gathered); rank 0 writes."""
        export_run(
            self.training,
            self.cfg,
            self.mcfg,
            self.tokenizer,
            self.data.chat_template,
            self.run_dir / "model",
            out,
            self.state["step"],
            self.world.is_main,
        )
