"""The training loop: setup() checks everything before any compute, fit() trains.

One loop serves pretraining, continued pretraining and fine-tuning; what differs is the data
and where the weights come from (config.model.init_from).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import resource
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from lmforge.checkpoint import CheckpointManager, load_model_weights
from lmforge.errors import UserError
from lmforge.models import build, load_pretrained
from lmforge.models.config import ModelConfig
from lmforge.models.io import is_model_dir, read_config
from lmforge.parallel.data_parallel import World, all_reduce_mean, gradient_sync, init_world, unwrap, wrap
from lmforge.train.config import RunConfig, model_config, to_yaml
from lmforge.train.data import micro_batches
from lmforge.train.metrics import MetricSink, flops_per_token, peak_flops, tokens_per_dollar
from lmforge.train.optim import build_optimizer, lr_at
from lmforge.train.tasks import build_task_data, count_items, count_tokens, task_loss

log = logging.getLogger(__name__)


def with_head(model: torch.nn.Module, num_labels: int, seed: int) -> torch.nn.Module:
    """The same network with a classification head of num_labels (or back to its LM head): every
    shared tensor is copied, the new head (and a BERT pooler, if new) starts from the usual init."""
    if model.config.num_labels == num_labels:
        return model
    cfg = dataclasses.replace(model.config, num_labels=num_labels)
    target = build(cfg, seed=seed)
    source = model.state_dict()
    own = target.state_dict()
    with torch.no_grad():
        for name, tensor in own.items():
            if name in source and source[name].shape == tensor.shape:
                tensor.copy_(source[name])
    return target


def init_model(cfg: RunConfig, num_labels: int = 0) -> tuple[torch.nn.Module, Path | None]:
    """Fresh from a preset/config, or weights from model.init_from (HF folder, lmforge folder or a
    training checkpoint). Returns the model and the folder its tokenizer may come from."""
    model, source = _init_model(cfg)
    return with_head(model, num_labels, cfg.trainer.seed), source


def _init_model(cfg: RunConfig) -> tuple[torch.nn.Module, Path | None]:
    mcfg, init_from = model_config(cfg.model)
    if init_from is None:
        return build(mcfg, seed=cfg.trainer.seed), None
    source = Path(init_from)
    if not source.is_dir():
        raise UserError(f"model.init_from '{source}' does not exist")
    if (source / "trainer.json").is_file():  # a training checkpoint: weights only, fresh optimizer
        model = build(mcfg or read_config(source), seed=cfg.trainer.seed)
        load_model_weights(source, model)
        return model, source
    model = load_pretrained(source)
    if mcfg is not None and mcfg != model.config:
        raise UserError(f"model.preset/fields describe a different model than model.init_from '{source}': "
                        "drop the preset (the source folder defines the model)")
    overrides = {k: v for k, v in cfg.model.items() if k not in ("preset", "init_from")}
    if overrides:
        allowed = {"dropout", "attention_dropout"}
        if set(overrides) - allowed:
            raise UserError(f"with model.init_from only {sorted(allowed)} may be overridden, got {sorted(overrides)}")
        for block in model.modules():  # dropout modules read their p at call time
            if isinstance(block, torch.nn.Dropout):
                block.p = overrides.get("dropout", block.p)
        model.config = dataclasses.replace(model.config, **overrides)
    return model.train(), source if (is_model_dir(source) or (source / "config.json").is_file()) else None


def _check_fit(cfg: RunConfig, mcfg: ModelConfig, world: World) -> int:
    t = cfg.trainer
    per_step = t.micro_batch_size * world.size
    if t.global_batch_size % per_step:
        raise UserError(f"trainer.global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
                        f"{t.micro_batch_size} x {world.size} data-parallel processes: change one of them")
    if cfg.data.seq_length > mcfg.max_position_embeddings:
        raise UserError(f"data.seq_length {cfg.data.seq_length} exceeds the model's max_position_embeddings "
                        f"{mcfg.max_position_embeddings}: shorten the sequences or raise the model's positions")
    return t.global_batch_size // per_step


def load_run_tokenizer(cfg: RunConfig, source: Path | None):
    """data.tokenizer, else the tokenizer beside model.init_from; fine-tuning needs one."""
    from lmforge.tokenizers import load_tokenizer

    path = cfg.data.tokenizer or source
    if path is None:
        if cfg.data.task != "pretrain":
            raise UserError(f"data.task={cfg.data.task} needs a tokenizer: set data.tokenizer or model.init_from")
        return None
    return load_tokenizer(path)


def _check_tokenizer(tok, mcfg: ModelConfig) -> None:
    if tok is not None and tok.vocab_size > mcfg.vocab_size:
        raise UserError(f"the tokenizer at '{tok.files[0].parent}' has {tok.vocab_size} ids but the model only "
                        f"{mcfg.vocab_size}: use the model's tokenizer or a model with a larger vocab_size")


def use_compile_cache(path: Path) -> None:
    """Point Inductor's on-disk caches at `path`: `lmforge compile` fills it, the run that follows
    (same config, same path) loads compiled graphs instead of compiling them again."""
    import os

    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block in the backward pass instead of keeping its activations."""
    for block in model.layers:
        forward = block.forward
        block.forward = lambda *args, _f=forward: checkpoint(_f, *args, use_reentrant=False)


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.started = time.perf_counter()
        self.cfg = cfg
        self.world = init_world()
        self.run_dir = Path(cfg.run_dir)
        self.task = cfg.data.task
        _, init_from = model_config(cfg.model)
        source = Path(init_from) if init_from else None
        self.tokenizer = load_run_tokenizer(cfg, source)
        self.data = build_task_data(cfg, self.tokenizer)
        model, self.source = init_model(cfg, self.data.num_labels)
        self.mcfg: ModelConfig = model.config
        self.grad_accum = _check_fit(cfg, self.mcfg, self.world)
        _check_tokenizer(self.tokenizer, self.mcfg)
        precision = cfg.trainer.precision
        self.autocast_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
        model.to(self.world.device, torch.bfloat16 if precision in ("bf16-sr", "bf16") else torch.float32)
        if cfg.trainer.activation_checkpointing:
            apply_activation_checkpointing(model)
        if cfg.trainer.compile:
            use_compile_cache(Path(cfg.trainer.compile_cache_dir or self.run_dir / "compile_cache"))
            for block in model.layers:
                block.compile()
        self.model = wrap(model, cfg.trainer.data_parallel, self.world)
        self.optimizer = build_optimizer(unwrap(self.model), cfg.optim, precision, cfg.trainer.seed)
        c = cfg.checkpoint
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", c.save_top_k, c.monitor, c.mode,
                                             c.save_last)
        self.state = {"step": 0, "consumed_samples": 0, "skipped_steps": 0, "consecutive_skips": 0, "metrics": {}}
        latest = self.checkpoints.latest()
        if latest is not None:
            self.state = self.checkpoints.load(latest, self.model, self.optimizer)
            log.info("resumed from %s at step %d", latest, self.state["step"])
        self.fused_loss = True  # the LM loss of lmforge.train.loss; benchmarks/train.py profiles both ways
        compute_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        self.peak, self.peak_source = (cfg.cost.peak_flops, "config") if cfg.cost.peak_flops else peak_flops(
            self.world.device, compute_dtype)
        self.flops_per_token = flops_per_token(self.mcfg, cfg.data.seq_length)

    # -- one step ---------------------------------------------------------------------------

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, int]:
        batch = {k: v.to(self.world.device) for k, v in batch.items()}
        ctx = torch.autocast(self.world.device.type, self.autocast_dtype) if self.autocast_dtype else (
            contextlib.nullcontext())
        with ctx:
            return task_loss(self.task, self.model, batch, self.fused_loss)

    def train_step(self, batches) -> dict[str, float]:
        t = self.cfg.trainer
        micro = [next(batches) for _ in range(self.grad_accum)]
        # Normalise by the step's global count of labelled items (tokens, or examples), known before
        # any backward: accumulation and data parallelism then give one big batch's gradient.
        counts = torch.tensor([sum(count_items(self.task, b) for b in micro),
                               sum(count_tokens(b) for b in micro)], dtype=torch.float64)
        counts = all_reduce_mean(counts, self.world) * self.world.size
        total_loss = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(micro):
            with gradient_sync(self.model, i == self.grad_accum - 1):
                loss, _, _ = self._loss(batch)
                (loss / counts[0].item() * self.world.size).backward()
            total_loss += loss.detach().double().cpu()
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm)).float().item()
        loss = all_reduce_mean(total_loss.reshape(1), self.world).item() * self.world.size / counts[0].item()
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
        return {"loss": loss, "grad_norm": grad_norm, "skipped": 0.0 if finite else 1.0, "_tokens": counts[1].item()}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        t = self.cfg.trainer
        valid = self.data.valid
        if self.task == "pretrain":  # the same fixed samples every time, so the curve is comparable
            total = t.val_batches * t.global_batch_size
        else:  # the whole validation file, split across ranks
            total = len(valid) // (t.micro_batch_size * self.world.size) * t.micro_batch_size * self.world.size
            if total == 0:
                raise UserError(f"the validation file has {len(valid)} examples, fewer than one micro-batch per "
                                "process: give a larger one or lower trainer.micro_batch_size")
        batches = micro_batches(valid, 0, total, t.micro_batch_size, self.world.rank, self.world.size, 0,
                                self.data.collate)
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        for batch in batches:
            loss, count, correct = self._loss(batch)
            sums += torch.tensor([loss.item(), count, correct], dtype=torch.float64)
        self.model.train()
        sums = all_reduce_mean(sums, self.world)
        val_loss = (sums[0] / sums[1]).item()
        out = {"val_loss": val_loss}
        if self.task == "classification":
            out["val_accuracy"] = (sums[2] / sums[1]).item()
        else:
            out["val_ppl"] = math.exp(min(val_loss, 50.0))
        return out

    # -- the run ----------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        cfg, t, world = self.cfg, self.cfg.trainer, self.world
        start = self.state["step"]
        if world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
            _truncate_metrics(self.run_dir / "metrics.jsonl", start)
        sink = MetricSink(self.run_dir, enabled=world.is_main, purge_step=start)
        if world.is_main:
            log.info("peak %.1f TFLOP/s per process (%s); %.3g model FLOPs per token", self.peak / 1e12,
                     self.peak_source, self.flops_per_token)
        batches = micro_batches(self.data.train, self.state["consumed_samples"], t.max_steps * t.global_batch_size,
                                t.micro_batch_size, world.rank, world.size, cfg.data.num_workers, self.data.collate)
        bar = None
        if world.is_main and t.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)
        self.model.train()
        last: dict[str, float] = {}
        fit_started = time.perf_counter()
        for step in range(start, t.max_steps):
            lr = lr_at(step, cfg.optim, t.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if world.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = self.train_step(batches)
            if world.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            self.state["step"] = step + 1
            self.state["consumed_samples"] += t.global_batch_size
            if self.state["consecutive_skips"] >= t.max_consecutive_skips:
                raise UserError(f"{t.max_consecutive_skips} steps in a row had a non-finite loss or gradient "
                                f"(step {step}): lower optim.lr or check the data; the last good checkpoint is "
                                f"{self.checkpoints.latest()}")
            last = {**out, "lr": lr, **self._throughput(step_time, out.pop("_tokens"))}
            if step == start:  # start-up cost: setup, data, compilation, the first step
                last["time_to_first_step"] = time.perf_counter() - self.started
            if self.data.valid is not None and t.val_check_interval and (
                    (step + 1) % t.val_check_interval == 0 or step + 1 == t.max_steps):
                last.update(self.validate())
                self.state["metrics"] = {k: v for k, v in last.items() if k.startswith("val_")}
            if world.is_main and ((step + 1) % t.log_every_n_steps == 0 or "val_loss" in last):
                sink.log(step + 1, last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_second']:.0f}",
                                **({"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}))
            every = cfg.checkpoint.every_n_steps
            if every and (step + 1) % every == 0 and step + 1 != t.max_steps:
                self.save()
            if t.max_minutes and time.perf_counter() - fit_started > 60 * t.max_minutes and step + 1 < t.max_steps:
                log.info("trainer.max_minutes=%s reached at step %d: stopping", t.max_minutes, step + 1)
                if self.data.valid is not None and t.val_check_interval and "val_loss" not in last:
                    last.update(self.validate())
                    self.state["metrics"] = {k: v for k, v in last.items() if k.startswith("val_")}
                    if world.is_main:
                        sink.log(step + 1, last)
                break
        if bar is not None:
            bar.close()
        if self.state["step"] > start or self.checkpoints.latest() is None:
            self.save()
        sink.close()
        if cfg.checkpoint.convert_to_hf and world.is_main:
            self.export_hf(self.run_dir / "hf")
        return last

    def _throughput(self, step_time: float, tokens: float) -> dict[str, float]:
        t = self.cfg.trainer
        tps = tokens / step_time
        per_dollar = tokens_per_dollar(tps, self.cfg.cost.usd_per_hour, nodes=1)
        return {
            "step_time": step_time,
            "tokens_per_second": tps,
            "sequences_per_second": t.global_batch_size / step_time,
            "mfu": tps * self.flops_per_token / (self.peak * self.world.size),
            "memory_gb": memory_gb(self.world.device),
            **({"tokens_per_dollar": per_dollar, "usd_per_million_tokens": 1e6 / per_dollar} if per_dollar else {}),
        }

    def save(self) -> Path:
        return self.checkpoints.save(self.state["step"], self.model, self.optimizer, dict(self.state), self.mcfg)

    def export_hf(self, out: Path) -> None:
        """Write the final weights as an lmforge model folder and a Hugging Face folder beside it."""
        from lmforge.models.hf import export_hf
        from lmforge.models.io import save_model

        model_dir = self.run_dir / "model"
        tokenizer = self.tokenizer.files[0] if self.tokenizer is not None else None
        save_model(unwrap(self.model), model_dir, tokenizer_from=tokenizer, overwrite=True)
        export_hf(model_dir, out, overwrite=True)
        log.info("wrote Hugging Face folder %s", out)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 grad norm) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric rows past the checkpoint (a killed run may have logged beyond it)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.replace(path)
