"""The run config: YAML recipe + NeMo-style `key=value` overrides -> validated dataclasses.

A recipe has the sections below; every key and every value's type is checked, and a mistake fails
before any compute with the dotted key (and, for a typo, the closest valid one). The `model` section
takes a preset name and any ModelConfig field to override it, or `init_from` (an HF or lmforge
folder, or a training checkpoint) for continued pretraining and fine-tuning: it becomes a
ModelSection. `trainer.precision` is resolved into one Precision (RunConfig.precision). The
`parallel` section is lmforge.parallel's ParallelConfig (tensor, pipeline and data layout, see
`parallel_layout`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmforge.config import check_types, closest, from_dict, unknown_key_error
from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.lora import LoRAConfig
from lmforge.models.source import CONTEXT_OVERRIDES, RUN_OVERRIDES
from lmforge.parallel.mesh import ParallelConfig
from lmforge.rl.config import GRPOConfig
from lmforge.train.config_checks import check_run
from lmforge.train.data_keys import check_data_keys

log = logging.getLogger(__name__)

SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class Precision:
    """What trainer.precision means for every part of a run."""

    name: str
    param_dtype: torch.dtype  # weights, gradients and optimizer moments
    # bf16-mixed: fp32 weights, matmuls under bf16 autocast
    autocast_dtype: torch.dtype | None = None
    stochastic_rounding: bool = False  # bf16-sr: bf16 updates rounded stochastically (AdamWSR)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in (what the peak FLOP/s is measured for)."""
        return self.autocast_dtype or self.param_dtype


PRECISIONS = {
    "fp32": Precision("fp32", torch.float32),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, autocast_dtype=torch.bfloat16),
    "bf16-sr": Precision("bf16-sr", torch.bfloat16, stochastic_rounding=True),
    "bf16": Precision("bf16", torch.bfloat16),  # round to nearest
}


