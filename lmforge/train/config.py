"""The run config: YAML recipe + NeMo-style `key=value` overrides -> validated dataclasses.

A recipe has the sections below; every key is checked, and a typo fails before any compute
with the dotted key and the closest valid one. The `model` section takes a preset name and
any ModelConfig field to override it, or `init_from` (an HF or lmforge folder) for continued
pretraining and fine-tuning. The `parallel` section is lmforge.parallel's ParallelConfig (tensor,
pipeline and data layout, see `parallel_layout`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmforge.config import closest, from_dict, unknown_key_error
from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.parallel.mesh import ParallelConfig

PRECISIONS = ("fp32", "bf16-mixed", "bf16-sr", "bf16")
SCHEDULES = ("cosine", "linear", "constant")
TASKS = ("pretrain", "sft", "classification", "mlm")


@dataclass
class DataConfig:
    # Megatron-style prefixes (PREFIX.bin/.idx), optionally weighted: [0.7, a, 0.3, b].
    paths: list[Any] = field(default_factory=list)
    split: str = "969,30,1"
    seq_length: int = 2048
    tokenizer: str | None = None  # default: the tokenizer beside model.init_from
    task: str = "pretrain"
    # Fine-tuning files (SFT JSON/JSONL, classification TSV/CSV/JSONL).
    train_file: str | None = None
    valid_file: str | None = None
    cache_dir: str | None = None  # sample-index cache; default beside the data
    packing: bool = False  # sft: pack several examples per sequence (attention kept inside each)
    prompt_template: str | None = None  # sft: default is the Stanford Alpaca template
    num_workers: int = 0
    # Fine-tuning batches are padded to their longest example rounded up to this multiple (capped at
    # seq_length). None: 64 with trainer.compile (a few static shapes instead of one graph per length,
    # or dynamic-shape kernels), else 8.
    pad_to_multiple_of: int | None = None


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    max_minutes: float | None = None  # stop (validate, save) once training has run this long
    global_batch_size: int = 8
    micro_batch_size: int = 1
    precision: str = "bf16-mixed"
    grad_clip: float = 1.0
    val_check_interval: int = 100  # steps between validations; 0 = never
    val_batches: int = 4  # global batches per validation
    log_every_n_steps: int = 1
    seed: int = 1234
    compile: bool = False  # torch.compile each block
    compile_cache_dir: str | None = None  # persistent compile cache; default RUN_DIR/compile_cache
    activation_checkpointing: bool = False
    max_consecutive_skips: int = 5  # NaN/Inf steps in a row before the run stops
    data_parallel: str = "ddp"  # ddp | fsdp: what the data-parallel ranks do (see parallel_layout)
    progress_bar: bool = True


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"
    decay_steps: int | None = None  # default: trainer.max_steps


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0 = only at the end
    save_top_k: int = 1  # by `monitor` at validation; -1 keeps all
    monitor: str = "val_loss"
    mode: str = "min"
    save_last: bool = True
    convert_to_hf: bool = False  # also write a Hugging Face folder at the end


@dataclass
class CostConfig:
    usd_per_hour: float = 0.0  # price of one node (machine), for tokens per dollar
    peak_flops: float | None = None  # per process; default: measured (CPU) or datasheet (GPU)


@dataclass
class RunConfig:
    model: dict[str, Any]
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run_dir: str = "runs/default"

    def __post_init__(self) -> None:
        t = self.trainer
        _choice("trainer.precision", t.precision, PRECISIONS)
        _choice("optim.schedule", self.optim.schedule, SCHEDULES)
        _choice("data.task", self.data.task, TASKS)
        _choice("checkpoint.mode", self.checkpoint.mode, ("min", "max"))
        _choice("trainer.data_parallel", t.data_parallel, ("ddp", "fsdp"))
        for name in ("max_steps", "global_batch_size", "micro_batch_size"):
            if getattr(t, name) < 1:
                raise UserError(f"trainer.{name} must be >= 1, got {getattr(t, name)}")


def parallel_layout(cfg: RunConfig, world_size: int) -> ParallelConfig:
    """The run's layout over `world_size` processes: `parallel.*`, with the data dimensions filled in.

    `trainer.data_parallel` says what the data-parallel ranks do when `parallel` leaves the data
    dimensions open (data_shard=-1, data_replicate=1, the defaults): `ddp` replicates the model on
    them (data_replicate takes the processes that tensor x pipeline leave), `fsdp` shards it
    (data_shard takes them). One switch thus keeps meaning the same thing with or without tensor and
    pipeline parallelism, and every recipe written before the `parallel` section trains as it did.
    Setting parallel.data_shard or parallel.data_replicate states the layout outright, and
    trainer.data_parallel is then not consulted (HSDP: both > 1).

    With tensor = pipeline = 1 and one data dimension the trainer wraps the model in DDP or FSDP2
    directly (`uses_mesh` is False), exactly as before the `parallel` section existed; any other
    layout goes through a DeviceMesh and lmforge.parallel.parallelize, where replicated data ranks are
    FSDP2's replicate dimension (gradients all-reduced, parameters whole).
    """
    p = cfg.parallel
    if p.data_shard == -1 and p.data_replicate == 1:
        fixed = p.tensor * p.pipeline
        if world_size % fixed:
            raise UserError(f"parallel.tensor={p.tensor} x pipeline={p.pipeline} = {fixed} does not divide the "
                            f"world size {world_size}: change the layout or the number of processes")
        rest = world_size // fixed
        if cfg.trainer.data_parallel == "ddp":
            p = dataclasses.replace(p, data_replicate=rest, data_shard=1)
        else:
            p = dataclasses.replace(p, data_shard=rest)
    return p.resolved(world_size)


def uses_mesh(layout: ParallelConfig) -> bool:
    """Whether a resolved layout needs lmforge.parallel (a DeviceMesh) rather than plain DDP/FSDP2."""
    return layout.tensor > 1 or layout.pipeline > 1 or (layout.data_replicate > 1 and layout.data_shard > 1)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = closest(str(value), choices)
        raise UserError(f"{key}='{value}' is not valid{hint}: choose one of {', '.join(choices)}")


MODEL_EXTRA_KEYS = ("preset", "init_from")


def model_config(section: dict[str, Any]) -> tuple[ModelConfig | None, str | None]:
    """(ModelConfig from preset + overrides, init_from). With init_from and no preset, the
    config comes from the source folder later; overrides then apply on top of it."""
    from lmforge.models.presets import preset

    known = {f.name for f in dataclasses.fields(ModelConfig)} | set(MODEL_EXTRA_KEYS)
    for key in section:
        if key not in known:
            raise unknown_key_error(key, known, "model.")
    fields = {k: v for k, v in section.items() if k not in MODEL_EXTRA_KEYS}
    init_from = section.get("init_from")
    if section.get("preset"):
        base = dataclasses.asdict(preset(section["preset"]))
        return from_dict(ModelConfig, {**base, **fields}, where="model."), init_from
    if init_from:
        return None, init_from
    return from_dict(ModelConfig, fields, where="model."), None


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe and apply `a.b=value` overrides (OmegaConf dotlist syntax)."""
    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
        for item in overrides:
            if "=" not in item:
                raise UserError(f"override '{item}' is not key=value: write e.g. trainer.max_steps=100")
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except FileNotFoundError:
        raise UserError(f"config file '{path}' does not exist") from None
    except OmegaConfBaseException as e:
        raise UserError(f"cannot read config: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or "model" not in data:
        raise UserError("the config has no `model` section: give model.preset=NAME or model.init_from=DIR")
    cfg = from_dict(RunConfig, data)
    model_config(cfg.model)  # validate model keys now, before any compute
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
