"""What a run is set up from: the model (fresh, imported, or from a checkpoint), its tokenizer, and the
per-block switches (activation checkpointing, compilation) applied before any parallelism."""

from __future__ import annotations

import dataclasses
import os
import resource
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from lmforge.checkpoint import load_model_weights
from lmforge.errors import UserError
from lmforge.models import build, load_pretrained
from lmforge.models.config import ModelConfig
from lmforge.models.io import is_model_dir, read_config
from lmforge.parallel.load import meta_model
from lmforge.train.config import RunConfig, model_config

# Model fields a run may change on top of model.init_from's own config.
INIT_FROM_OVERRIDES = ("dropout", "attention_dropout", "make_vocab_size_divisible_by")


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


def init_model(cfg: RunConfig, num_labels: int = 0, meta: bool = False) -> tuple[torch.nn.Module, Path | None]:
    """Fresh from a preset/config, or weights from model.init_from (HF folder, lmforge folder or a
    training checkpoint). Returns the model and the folder its tokenizer may come from.

    meta=True (a run over a DeviceMesh): with init_from, the model comes on the meta device, its weights
    left for each rank to read its own shards of after parallelize (lmforge.parallel.load.load_sharded
    from the returned folder). A new head or a checkpoint re-padded to another vocabulary multiple
    needs the whole model first: those are built whole as without meta."""
    model, source = _init_model(cfg, meta)
    if next(model.parameters()).is_meta and model.config.num_labels != num_labels:
        model, source = _init_model(cfg, False)
    return with_head(model, num_labels, cfg.trainer.seed), source


def _init_model(cfg: RunConfig, meta: bool = False) -> tuple[torch.nn.Module, Path | None]:
    mcfg, init_from = model_config(cfg.model)
    if init_from is None:
        return build(mcfg, seed=cfg.trainer.seed), None
    source = Path(init_from)
    if not source.is_dir():
        raise UserError(f"model.init_from '{source}' does not exist")
    if (source / "trainer.json").is_file():  # a training checkpoint: weights only, fresh optimizer
        model = build(mcfg or read_config(source), seed=cfg.trainer.seed, device="meta" if meta else None)
        multiple = cfg.model.get("make_vocab_size_divisible_by", model.config.make_vocab_size_divisible_by)
        if meta and multiple != model.config.make_vocab_size_divisible_by:
            return _init_model(cfg, False)
        if not meta:
            load_model_weights(source, model)
        return with_vocab_multiple(model, multiple), source
    model = meta_model(source) if meta else load_pretrained(source)
    if mcfg is not None and mcfg != model.config:
        raise UserError(f"model.preset/fields describe a different model than model.init_from '{source}': "
                        "drop the preset (the source folder defines the model)")
    overrides = {k: v for k, v in cfg.model.items() if k not in ("preset", "init_from")}
    if overrides:
        if set(overrides) - set(INIT_FROM_OVERRIDES):
            raise UserError(f"with model.init_from only {sorted(INIT_FROM_OVERRIDES)} may be overridden, got "
                            f"{sorted(overrides)}")
        for block in model.modules():  # dropout modules read their p at call time
            if isinstance(block, torch.nn.Dropout):
                block.p = overrides.get("dropout", block.p)
        multiple = overrides.pop("make_vocab_size_divisible_by", model.config.make_vocab_size_divisible_by)
        model.config = dataclasses.replace(model.config, **overrides)
        model = with_vocab_multiple(model, multiple)
    return model.train(), source if (is_model_dir(source) or (source / "config.json").is_file()) else None


def with_vocab_multiple(model: torch.nn.Module, multiple: int) -> torch.nn.Module:
    """The same model with its vocabulary rows padded to a multiple of `multiple` (Megatron's
    make_vocab_size_divisible_by, 128 x the tensor-parallel degree): rows past vocab_size are zeros,
    never scored, and dropped again by the Hugging Face export."""
    from lmforge.models.io import materialize

    if multiple == model.config.make_vocab_size_divisible_by:
        return model
    cfg = dataclasses.replace(model.config, make_vocab_size_divisible_by=multiple)
    if next(model.parameters()).is_meta:  # the sharded load pads each rank's rows itself
        return build(cfg, device="meta").train(model.training)
    vocab = set(model.vocab_parameters)

    def tensors():
        for name, t in model.named_parameters():
            t = t.detach()[: cfg.vocab_size] if name in vocab else t.detach()
            if name in vocab and cfg.padded_vocab_size > t.shape[0]:
                t = torch.cat([t, t.new_zeros(cfg.padded_vocab_size - t.shape[0], *t.shape[1:])])
            yield name, t

    p = next(model.parameters())
    return materialize(cfg, tensors(), device=p.device, dtype=p.dtype).train(model.training)


def check_fit(cfg: RunConfig, mcfg: ModelConfig, data_parallel: int) -> int:
    """Gradient accumulation steps: global batch / (micro batch x data-parallel size), which must divide."""
    t = cfg.trainer
    per_step = t.micro_batch_size * data_parallel
    if t.global_batch_size % per_step:
        raise UserError(f"trainer.global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
                        f"{t.micro_batch_size} x {data_parallel} data-parallel processes: change one of them")
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


def check_tokenizer(tok, mcfg: ModelConfig) -> None:
    if tok is not None and tok.vocab_size > mcfg.vocab_size:
        raise UserError(f"the tokenizer at '{tok.files[0].parent}' has {tok.vocab_size} ids but the model only "
                        f"{mcfg.vocab_size}: use the model's tokenizer or a model with a larger vocab_size")


def use_compile_cache(path: Path) -> None:
    """Point Inductor's on-disk caches at `path`: `lmforge compile` fills it, the run that follows
    (same config, same path) loads compiled graphs instead of compiling them again."""
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