@dataclass
class DataConfig:
    # Megatron-style prefixes (PREFIX.bin/.idx), optionally weighted: [0.7, a, 0.3, b]; one bare
    # PREFIX is [PREFIX].
    paths: list[Any] | str = field(default_factory=list)
    # train,valid,test weights; each prefix is cut by sequence, as Megatron's --split
    split: str = "969,30,1"
    # Held-out prefixes to validate on, weighted as data.paths (Megatron's --valid-data-path): each
    # is read whole, and data.paths then trains whole (data.split is not read).
    valid_paths: list[Any] | str = field(default_factory=list)
    seq_length: int = 2048  # tokens per training sample (the run's context length)
    tokenizer: str | None = None  # default: the tokenizer beside model.init_from
    task: str = "pretrain"  # a name in lmforge.train.tasks.TASKS
    # Fine-tuning files (SFT JSON/JSONL, classification TSV/CSV/JSONL).
    train_file: str | None = None
    valid_file: str | None = None  # scored once whole at each validation
    # sft/dpo: train on the first N records of data.train_file only (transformers' examples'
    # --max_train_samples), for a first try that learns them visibly in seconds. None: every record.
    max_train_examples: int | None = None
    cache_dir: str | None = None  # sample-index cache; default beside the data
    packing: bool = False  # sft: pack several examples per sequence (attention kept inside each)
    # sft without a chat template: Alpaca records' prompt (default Stanford's)
    prompt_template: str | None = None
    # sft/dpo: auto (the model's own chat template, else a built-in per record kind), model (its
    # own, required), a built-in (lmforge, chatml, alpaca, plain) or a .jinja file (exported too).
    chat_template: str = "auto"
    # sft: loss on the assistant's tokens only; false: on every token
    assistant_only_loss: bool = True
    # sft/dpo: an example longer than seq_length is cut to it, or dropped ("drop")
    truncate: str = "cut"
    # classification: the text column (default: `sentence`, else `text`)
    text_key: str | None = None
    label_key: str = "label"  # classification: the label column
    # Data-loader processes. None: 2 on an accelerator (reading while the device computes), 0 on
    # the CPU (its cores run the step). A sample depends only on its index, not on this number.
    num_workers: int | None = None
    # Fine-tuning batches: padded to the longest example rounded up to this (capped at seq_length).
    # None: 64 with trainer.compile (a few static shapes, not a graph per length), else 8.
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):  # data.paths=PREFIX, without brackets
            self.paths = [self.paths]
        if isinstance(self.valid_paths, str):
            self.valid_paths = [self.valid_paths]
        if self.max_train_examples is not None and self.max_train_examples < 1:
            raise UserError(
                f"data.max_train_examples must be >= 1 (or unset: every record), got "
                f"{self.max_train_examples}"
            )
        if self.num_workers is not None and self.num_workers < 0:
            raise UserError(
                f"data.num_workers must be >= 0 (or unset: 2 on an accelerator, 0 on the CPU), "
                f"got {self.num_workers}"
            )


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimizer steps to train to (a finished run given more trains on)
    max_minutes: float | None = None  # stop (validate, save) once training has run this long
    # sequences per optimizer step: micro x accumulation (derived) x data-parallel size
    global_batch_size: int = 8
    micro_batch_size: int = 1  # sequences per forward and backward on one rank
    # auto: bf16-mixed where the device has bf16 matrix units, else fp32 (precision_for)
    precision: str = "auto"
    grad_clip: float = 1.0  # the gradients' global norm is scaled down to this; 0 = no clipping
    val_check_interval: int = 100  # steps between validations (and at the last step); 0 = never
    val_batches: int = 4  # global batches per validation
    # a row's loss is its step's alone, not the mean over the N (as Megatron, HF log)
    log_every_n_steps: int = 1
    seed: int = 1234  # initial weights, sample order, dropout: a run is the same for a seed
    # auto: the accelerator torch.accelerator reports (CUDA, ...), else cpu; or cpu, cuda, ...
    device: str = "auto"
    # default: gloo for CPU tensors + the device's own (cpu:gloo,cuda:nccl)
    dist_backend: str | None = None
    compile: bool = False  # torch.compile each block
    # CUDA: fp32 matrix products on TF32 tensor cores (10-bit mantissa); false: full fp32
    tf32: bool = True
    # the blocks' linears in FP8 through torchao (lmforge[fp8]; CUDA, compute capability 8.9+)
    float8: bool = False
    # FP8 scales: tensorwise (faster) | rowwise (more accurate with outliers)
    float8_recipe: str = "tensorwise"
    # torch.compile's backend (e.g. a vendor's for its accelerator)
    compile_backend: str = "inductor"
    compile_cache_dir: str | None = None  # persistent compile cache; default RUN_DIR/compile_cache
    # none | selective (keep matmul and attention outputs, recompute the rest) | full (recompute
    # each block); the old switch's true/false read as full/none.
    activation_checkpointing: str | bool = "none"
    max_consecutive_skips: int = 5  # NaN/Inf steps in a row before the run stops
    data_parallel: str = "ddp"  # ddp | fsdp: what the data-parallel ranks do (see parallel_layout)
    # false: plain progress lines (first step, validations, every 30 s) even on a terminal
    progress_bar: bool = True
    # seconds to wait for another run holding run_dir (its run.lock) before refusing
    lock_wait: float = 5.0


@dataclass
class OptimConfig:
    lr: float = 3e-4  # the peak learning rate, reached at the end of the warmup
    min_lr: float = 3e-5  # where the schedule ends, at optim.decay_steps
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's two moment decays
    eps: float = 1e-8  # Adam's epsilon
    warmup_steps: int = 0  # linear warmup: step n of W trains at lr * n / W
    # after the warmup, down to min_lr: cosine | linear | constant (stays at lr)
    schedule: str = "cosine"
    decay_steps: int | None = None  # default: trainer.max_steps


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0 = only at the end
    save_top_k: int = 1  # by `monitor` at validation; -1 keeps all
    # the metric that ranks checkpoints for save_top_k, measured at their step
    monitor: str = "val_loss"
    mode: str = "min"  # min | max: which end of `monitor` is best
    save_last: bool = True  # keep the newest checkpoint beside the top k (resume from it)
    convert_to_hf: bool = False  # also write a Hugging Face folder at the end
    # Write in the background while training goes on (DCP async_save; the state is copied to host
    # memory first).
    async_save: bool = False


