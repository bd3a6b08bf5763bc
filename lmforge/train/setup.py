"""What a run is set up from: the model (fresh, imported, or from a checkpoint), its tokenizer,
and the per-block switches (activation checkpointing, compilation) applied before any
parallelism."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import resource
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lmforge.devices import max_memory_allocated
from lmforge.errors import UserError
from lmforge.models import build, init_weights
from lmforge.models.config import ModelConfig
from lmforge.models.source import (
    checkpoint_lora,
    is_checkpoint,
    load_pretrained,
    source_config,
    tokenizer_folder,
)
from lmforge.train.config import RunConfig

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


def init_model(
    cfg: RunConfig,
    num_labels: int = 0,
    meta: bool = False,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.nn.Module, Callable | None]:
    """The run's model: fresh from its config, or with the weights of model.init_from (an HF
    folder, an lmforge folder or a training checkpoint, at the run's config: dropout and
    vocabulary padding as the run says).

    Returns (model, fill). meta=True (a layout that shards the model): the model comes on the
    meta device in `dtype`, and fill(pm), called with it laid out
    (lmforge.train.step.ParallelTraining), gives each rank its own shards only: initialised
    (init_sharded) or read from init_from (load_sharded). A new head, a checkpoint re-padded to
    another vocabulary multiple, or a LoRA run's checkpoint (merged) needs the whole model first:
    those are built whole as without meta. A LoRA run wraps the meta model with its adapters
    before it is laid out, and its fill then draws them too (lmforge.train.lora.apply_run_lora).
    Otherwise fill is None and a fresh model is initialised straight on `device`, one weight
    drawn on the CPU at a time: no process ever holds a whole fp32 copy on the CPU."""
    from lmforge.parallel.load import init_sharded, load_sharded

    mcfg, section, seed = cfg.model.resolve(), cfg.model, cfg.trainer.seed
    device = device or torch.device("cpu")
    # (a stand-in: the resume fills every weight)
    if section.init_from is None or section.stand_in is not None:
        fresh = dataclasses.replace(mcfg, num_labels=num_labels)
        model = build(fresh, device="meta").to(dtype).train()
        if meta:
            return model, functools.partial(init_sharded, seed=seed)
        model.to_empty(device=device)
        init_weights(model, fresh, seed)
        return model, None
    source = Path(section.init_from)
    before = source_config(source)
    repadded = mcfg.make_vocab_size_divisible_by != before.make_vocab_size_divisible_by
    log_init_from(source, mcfg, before)
    # A LoRA run's checkpoint is read whole and merged: its adapters have no place in the sharded
    # base.
    whole = is_checkpoint(source) and (repadded or checkpoint_lora(source) is not None)
    if meta and mcfg.num_labels == num_labels and not whole:
        return build(mcfg, device="meta").to(dtype).train(), functools.partial(
            load_sharded, source=source
        )
    model = with_config(load_pretrained(source, dtype=dtype), mcfg).train()
    return with_head(model, num_labels, seed), None


def log_init_from(source: Path, mcfg: ModelConfig, before: ModelConfig) -> None:
    """One line saying where the weights come from, how many, and what the run changes of them
    (the vocabulary rows re-padded): a continued-pretraining log said nothing of its start."""
    from lmforge.models import num_parameters
    from lmforge.models.source import source_kind

    kind = {
        "hf": "a Hugging Face folder",
        "lmforge": "an lmforge folder",
        "checkpoint": "a training checkpoint",
    }
    padded = (
        f"; vocabulary rows re-padded {before.padded_vocab_size} -> {mcfg.padded_vocab_size} (a multiple of "
        f"{mcfg.make_vocab_size_divisible_by}; the Hugging Face export cuts them back to {mcfg.vocab_size})"
        if before.padded_vocab_size != mcfg.padded_vocab_size
        else ""
    )
    log.info(
        "weights from model.init_from '%s' (%s): %s, %d layers of %d, %.1fM parameters%s",
        source,
        kind[source_kind(source)],
        mcfg.family,
        mcfg.num_layers,
        mcfg.hidden_size,
        num_parameters(build(mcfg, device="meta")) / 1e6,
        padded,
    )


def warn_about_the_start(cfg: RunConfig, mcfg: ModelConfig) -> None:
    """Starts that run but are seldom meant: fine-tuning random weights (a preset and no
    model.init_from), and a pretrained model's context stretched past what it was trained on
    (model.max_position_embeddings raised over the source's: no error, the rotary positions
    extrapolate, and the export then claims the longer context)."""
    if cfg.model.init_from is None:
        if cfg.data.task in ("sft", "dpo"):
            log.warning(
                "data.task=%s on randomly initialised weights (model.preset %s, no model.init_from): "
                "fine-tuning starts from a trained model: set model.init_from=FOLDER",
                cfg.data.task,
                cfg.model.preset,
            )
        elif cfg.lora is not None:  # (pretraining) adapters on a frozen base that never learns
            log.warning(
                "lora.rank=%d on randomly initialised weights (model.preset %s, no model.init_from): LoRA "
                "trains adapters beside a frozen base, random here: set model.init_from=FOLDER, or drop "
                "lora.* to pretrain the whole model",
                cfg.lora.rank,
                cfg.model.preset,
            )
        return
    if cfg.model.stand_in is not None:  # a resume: the source was checked when the run started
        return
    trained = source_config(cfg.model.init_from).max_position_embeddings
    if mcfg.max_position_embeddings > trained:
        log.warning(
            "model.max_position_embeddings %d is over the %d positions model.init_from '%s' was trained "
            "on: past them its rotary positions extrapolate (a model.rope_scaling usually goes with a longer "
            "context), and the export will say %d; data.seq_length=%d keeps to what it knows",
            mcfg.max_position_embeddings,
            trained,
            cfg.model.init_from,
            mcfg.max_position_embeddings,
            trained,
        )


def with_config(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """The same weights under `cfg`, which may differ from the model's config only in
    RUN_OVERRIDES: dropout, and the vocabulary rows padded to another multiple (Megatron's
    make_vocab_size_divisible_by, 128 x the tensor-parallel degree): rows past vocab_size are
    zeros, never scored, dropped again by the HF export."""
    from lmforge.models.io import materialize

    if cfg == model.config:
        return model
    vocab = set(model.vocab_parameters)

    def tensors():
        for name, t in model.named_parameters():
            t = t.detach()[: cfg.vocab_size] if name in vocab else t.detach()
            if name in vocab and cfg.padded_vocab_size > t.shape[0]:
                t = torch.cat([t, t.new_zeros(cfg.padded_vocab_size - t.shape[0], *t.shape[1:])])
            yield name, t

    p = next(model.parameters())
    return materialize(cfg, tensors(), device=p.device, dtype=p.dtype).train(model.training)


def with_vocab_multiple(model: torch.nn.Module, multiple: int) -> torch.nn.Module:
    """The same model with its vocabulary rows padded to a multiple of `multiple` (see
    with_config)."""
    return with_config(
        model, dataclasses.replace(model.config, make_vocab_size_divisible_by=multiple)
    )


def check_fit(cfg: RunConfig, mcfg: ModelConfig, data_parallel: int) -> int:
    """Gradient accumulation steps: global batch / (micro batch x data-parallel size), which must
    divide."""
    t = cfg.trainer
    per_step = t.micro_batch_size * data_parallel
    if t.global_batch_size % per_step:
        raise UserError(
            f"trainer.global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
            f"{t.micro_batch_size} x {data_parallel} data-parallel processes: change one of them"
        )
    if cfg.data.seq_length > mcfg.max_position_embeddings:
        fix = (
            f"shorten the sequences (data.seq_length={mcfg.max_position_embeddings}) or raise "
            "model.max_position_embeddings (rotary positions: no weights depend on it; a larger model.rotary_base "
            "or a model.rope_scaling often goes with it)"
            if mcfg.position_embedding == "rotary"
            else f"shorten the sequences (data.seq_length={mcfg.max_position_embeddings}; its positions are learned "
            "weights)"
        )
        raise UserError(
            f"data.seq_length {cfg.data.seq_length} exceeds the model's max_position_embeddings "
            f"{mcfg.max_position_embeddings}: {fix}"
        )
    return t.global_batch_size // per_step


def stand_in_source(cfg: RunConfig, newest: Path | None) -> Path | None:
    """Where model.init_from is gone and the run has a checkpoint to resume from (`newest`): that
    one, whose config then defines the model (its weights come from the resume, which fills all
    of them). None where init_from exists or is not set. A run without a checkpoint gets the
    missing folder's error, naming the key; so does a LoRA run, which reads its frozen base from
    init_from on every start."""
    from lmforge.models.io import missing_model_folder

    init_from = cfg.model.init_from
    if init_from is None or Path(init_from).exists():
        return None
    if newest is None:
        raise UserError(f"model.init_from: {missing_model_folder(init_from)}")
    if cfg.lora is not None:
        raise UserError(
            f"model.init_from: model folder '{init_from}' does not exist, and a LoRA run reads its "
            f"frozen base from it on every start (a resume too): restore it, or point model.init_from "
            f"at a copy of it"
        )
    log.info(
        "model.init_from '%s' no longer exists: resuming, the model is built as %s says and every weight read "
        "from the checkpoint",
        init_from,
        newest,
    )
    return newest


def tokenizer_copy(folder: Path | None) -> Path | None:
    """`folder` (a checkpoint) where it holds a copy of its run's tokenizer (an older lmforge's
    checkpoints hold none), else None."""
    from lmforge.tokenizers import find_tokenizer_file

    return folder if folder is not None and find_tokenizer_file(folder) is not None else None


def load_run_tokenizer(cfg: RunConfig, needed: bool, resume_copy: Path | None = None):
    """data.tokenizer, else the tokenizer beside model.init_from (an HF or lmforge folder);
    `needed` (fine-tuning tasks) makes a missing one an error. `resume_copy`: the copy in the
    checkpoint a resume starts from, read where the run's own source is gone (the same files, as
    the run read them)."""
    from lmforge.tokenizers import KINDS_HINT, load_tokenizer

    init_from = cfg.model.init_from
    named = cfg.data.tokenizer or init_from
    if resume_copy is not None and named is not None and not Path(named).exists():
        log.info(
            "%s '%s' no longer exists: reading the copy of the run's tokenizer in %s",
            "data.tokenizer" if cfg.data.tokenizer else "model.init_from",
            named,
            resume_copy,
        )
        return load_tokenizer(resume_copy)
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).exists():
        raise UserError(
            f"data.tokenizer: tokenizer path {cfg.data.tokenizer} does not exist: {KINDS_HINT}"
        )
    path = cfg.data.tokenizer or (tokenizer_folder(init_from) if init_from else None)
    if path is None:
        if needed and init_from:
            raise UserError(
                f"data.task={cfg.data.task} needs a tokenizer and the run of model.init_from "
                f"'{init_from}' names none: set data.tokenizer"
            )
        if needed:
            raise UserError(
                f"data.task={cfg.data.task} needs a tokenizer: set data.tokenizer or model.init_from"
            )
        return None
    if not needed and not cfg.data.tokenizer:
        # Pretraining on tokenized data needs none: a model folder saved without one is no error.
        try:
            return load_tokenizer(path)
        except UserError:
            log.info(
                "no tokenizer beside model.init_from '%s': pretraining on tokenized data needs none",
                path,
            )
            return None
    tokenizer = load_tokenizer(path)
    if cfg.data.tokenizer and init_from:
        warn_if_not_the_models(tokenizer, init_from)
    return tokenizer


PROBE = "The quick brown fox jumps over the lazy dog: 1,234 caf\u00e9s, na\u00efve \u4f60\u597d.\n"


def warn_if_not_the_models(tokenizer, init_from: str) -> None:
    """A warning when data.tokenizer reads text otherwise than model.init_from's own tokenizer:
    the model's embeddings mean that one's ids, and continued pretraining or fine-tuning with
    another throws their meaning away (sometimes the point: then the warning says what it is)."""
    from lmforge.tokenizers import load_tokenizer

    try:
        own_path = tokenizer_folder(init_from)
        own = load_tokenizer(own_path) if own_path is not None else None
    except UserError:  # the source has no tokenizer of its own: nothing to compare with
        return
    if own is None or [f.resolve() for f in own.files] == [f.resolve() for f in tokenizer.files]:
        return
    if own.vocab_size != tokenizer.vocab_size or own.encode(PROBE) != tokenizer.encode(PROBE):
        log.warning(
            "data.tokenizer %s is not the tokenizer of model.init_from %s (%d ids against %d; they read the "
            "same text as other ids): the model's embeddings were trained on the latter's; leave "
            "data.tokenizer unset to use it",
            tokenizer.files[0],
            own.files[0],
            tokenizer.vocab_size,
            own.vocab_size,
        )


def check_tokenizer(tok, mcfg: ModelConfig, from_scratch: bool = False) -> None:
    if tok is not None and tok.vocab_size > mcfg.vocab_size:
        raise UserError(
            f"the tokenizer at '{tok.files[0].parent}' has {tok.vocab_size} ids but the model only "
            f"{mcfg.vocab_size}: use the model's tokenizer or a model with a larger vocab_size"
        )
    if tok is not None and from_scratch:
        fitted = dataclasses.replace(mcfg, vocab_size=tok.vocab_size)
        unused = mcfg.padded_vocab_size - fitted.padded_vocab_size
        # a preset's vocabulary (Pythia's 50,304) over a smaller tokenizer (a 4,096-token
        # one)
        if unused > 0:
            log.warning(
                "the model has %d vocabulary rows for a tokenizer of %d ids: %d rows are never used; set "
                "model.vocab_size=%d (Megatron sizes the vocabulary from its tokenizer)",
                mcfg.padded_vocab_size,
                tok.vocab_size,
                unused,
                tok.vocab_size,
            )


def use_compile_cache(path: Path) -> bool:
    """Point Inductor's on-disk caches at `path`: `lmforge compile` fills it, the run that
    follows (same config, same path) loads compiled graphs instead of compiling them again.
    Whether it holds anything yet (an earlier run's or a compile job's graphs)."""
    filled = path.is_dir() and any(path.iterdir())
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return filled


def apply_activation_checkpointing(model: torch.nn.Module, mode: str = "full") -> None:
    """Recompute each block's activations in the backward pass instead of keeping them: all of
    them ("full": a block keeps only its inputs), or all but the outputs of its matrix products
    and attention ("selective": the norms, activations, rotary and residual adds are recomputed,
    cheap next to the matmuls they sit between, whose outputs are most of what "none" keeps once
    those are gone; so are products from a narrow input, see _keep_matmuls). "none" leaves the
    model as it is."""
    if mode == "none":
        return
    context_fn = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    kwargs = {"context_fn": context_fn} if mode == "selective" else {}
    for block in model.layers:
        forward = block.forward
        block.forward = lambda *args, _f=forward: checkpoint(
            _f, *args, use_reentrant=False, **kwargs
        )


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy: save what the matrix units computed, recompute the rest,
    and recompute the products of a narrow input too (a LoRA adapter's B, whose rank-r input
    makes a full-width output at 2r FLOPs an element: saved, each adapted linear kept two outputs
    of its width, its own and the adapter's)."""
    if op in _matmul_ops() and not _widening(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# A product whose inner dimension is at most 1/WIDENING of its output width costs little more to
# recompute than the elementwise ops selective checkpointing recomputes anyway, and saving it costs
# a full-width activation.
WIDENING = 8
# Where each matmul op takes its operands: (the left factor's index; its columns are the inner
# dimension), the right factor's index (its last dimension is the output width).
_FACTORS = {
    "mm": (0, 1),
    "bmm": (0, 1),
    "addmm": (1, 2),
    "baddbmm": (1, 2),
    "_grouped_mm": (0, 1),
    "_scaled_mm": (0, 1),
}


def _widening(op, args) -> bool:
    where = _FACTORS.get(op.__name__.split(".")[0])
    if where is None or len(args) <= max(where):
        return False
    a, b = args[where[0]], args[where[1]]
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and WIDENING * a.shape[-1] <= b.shape[-1]
    )


@functools.cache
def _matmul_ops() -> frozenset:
    """The aten ops of matrix products and fused attention that this torch has (names vary by
    version/device)."""
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    return frozenset(
        getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)
    )


def memory_gb(device: torch.device) -> float:
    allocated = max_memory_allocated(device)
    if allocated is not None:
        return allocated / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
