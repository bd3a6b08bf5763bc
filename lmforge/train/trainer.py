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
import torch.distributed as dist

from lmforge.chat_template import CHAT_TEMPLATE_FILE
from lmforge.checkpoint import CheckpointManager
from lmforge.checkpoint.manager import DISK_FIX
from lmforge.checkpoint.rng import seed_all
from lmforge.devices import device_label, set_tf32, synchronize
from lmforge.errors import UserError
from lmforge.fsutil import atomic_write, out_of_space
from lmforge.models.config import ModelConfig
from lmforge.parallel.data_parallel import init_world
from lmforge.parallel.mesh import build_mesh
from lmforge.train.checkpointing import TrainCheckpoints, tokenizer_files
from lmforge.train.config import RunConfig, parallel_layout, run_dict, to_yaml
from lmforge.train.config_checks import check_torch_for_layout, schedule_warning
from lmforge.train.data import loader_workers, micro_batches
from lmforge.train.downstream import DownstreamEval
from lmforge.train.export import write_run_export
from lmforge.train.float8 import check_float8
from lmforge.train.lora import LORA_FLOPS_FRACTION, check_qlora
from lmforge.train.metrics import (
    MFU,
    MetricSink,
    RunTotals,
    cpu_peak_key,
    float8_mfu,
    flops_per_token,
    nodes_from_env,
    peak_flops,
    tokens_per_dollar,
)
from lmforge.train.optim import lr_at
from lmforge.train.progress import Progress
from lmforge.train.resume import ConfigDiff, record_changes
from lmforge.train.run_files import (
    end_step,
    forget_finished,
    remove_run_leftovers,
    truncate_metrics,
    write_finished,
)
from lmforge.train.run_lock import hold_run_dir
from lmforge.train.setup import (
    check_fit,
    check_tokenizer,
    init_model,
    load_run_tokenizer,
    memory_gb,
    stand_in_source,
    tokenizer_copy,
    warn_about_the_start,
)
from lmforge.train.step import check_pipeline_batch
from lmforge.train.stopping import Stopped, StopSignals
from lmforge.train.tasks import get_task
from lmforge.train.tasks.base import Blanks
from lmforge.train.transforms import lay_out_model, placement

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, planned: RunConfig | None = None):
        """`planned`: the run this one prepares (lmforge compile's throwaway steps): its schedule is the one to warn
        of, not these few steps'."""
        self.started = time.perf_counter()
        self.cfg, t = cfg, cfg.trainer
        self.planned = planned or cfg
        self.save_at_end = True  # lmforge compile's throwaway steps: False, nothing to resume from
        self.task = get_task(cfg.data.task)
        self.world = init_world(cfg.trainer.device, cfg.trainer.dist_backend)
        self.run_dir = Path(cfg.run_dir)
        # One run per folder, from before the resume cleans it up until fit() ends (rank 0 holds it).
        self.run_lock = hold_run_dir(self.run_dir, t.lock_wait)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        if self.world.is_main:
            remove_run_leftovers(self.run_dir, held=self.run_lock is not None and self.run_lock.held)
        # A resume reads its model's config and tokenizer from its checkpoint where model.init_from is gone.
        newest = CheckpointManager(self.run_dir / "checkpoints").latest()
        cfg.model.stand_in = stand_in_source(cfg, newest)
        layout = parallel_layout(cfg, self.world.size)  # before any compute: the world must fit the layout
        if t.float8:
            check_float8(self.world.device, layout.tensor, cfg.lora is not None)
        check_qlora(cfg.lora, self.world.device, layout, cfg.model.init_from)
        check_torch_for_layout(cfg, layout.tensor)
        # Batch and sequence length before the data: building it writes sample indices beside the data.
        check_pipeline_batch(layout, check_fit(cfg, cfg.model.resolve(), layout.data_parallel), t.micro_batch_size,
                             t.global_batch_size, layout.data_parallel)
        self.tokenizer = load_run_tokenizer(cfg, needed=not self.task.pretraining, resume_copy=tokenizer_copy(newest))
        # Each checkpoint holds a copy of the tokenizer: resumed, exported or served with its source gone.
        self.tokenizer_files = tokenizer_files(self.tokenizer) if self.world.is_main else {}
        self.data = self.task.build_data(cfg, self.tokenizer)
        # The eval tasks' data is read now: a missing file fails before any compute.
        self.downstream = DownstreamEval(cfg.eval, self.tokenizer, self.world.is_main) if cfg.eval.tasks else None
        precision = cfg.precision_for(self.world.device)
        if t.precision == "auto" and self.world.is_main:
            from lmforge.devices import bf16_matmul

            log.info("trainer.precision=auto: %s (%s)", precision.name, bf16_matmul(self.world.device)[1])
        if set_tf32(self.world.device, t.tf32) and self.world.is_main:
            log.info("fp32 matrix products on %s: %s", self.world.device.type,
                     "TF32 (trainer.tf32=false for full fp32)" if t.tf32 else "full fp32 (trainer.tf32=false)")
        seed_all(t.seed)  # dropout, data order, Python, NumPy: the same run draws the same (weights seed their own)
        meta, base_dtype = placement(cfg, layout, precision)
        model, fill = init_model(cfg, self.data.num_labels, meta=meta, device=self.world.device, dtype=base_dtype)
        self.mcfg: ModelConfig = model.config
        self.grad_accum = check_fit(cfg, self.mcfg, layout.data_parallel)
        layout = check_pipeline_batch(layout, self.grad_accum, t.micro_batch_size, t.global_batch_size,
                                      layout.data_parallel)
        check_tokenizer(self.tokenizer, self.mcfg, from_scratch=not cfg.model.init_from)
        if self.world.is_main:
            warn_about_the_start(cfg, self.mcfg)
        if fill is None:
            model.to(self.world.device, base_dtype)
        self.layout = layout
        mesh = build_mesh(layout, self.mcfg, device_type=self.world.device.type)
        # The model's transforms and parallel plans, in their order (lmforge.train.transforms), and its optimizer.
        self.training = lay_out_model(model, fill, cfg, layout, mesh, self.task, precision, self.world.device,
                                      self.run_dir, self.world.is_main)
        self.optimizer = self.training.optimizer
        self.dp_rank, self.dp_size = self.training.dp_rank, self.training.dp_size
        c = cfg.checkpoint
        self.checkpoints = TrainCheckpoints(self.run_dir / "checkpoints", c.save_top_k, c.monitor, c.mode, c.save_last,
                                            c.async_save)
        self.state = {"step": 0, "consumed_samples": 0, "skipped_steps": 0, "consecutive_skips": 0, "metrics": {},
                      "elapsed": 0.0, "tokens": 0.0}
        # The newest checkpoint that verifies, once its config is compared with this run's (lmforge.train.resume).
        diff = ConfigDiff(cfg, self.mcfg, self.run_dir, self.world.size)
        resumed = self.checkpoints.resume(self.training, self.optimizer, check=diff)
        self.resumed_from, self.changes = None, diff.changes
        if resumed is not None:
            self.resumed_from, state = resumed
            for key in ("run_config", "working_dir", "processes"):  # what the checkpoint says of its run
                state.pop(key, None)
            self.state = {"elapsed": 0.0, **state}
            log.info("resumed from %s at step %d", self.resumed_from, self.state["step"])
        # A rerun: fit() does nothing. The step the run ended at may be past its newest checkpoint (run_files.end_step).
        self.end_step = end_step(self.run_dir, self.state["step"], t.max_steps, self.world.is_main) if resumed else 0
        self.finished = resumed is not None and self.end_step >= t.max_steps
        if self.world.is_main and not self.finished and (warning := schedule_warning(self.planned)):
            log.warning(warning)  # a finished run's rerun trains nothing: no schedule to warn of
        # The wall clock of the run goes on from the checkpoint's: a resumed run's `elapsed` continues its curve.
        self.clock_zero = self.started - self.state["elapsed"]
        if cfg.cost.peak_flops or self.finished:  # a finished run rerun trains nothing: no seconds measuring a peak
            self.peak, self.peak_source = cfg.cost.peak_flops or 1.0, "config" if cfg.cost.peak_flops else "unused"
        else:
            self.peak, self.peak_source = peak_flops(self.world.device, precision.compute_dtype)
        self.flops_per_token = flops_per_token(self.mcfg, cfg.data.seq_length)
        if cfg.lora is not None:
            self.flops_per_token *= LORA_FLOPS_FRACTION
        measured = not cfg.cost.peak_flops and self.world.device.type == "cpu"
        self.mfu = MFU(self.flops_per_token, self.peak, self.peak_source, self.world.size,
                       cpu_peak_key(precision.compute_dtype) if measured else None)
        self.mfu_fp8 = (float8_mfu(self.world.device, self.flops_per_token, self.world.size, cfg.cost.peak_flops_fp8)
                        if t.float8 else None)
        self.totals = RunTotals(self.state["step"])
        self.nodes = nodes_from_env()

    def close(self) -> None:
        """Let go of the run folder (fit() does at its end; a process that dies lets go of it anyway)."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    @property
    def model(self) -> torch.nn.Module:
        """The model being trained (the pipeline stages' ParallelModel under a pipeline)."""
        return self.training.model

    def elapsed(self) -> float:
        """Seconds of wall clock since the run started: set-up, steps, validation and checkpoint writes."""
        return time.perf_counter() - self.clock_zero

    # -- one step ---------------------------------------------------------------------------

    def train_step(self, batches) -> dict[str, float]:
        micro = [next(batches) for _ in range(self.grad_accum)]
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
            log.warning("step %d: non-finite loss %s / grad norm %s: update skipped", self.state["step"], loss,
                        grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": grad_norm, "skipped": 0.0 if finite else 1.0, **task_metrics,
                **self.training.router_metrics, "_tokens": self.training.step_tokens}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        t = self.cfg.trainer
        valid = self.data.valid
        # Whole steps of the validation stream: micro x data-parallel rows (x microbatches under a pipeline).
        unit = t.micro_batch_size * self.dp_size * (self.layout.num_microbatches if self.layout.pipeline > 1 else 1)
        total = self.task.validation_samples(self.cfg, valid, unit)
        if total > len(valid):  # the last step's rows past the file are blanks: every example scored once
            valid = Blanks(valid, total, self.task.blank)
        batches = micro_batches(valid, 0, total, t.micro_batch_size, self.dp_rank, self.dp_size, 0,
                                self.data.collate)
        loss_sum, count, *stats = self.training.evaluate(batches).tolist()
        return self.task.metrics(loss_sum, count, *stats)

    # -- the run ----------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        try:
            with StopSignals(self.world.is_main) as stop:
                return self._fit(stop)
        except BaseException:
            self.checkpoints.close()  # a checkpoint still being written (checkpoint.async_save) is finished first
            raise
        finally:
            self.close()  # then the run folder is let go

    def _fit(self, stop: StopSignals) -> dict[str, float]:
        cfg, t, world = self.cfg, self.cfg.trainer, self.world
        start = self.state["step"]
        if self.finished:  # a rerun of a finished run: nothing to train, nothing to write (summary says so)
            # Its export was cut short: written again from the end step's checkpoint (where retention kept it).
            if cfg.checkpoint.convert_to_hf and not (self.run_dir / "hf").is_dir() and start >= t.max_steps:
                stop.restore()  # an export is no step: Ctrl-C stops it at once (its temporary folder goes with it)
                self.export_hf(self.run_dir / "hf")
            return {}
        if world.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                record_changes(self.run_dir, start, self.resumed_from, self.changes, self.state["consumed_samples"])
                atomic_write(self.run_dir / "config.yaml", to_yaml(cfg))
                forget_finished(self.run_dir)  # the run trains on: its end is no longer the one recorded
                truncate_metrics(self.run_dir / "metrics.jsonl", start)
            except OSError as e:  # a full disk is one line here too, as for a checkpoint
                if (full := out_of_space(e, self.run_dir, fix=DISK_FIX)) is None:
                    raise
                raise full from None
        # TensorBoard hides events at steps >= purge_step: those a killed run logged past the checkpoint, not its own.
        sink = MetricSink(self.run_dir, enabled=world.is_main, purge_step=start + 1)
        if world.is_main:
            log.info("%d process%s on %s; peak %.3g TFLOP/s per process (%s); %.3g model FLOPs per token",
                     world.size, "es" * (world.size > 1), device_label(world.device), self.peak / 1e12,
                     self.peak_source, self.flops_per_token)
        batches = micro_batches(self.data.train, self.state["consumed_samples"], t.max_steps * t.global_batch_size,
                                t.micro_batch_size, self.dp_rank, self.dp_size,
                                loader_workers(cfg.data.num_workers, world.device), self.data.collate,
                                pin_memory=world.device.type == "cuda")
        # A bar on a terminal, plain lines in a log file; trainer.progress_bar=false: plain lines on a terminal too.
        progress = (Progress(t.max_steps, start, terminal=None if t.progress_bar else False,
                             max_seconds=60 * t.max_minutes if t.max_minutes else None) if world.is_main else None)
        self.model.train()
        last: dict[str, float] = {}
        stopped: Stopped | None = None
        timed_out = False  # stopped by trainer.max_minutes
        fit_started = time.perf_counter()
        for step in range(start, t.max_steps):
            # A checkpoint records the validation of its own step, or none: one carrying an earlier step's val_loss
            # was ranked by it, and retention dropped better checkpoints for it (lmforge.checkpoint.manager).
            self.state["metrics"] = {}
            lr = lr_at(step, cfg.optim, t.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            synchronize(world.device)
            t0 = time.perf_counter()
            out = self.train_step(batches)
            synchronize(world.device)
            step_time = time.perf_counter() - t0
            self.state["step"] = step + 1
            self.state["consumed_samples"] += t.global_batch_size
            if self.state["consecutive_skips"] >= t.max_consecutive_skips:
                raise UserError(f"{t.max_consecutive_skips} steps in a row had a non-finite loss or gradient "
                                f"(step {step}): lower optim.lr or check the data; the last good checkpoint is "
                                f"{self.checkpoints.latest()}")
            tokens = out.pop("_tokens")  # a count for throughput, not a metric of its own
            self.totals.add(tokens, step_time)
            if self.state.get("tokens") is not None:  # (None: resumed from a checkpoint that did not count them)
                self.state["tokens"] += tokens
            last = {**out, "lr": lr, **self._throughput(step_time, tokens)}
            if step == start:  # start-up cost: setup, data, compilation, the first step
                last["time_to_first_step"] = time.perf_counter() - self.started
            if self.data.valid is not None and t.val_check_interval and (
                    (step + 1) % t.val_check_interval == 0 or step + 1 == t.max_steps):
                last.update(self.validate())
                self.state["metrics"] = {k: v for k, v in last.items() if k.startswith("val_")}
            evals = self.downstream is not None and self.downstream.due(step + 1, t.max_steps)
            if evals:
                last.update(self.downstream.run(self.training, self.mcfg, world.device))
            # Each start's first step is logged: its time_to_first_step is the start-up `lmforge compare` shows.
            logged = (step + 1) % t.log_every_n_steps == 0 or step == start
            if world.is_main and (logged or "val_loss" in last or evals):
                sink.log(step + 1, {**last, "elapsed": self.elapsed()})
            if progress is not None:
                progress.update(step + 1, last)
            every = cfg.checkpoint.every_n_steps
            saved = None
            out_of_time = bool(t.max_minutes) and time.perf_counter() - fit_started > 60 * t.max_minutes
            # Ctrl-C, SIGTERM: save this step (kept by retention) and stop; trainer.max_minutes: validate, save, stop
            signum, out_of_time = stop.agree(world.device, out_of_time and step + 1 < t.max_steps)
            if every and (step + 1) % every == 0 and step + 1 != t.max_steps and not out_of_time:
                saved = self.save(wait=False, resume_point=signum is not None)
                if signum is None:  # a signal that came while it was written stops the run here, not a step later
                    signum, _ = stop.agree(world.device, False)
            if signum is not None:
                self.checkpoints.wait()
                if not self.checkpoints.kept(saved):  # none, or one retention has let go of since
                    saved = self.save(resume_point=True)
                stopped = Stopped(f"stopped by {signal.Signals(signum).name} at step {step + 1}: saved checkpoint "
                                  f"{saved}; run the same command again to resume", signum)
                break
            if out_of_time:  # the end's save below writes this step
                log.info("trainer.max_minutes=%s reached at step %d: stopping", t.max_minutes, step + 1)
                timed_out = True
                if self.data.valid is not None and t.val_check_interval and "val_loss" not in last:
                    last.update(self.validate())
                    self.state["metrics"] = {k: v for k, v in last.items() if k.startswith("val_")}
                    if world.is_main:
                        sink.log(step + 1, {**last, "elapsed": self.elapsed()})
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
        self.ended = self.elapsed()  # the run's clock at its end: finished.json and the last line give this one time
        if world.is_main:
            write_finished(self.run_dir, self.state["step"], self.ended, self.state.get("tokens"),
                           cfg.cost.usd_per_hour * self.nodes, self.checkpoints.latest())
        return last

    def summary(self, last: dict[str, float]) -> str:
        """The run's last line: this invocation's steps, tokens, time, average tokens/s and MFU, final losses."""
        if self.finished:
            step, max_steps = self.end_step, self.cfg.trainer.max_steps
            return (f"the run is at step {step} already (trainer.max_steps={max_steps}): nothing to train, nothing "
                    "written; raise trainer.max_steps to train it further")
        wall = self.ended - (self.started - self.clock_zero)  # this invocation's part of the clock
        return self.totals.summary(self.state["step"], wall, last, self.mfu, self.cfg.cost.usd_per_hour * self.nodes)

    def _throughput(self, step_time: float, tokens: float) -> dict[str, float]:
        t = self.cfg.trainer
        tps = tokens / step_time
        # cost.usd_per_hour prices one machine; a multi-node torchrun pays for every node.
        per_dollar = tokens_per_dollar(tps, self.cfg.cost.usd_per_hour, nodes=self.nodes)
        return {
            "step_time": step_time,
            "tokens_per_second": tps,
            "sequences_per_second": t.global_batch_size / step_time,
            "mfu": self.mfu(tps),
            **({"mfu_fp8": self.mfu_fp8(tps)} if self.mfu_fp8 is not None else {}),
            "memory_gb": memory_gb(self.world.device),
            **({"tokens_per_dollar": per_dollar, "usd_per_million_tokens": 1e6 / per_dollar} if per_dollar else {}),
        }

    def save(self, wait: bool = True, resume_point: bool = False) -> Path | None:
        """Checkpoint the run; with checkpoint.async_save and `wait` false, return while it is written. A
        `resume_point` (the run stops before its end) is kept by retention until a newer checkpoint exists. None
        where retention would have deleted it at once (nothing written: CheckpointManager.dropped_at_once)."""
        self.state["elapsed"] = self.elapsed()
        # What a resume compares its config and world size with, and the folder its relative paths are from (a
        # checkpoint read from elsewhere finds its model.init_from and tokenizer: lmforge.models.source.run_path).
        state = {**self.state, "run_config": run_dict(self.cfg), "working_dir": os.getcwd(),
                 "processes": self.world.size}
        # The chat template the examples were rendered with: an export or `serve` of the checkpoint prompts as trained.
        template = {CHAT_TEMPLATE_FILE: self.data.chat_template} if self.data.chat_template is not None else {}
        path = self.checkpoints.save(self.state["step"], self.training, self.optimizer, state, self.mcfg,
                                     {**self.tokenizer_files, **template}, resume_point=resume_point)
        if wait:
            self.checkpoints.wait()
        return path

    def export_hf(self, out: Path) -> None:
        """Write the final weights as an lmforge model folder (RUN_DIR/model) and a Hugging Face folder `out` beside
        it (a LoRA run's adapter too). Every rank takes part (sharded tensors are gathered); rank 0 writes."""
        full = self.training.full_state_dict()
        if self.world.is_main:
            write_run_export(full, self.cfg, self.mcfg, self.tokenizer, self.data.chat_template, self.run_dir / "model",
                             out, self.state["step"])
        if dist.is_initialized():
            dist.barrier()