@dataclass
class DPOConfig:
    # how far the policy may move from the reference (Rafailov et al. 2023; TRL's default)
    beta: float = 0.1


@dataclass
class EvalConfig:
    """Downstream evals on the live model (lmforge.train.downstream): lm-eval tasks, as `lmforge
    eval` runs them."""

    tasks: list[str] = field(default_factory=list)  # `lmforge eval --tasks` names; none: no evals
    every_n_steps: int = 0  # and at the last step; 0: the last step only
    num_fewshot: int | None = None  # default: each task's own
    limit: float | None = None  # the first N documents of each task (a fraction of them if < 1)
    batch_size: int = 16  # requests per forward
    # where the tasks' relative data files are (`lmforge eval --data-dir`)
    data_dir: str | None = None
    include_path: list[str] = field(default_factory=list)  # folders of your own task YAMLs

    def __post_init__(self) -> None:
        for name, low in (("every_n_steps", 0), ("batch_size", 1), ("num_fewshot", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise UserError(f"eval.{name} must be >= {low}, got {getattr(self, name)}")
        if self.limit is not None and self.limit <= 0:
            raise UserError(f"eval.limit must be > 0, got {self.limit}")


@dataclass
class CostConfig:
    usd_per_hour: float = 0.0  # price of one node (machine), for tokens per dollar
    peak_flops: float | None = None  # per process; default: measured (CPU) or datasheet (GPU)
    # per process, for mfu_fp8 under trainer.float8; default: datasheet
    peak_flops_fp8: float | None = None

    def __post_init__(self) -> None:
        for name in ("usd_per_hour", "peak_flops", "peak_flops_fp8"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"cost.{name} must be >= 0, got {value}")


def exportable(config: ModelConfig) -> ModelConfig:
    """`config`, if its family's Hugging Face class can hold it: a switch that class hard-wires
    otherwise (grouped key/value heads on GPT-NeoX, a layernorm Llama) fails when the recipe is
    read, not at the export after training."""
    from lmforge.models.hf import adapter_for

    adapter_for(config.family).config_to_hf(config)
    return config


@dataclass
class ModelSection:
    """The `model:` section: `preset` and ModelConfig fields, or `init_from` (HF folder, lmforge
    folder or training checkpoint) with the few fields a run may change on top of it
    (RUN_OVERRIDES).

    `config` is the run's ModelConfig when the section defines it (a preset, or every field);
    with init_from and no preset it is None until `resolve()` reads the source's config (no
    weights)."""

    # a name in lmforge.models.PRESETS (pythia-160m, llama-3.1-8b, tiny-neox ...)
    preset: str | None = None
    # A Hugging Face or lmforge folder, or a training checkpoint: its config and weights (and
    # tokenizer) start the run.
    init_from: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # the ModelConfig fields as written
    config: ModelConfig | None = None
    # A resume whose init_from is gone: the newest checkpoint, whose config defines the model (the
    # resume fills every weight; setup.stand_in_source). Not part of the section as written.
    stand_in: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, section: dict[str, Any]) -> ModelSection:
        from lmforge.models.presets import preset, preset_fields

        if not isinstance(section, dict):
            raise UserError(f"config section 'model' must be a mapping, got {section!r}")
        known = {f.name for f in dataclasses.fields(ModelConfig)} | {"preset", "init_from"}
        for key in section:
            if key not in known:
                raise unknown_key_error(key, known, "model.")
        name, init_from = section.get("preset"), section.get("init_from")
        for key in ("preset", "init_from"):
            if section.get(key) is not None and not isinstance(section[key], str):
                raise UserError(f"model.{key}: expected a string, got {section[key]!r}")
        overrides = {k: v for k, v in section.items() if k not in ("preset", "init_from")}
        if name:
            try:
                config = from_dict(
                    ModelConfig, preset_fields(preset(name), overrides), where="model."
                )
                if init_from is None:
                    exportable(config)
            # a shape the overrides broke: say which overrides, on which preset
            except UserError as e:
                if not overrides or str(e).startswith(("unknown config key", "model.")):
                    raise
                given = ", ".join(f"model.{k}={v}" for k, v in overrides.items())
                raise UserError(f"model.preset {name} with {given}: {e}") from None
        elif init_from:
            config = None
            check_types(ModelConfig, overrides, "model.")
            if set(overrides) - set(RUN_OVERRIDES):
                bad = ", ".join(f"model.{k}" for k in sorted(set(overrides) - set(RUN_OVERRIDES)))
                raise UserError(
                    f"{bad} cannot be set with model.init_from, whose folder defines the model (it may "
                    f"take only {', '.join(RUN_OVERRIDES)})"
                )
        else:
            if not {"family", "hidden_size", "num_layers"} & set(overrides):
                raise UserError(
                    "the recipe names no model: set model.init_from=FOLDER (a Hugging Face or lmforge "
                    "folder, or a training checkpoint) or model.preset=NAME"
                )
            config = exportable(from_dict(ModelConfig, overrides, where="model."))
        return cls(preset=name, init_from=init_from, overrides=overrides, config=config)

    def resolve(self) -> ModelConfig:
        """The run's ModelConfig: the section's own, or model.init_from's with the allowed
        overrides."""
        if self.init_from is None:
            return self.config
        from lmforge.models.io import missing_model_folder

        # reads the folder's config.json / lmforge.json
        from lmforge.models.source import source_config

        if self.stand_in is None and not Path(self.init_from).exists():
            raise UserError(f"model.init_from: {missing_model_folder(self.init_from)}")
        source = source_config(self.stand_in or self.init_from)
        # A preset's recipe was written for another model: its context is not a request to extend
        # this one's.
        allowed = [k for k in RUN_OVERRIDES if not (self.preset and k in CONTEXT_OVERRIDES)]
        if self.config is not None and self.config != source and not getattr(self, "_said", False):
            # A recipe written for training from scratch, pointed at a checkpoint: the source's
            # architecture wins.
            self._said = True  # once, however often the run resolves its model
            differ = [
                f.name
                for f in dataclasses.fields(ModelConfig)
                if f.name not in allowed and getattr(self.config, f.name) != getattr(source, f.name)
            ]
            shown = ", ".join(differ[:6]) + (" ..." if len(differ) > 6 else "")
            # Fields written out (recipe or command line) say more than a preset: a warning names
            # them and the preset; else one line says the preset is not used.
            named = [k for k in self.overrides if k not in allowed and k in differ]
            if named:
                log.warning(
                    "%s not used, nor model.preset %s: model.init_from '%s' defines the model (its %s)",
                    ", ".join(f"model.{k}={self.overrides[k]}" for k in named),
                    self.preset,
                    self.init_from,
                    ", ".join(f"{k}={getattr(source, k)}" for k in named),
                )
            else:
                log.info(
                    "model.init_from '%s' defines the model: model.preset %s and its fields are not used (%s "
                    "differ)",
                    self.init_from,
                    self.preset,
                    shown,
                )
        changed = {k: v for k, v in self.overrides.items() if k in allowed}
        learned = [
            k for k in CONTEXT_OVERRIDES if k in changed and source.position_embedding != "rotary"
        ]
        if learned and any(changed[k] != getattr(source, k) for k in learned):
            raise UserError(
                f"model.{learned[0]}: '{self.init_from}' has learned position embeddings, weights for "
                f"its {source.max_position_embeddings} positions: keep data.seq_length within them"
            )
        return dataclasses.replace(source, **changed)

    def to_dict(self) -> dict[str, Any]:
        """The section as written (what config.yaml records)."""
        head = {
            k: v
            for k, v in (("preset", self.preset), ("init_from", self.init_from))
            if v is not None
        }
        return {**head, **self.overrides}


# The recipes in a source checkout (configs/ beside the package): `configs/x.yaml` from another
# folder names it.
SHIPPED_RECIPES = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class RunConfig:
    # the model: a preset and its fields, or init_from
    model: ModelSection = field(default_factory=ModelSection)
    # what the run reads: tokenized prefixes or task files
    data: DataConfig = field(default_factory=DataConfig)
    # steps, batch, precision, device, validation
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)  # AdamW and the learning-rate schedule
    # when to save, what to keep, exports
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # price and peak FLOP/s: tokens per dollar, MFU
    cost: CostConfig = field(default_factory=CostConfig)
    # tensor, pipeline, data, expert layout
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # a `lora:` section (e.g. lora.rank=8) trains adapters on a frozen base
    lora: LoRAConfig | None = None
    dpo: DPOConfig = field(default_factory=DPOConfig)  # data.task=dpo
    # data.task=grpo: rollouts, rewards, the policy loss
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # downstream evals during training (eval.tasks)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the run folder: checkpoints, metrics.jsonl, tensorboard/, exports
    run_dir: str = "runs/default"

    def __post_init__(self) -> None:
        t = self.trainer
        if isinstance(self.model, dict):
            self.model = ModelSection.parse(self.model)
        _choice("trainer.precision", t.precision, ("auto", *PRECISIONS))
        if isinstance(t.activation_checkpointing, bool):
            t.activation_checkpointing = "full" if t.activation_checkpointing else "none"
        _choice(
            "trainer.activation_checkpointing",
            t.activation_checkpointing,
            ("none", "selective", "full"),
        )
        _choice("optim.schedule", self.optim.schedule, SCHEDULES)
        _choice("checkpoint.mode", self.checkpoint.mode, ("min", "max"))
        _choice("trainer.data_parallel", t.data_parallel, ("ddp", "fsdp"))
        _choice("trainer.float8_recipe", t.float8_recipe, ("tensorwise", "rowwise"))
        check_run(self)  # the values no run can use (negative steps, betas that are not two, ...)
        check_data_keys(self.data)  # a key the task does not read, set as if it did

    @property
    def precision(self) -> Precision:
        """trainer.precision on the device trainer.device names (see precision_for)."""
        from lmforge.devices import accelerator

        name = self.trainer.device
        found = accelerator() if name == "auto" else None
        return self.precision_for(found or torch.device("cpu" if name == "auto" else name))

    def precision_for(self, device: torch.device) -> Precision:
        """trainer.precision on `device`: `auto` is bf16-mixed where the device multiplies bf16
        matrices in hardware (bf16 autocast is then ~2x faster than fp32), fp32 where it does not
        (a CPU without AMX or avx512_bf16 runs bf16 GEMMs on a scalar path, ~100x slower than
        fp32)."""
        if self.trainer.precision != "auto":
            return PRECISIONS[self.trainer.precision]
        from lmforge.devices import bf16_matmul

        return PRECISIONS["bf16-mixed" if bf16_matmul(device)[0] else "fp32"]


def parallel_layout(cfg: RunConfig, world_size: int) -> ParallelConfig:
    """The run's layout over `world_size` processes: `parallel.*`, with the data dimensions filled
    in.

    `trainer.data_parallel` says what the data-parallel ranks do when `parallel` leaves the data
    dimensions open (data_shard=-1, data_replicate=1, the defaults): `ddp` replicates the model on
    them (data_replicate takes the processes that tensor x pipeline leave), `fsdp` shards it
    (data_shard takes them). One switch thus keeps meaning the same thing with or without tensor and
    pipeline parallelism, and every recipe written before the `parallel` section trains as it did.
    Setting parallel.data_shard or parallel.data_replicate states the layout outright, and
    trainer.data_parallel is then not consulted (HSDP: both > 1).

    Every layout, one process included, goes through lmforge.parallel.parallelize: replicated data
    ranks alone are DDP, sharded ones FSDP2 (HSDP with both), under tensor parallelism too; under a
    pipeline the data ranks are FSDP2 (replicas: one shard each, whole parameters and all-reduced
    gradients, DDP's arithmetic).
    """
    p = cfg.parallel
    if p.data_shard == -1 and p.data_replicate == 1:
        fixed = p.tensor * p.pipeline * p.context
        if world_size % fixed:
            raise UserError(
                f"parallel.tensor={p.tensor} x pipeline={p.pipeline} x context={p.context} = {fixed} "
                f"does not divide the world size {world_size}: change the layout or the number of "
                "processes"
            )
        rest = world_size // fixed
        if cfg.trainer.data_parallel == "ddp":
            p = dataclasses.replace(p, data_replicate=rest, data_shard=1)
        else:
            p = dataclasses.replace(p, data_shard=rest)
    return p.resolved(world_size)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        if key == "trainer.precision" and str(value).lower() in (
            "fp16",
            "16",
            "16-mixed",
            "fp16-mixed",
            "half",
        ):
            raise UserError(
                f"{key}='{value}': fp16 is not supported (it needs loss scaling): use bf16-mixed, bf16 "
                "autocast over fp32 weights, which needs none"
            )
        hint = closest(str(value), choices)
        raise UserError(f"{key}='{value}' is not valid{hint}: choose one of {', '.join(choices)}")


def _yaml_problem(e: yaml.YAMLError, where: bool = True) -> str:
    """PyYAML's error as one phrase: what is wrong and (`where`) its line and column, 1-based."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return (
        f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
        if where and mark is not None
        else problem
    )


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe and apply `a.b=value` overrides (OmegaConf dotlist syntax)."""
    try:
        try:
            base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
        except yaml.YAMLError as e:
            raise UserError(
                f"config file '{path}' is not valid YAML ({_yaml_problem(e)}): fix that line"
            ) from None
        if not isinstance(base, DictConfig):
            raise UserError(
                f"config file '{path}' holds a {type(base).__name__.removesuffix('Config').lower()}, not "
                "sections: write it as model:, data:, trainer: ... (see configs/)"
            )
        for item in overrides:
            if "=" not in item:
                raise UserError(
                    f"override '{item}' is not key=value: write e.g. trainer.max_steps=100"
                )
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as e:
                raise UserError(
                    f"override '{item}' is not valid YAML after the '=' "
                    f"({_yaml_problem(e, where=False)}): write e.g. lora.targets=[q,v], and text with ': ' "
                    f"or braces in YAML quotes inside the shell's, 'key=\"...\"'"
                ) from None
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except FileNotFoundError:
        shipped = SHIPPED_RECIPES / Path(path).name
        known = shipped.is_file() and not Path(path).is_absolute()
        hint = f": the recipe that ships with lmforge is '{shipped}'" if known else ""
        raise UserError(f"config file '{path}' does not exist{hint}") from None
    except OmegaConfBaseException as e:
        raise UserError(f"cannot read config: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or "model" not in data:
        raise UserError(
            "the config has no `model` section: give model.preset=NAME or model.init_from=DIR"
        )
    section = ModelSection.parse(data.pop("model"))
    return dataclasses.replace(from_dict(RunConfig, data), model=section)


def run_dict(cfg: RunConfig) -> dict[str, Any]:
    """The run config as plain data (what config.yaml and a checkpoint's trainer.json record):
    the model section as written."""
    data = dataclasses.asdict(dataclasses.replace(cfg, model=ModelSection()))
    return {**data, "model": cfg.model.to_dict()}


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(run_dict(cfg)))
