"""Where a model's weights come from: one reader for the three kinds of folder a user names.

    lmforge model folder   lmforge.json + model.safetensors (or shards + index)     `lmforge import-hf`
    Hugging Face folder    config.json + safetensors / pytorch_model.bin             converted on the fly
    training checkpoint    trainer.json + lmforge.json + DCP shards                  RUN_DIR/checkpoints/step-N

    source_config(folder)      the ModelConfig, reading no weights
    load_pretrained(folder)    the whole model (inference, a new head, a re-padded vocabulary)

The sharded reader, which fills only one rank's slices of a model laid out over a DeviceMesh, is
lmforge.parallel.load.load_sharded; it uses the same config, index and checkpoint functions here.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.fsutil import checksum_problems, folder_file
from lmforge.models.build import build
from lmforge.models.config import ModelConfig
from lmforge.models.hf import hf_config, hf_tensors, is_hf_dir
from lmforge.models.io import (
    CONFIG_NAME,
    is_model_dir,
    materialize,
    missing_model_folder,
    read_config,
    read_folder,
)
from lmforge.models.lora import LoRAConfig, apply_lora, is_adapter, merge_lora
from lmforge.models.peft import CONFIG as PEFT_CONFIG
from lmforge.models.sizes import check_model_memory, check_weight_bytes

# A rotary model's context: no weight depends on it, so a run may extend it (continued pretraining
# at a longer seq_length, with a larger rotary base or a rope_scaling, as Code Llama and Llama 3.1
# did); learned positions are weights and keep the source's (ModelSection.resolve).
CONTEXT_OVERRIDES = ("max_position_embeddings", "rotary_base", "rope_scaling")
# Model fields a run may change on top of its source's config: no weights depend on them (the
# vocabulary rows are re-padded on load).
RUN_OVERRIDES = (
    "dropout",
    "attention_dropout",
    "make_vocab_size_divisible_by",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    *CONTEXT_OVERRIDES,
)


@contextlib.contextmanager
def one_process_quietly():
    """DCP in one process (no process group: torch then takes no_dist=True itself): without its
    warning that it does, which every read of a checkpoint by export-hf, serve or eval printed
    (torch 2.6's wording lacks "disabled, "), nor torch 2.6's DCP warning that its own writer
    calls the deprecated TypedStorage."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized"
        )
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


# What to do instead of naming a PEFT adapter folder as a model, by what named it: a command that
# runs a model (generate, serve, eval: they take the adapter beside its base), or a training
# config's model.init_from (the default, as lmforge.train and lmforge.parallel.load read their
# source without saying what named it).
ADAPTER_FIXES = {
    "run": "pass its base model ({base}) and the adapter with --lora {folder}",
    "init_from": "point model.init_from at its base model ({base}); to train the adapter further, resume the run "
    "that wrote it",
}


def is_checkpoint(folder: Path) -> bool:
    return (Path(folder) / "trainer.json").is_file()


def source_kind(folder: str | Path, named_by: str = "init_from") -> str:
    """'checkpoint', 'lmforge' or 'hf'; a UserError for anything else (for a PEFT adapter, the
    fix ADAPTER_FIXES gives for what `named_by` names)."""
    folder = Path(folder)
    if folder.is_file():
        raise UserError(f"'{folder}' is a file: give the model folder that holds it")
    if not folder.is_dir():
        raise missing_model_folder(folder)
    if is_checkpoint(folder):
        return "checkpoint"
    if is_model_dir(folder):
        return "lmforge"
    if is_hf_dir(folder):
        return "hf"
    if (folder / PEFT_CONFIG).is_file():
        raise adapter_not_model(folder, named_by)
    inside = model_inside(folder)
    raise UserError(
        f"'{folder}' is neither an lmforge model folder ({CONFIG_NAME}), a Hugging Face one "
        "(config.json) nor a training checkpoint (trainer.json)"
        + (f": give '{inside}'" if inside else "")
    )


def adapter_not_model(folder: Path, named_by: str) -> UserError:
    """The error for a PEFT adapter folder named where a model goes: its base, as its
    adapter_config.json records it, and the fix for what named it (ADAPTER_FIXES)."""
    try:
        base = json.loads((folder / PEFT_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    shown = (
        base
        if isinstance(base, str) and base
        else f"the one it was trained on: its {PEFT_CONFIG} names none"
    )
    return UserError(
        f"'{folder}' is a PEFT adapter ({PEFT_CONFIG}), not a model: "
        + ADAPTER_FIXES[named_by].format(base=shown, folder=folder)
    )


def model_inside(folder: Path, hf: bool = True) -> Path | None:
    """What a user most likely meant by a folder that holds models (a run folder, its
    checkpoints/): its exported model, else its latest checkpoint, else any model one or two
    levels down (by name); `hf`: Hugging Face folders count."""

    def kind(p: Path) -> bool:
        return p.is_dir() and (is_checkpoint(p) or is_model_dir(p) or hf and is_hf_dir(p))

    for name in ("hf", "model") if hf else ("model",):
        if kind(folder / name):
            return folder / name
    for pattern in ("step-*", "checkpoints/step-*", "*", "*/*"):
        found = sorted(p for p in folder.glob(pattern) if kind(p))
        if found:
            return found[-1]
    return None


def source_config(folder: str | Path, named_by: str = "init_from") -> ModelConfig:
    """The ModelConfig of an lmforge folder, a Hugging Face folder or a training checkpoint,
    reading no weights (`named_by`: as source_kind's)."""
    folder = Path(folder)
    if source_kind(folder, named_by) != "hf":
        return read_config(folder)  # a checkpoint records its model config beside the shards
    return hf_config(folder)[0]


def tokenizer_folder(folder: str | Path) -> Path | None:
    """The folder a run's tokenizer comes from by default: an lmforge or HF source itself; for a
    training checkpoint (a new phase started from an earlier run's) the tokenizer that run used
    (run_tokenizer_source)."""
    return (
        run_tokenizer_source(Path(folder)) if source_kind(folder) == "checkpoint" else Path(folder)
    )


def _recorded_run(checkpoint: Path) -> dict:
    """The run config a checkpoint was written under: trainer.json's, else (older checkpoints)
    its run's config.yaml; {} where neither reads."""
    import yaml

    run = checkpoint_run(checkpoint)
    if run is None:
        config = Path(checkpoint).parent.parent / "config.yaml"  # RUN_DIR/checkpoints/step-N
        try:
            run = yaml.safe_load(config.read_text()) if config.is_file() else None
        except yaml.YAMLError:
            run = None
    return run if isinstance(run, dict) else {}


def _run_field(run: dict, section: str, key: str):
    value = (run.get(section) or {}).get(key)
    return value if isinstance(value, str) and value else None


def run_tokenizer_source(checkpoint: Path, _depth: int = 0) -> Path | None:
    """The tokenizer a training checkpoint's run used: the copy the checkpoint holds (an older
    lmforge's holds none), else its data.tokenizer, else that of model.init_from (an HF or
    lmforge folder; an earlier run's checkpoint: that run's tokenizer, followed back), else None."""
    from lmforge.tokenizers import find_tokenizer_file

    if find_tokenizer_file(checkpoint) is not None:
        return Path(checkpoint)
    run = _recorded_run(checkpoint)
    tokenizer, init_from = (
        _run_field(run, "data", "tokenizer"),
        _run_field(run, "model", "init_from"),
    )
    if tokenizer:
        return run_path(checkpoint, tokenizer)
    if not init_from:
        return None
    source = run_path(checkpoint, init_from)
    if _depth < 16 and source.is_dir() and is_checkpoint(source):
        return run_tokenizer_source(source, _depth + 1)
    return source


def model_origin(folder: str | Path | None) -> Path | None:
    """The Hugging Face or lmforge folder a model came from, for the files that go with it
    (license, generation settings): `folder` itself, or for a training checkpoint the folder its
    run started from, followed back through earlier runs' checkpoints; None for a run from
    scratch or a source no longer there."""
    if folder is None:
        return None
    folder = Path(folder)
    for _ in range(16):
        if not folder.is_dir():
            return None
        if not is_checkpoint(folder):
            return folder
        init_from = _run_field(_recorded_run(folder), "model", "init_from")
        if not init_from:
            return None
        folder = run_path(folder, init_from)
    return None


def generation_config(folder: str | Path | None) -> tuple[dict, Path | None]:
    """(the generation_config.json of the folder a model came from (model_origin), its path):
    ({}, None) where there is none, or ({}, path) where it does not read as a JSON object."""
    origin = model_origin(folder)
    path = origin / "generation_config.json" if origin is not None else None
    if path is None or not path.is_file():
        return {}, None
    try:
        config = json.loads(folder_file(origin, path.name).read_text())
    except (OSError, ValueError):
        return {}, path
    return (config if isinstance(config, dict) else {}), path


def run_path(checkpoint: str | Path, recorded: str) -> Path:
    """A path a training checkpoint's run config records (model.init_from, data.tokenizer), for a
    reader anywhere: a relative one is the run's, from the folder the run was started in
    (trainer.json's `working_dir`; for older checkpoints the folder a relative run_dir leads back
    to) where it is there, before one this reader's folder happens to hold; else as recorded."""
    path = Path(recorded)
    if path.is_absolute():
        return path
    base = run_working_dir(checkpoint)
    return base / path if base is not None and (base / path).exists() else path


def run_working_dir(checkpoint: str | Path) -> Path | None:
    """The folder a checkpoint's run was started in, where it can be told (see run_path)."""
    try:
        state = json.loads((Path(checkpoint) / "trainer.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    if isinstance(state.get("working_dir"), str):
        return Path(state["working_dir"])
    run_dir = (
        (state.get("run_config") or {}).get("run_dir")
        if isinstance(state.get("run_config"), dict)
        else None
    )
    if not isinstance(run_dir, str) or Path(run_dir).is_absolute():
        return None
    # RUN_DIR/checkpoints/step-N, RUN_DIR as the run spelled it
    parts = Path(os.path.normpath(run_dir)).parts
    root = Path(checkpoint).resolve().parent.parent
    if ".." in parts or root.parts[-len(parts) :] != parts:
        return None
    return Path(*root.parts[: -len(parts)])


def tokenizer_source(
    folder: str | Path, fix: str = "set data.tokenizer in the run's config.yaml"
) -> Path:
    """Where the tokenizer of a model folder is: the folder itself, or for a training checkpoint
    the one its run used (run_tokenizer_source); a UserError ending in `fix` for a checkpoint
    whose run names none."""
    folder = Path(folder)
    if source_kind(folder) != "checkpoint":
        return folder
    found = run_tokenizer_source(folder)
    if found is None:
        raise UserError(
            f"checkpoint '{folder}' has no tokenizer and its run's config.yaml names none: {fix}"
        )
    return found


def model_tokenizer(folder: str | Path, path: str | Path | None, fix: str):
    """The tokenizer to run a model folder with: `path` (a --tokenizer option), else the folder's
    own, else (a checkpoint) its run's; a folder without one (`import-hf` of a weights-only
    folder) is one line ending in `fix`."""
    from lmforge.tokenizers import find_tokenizer_file, load_tokenizer

    # first, --tokenizer or not: an adapter named as the model says so
    source_kind(folder, named_by="run")
    if path is not None:
        return load_tokenizer(path)
    source = tokenizer_source(folder, fix)
    if source.is_dir() and find_tokenizer_file(source) is None:
        raise UserError(
            f"no single tokenizer file found in {source}: {fix}, or copy the model's tokenizer files into "
            "that folder"
        )
    return load_tokenizer(source)


def checkpoint_run(folder: Path) -> dict | None:
    """The run config a training checkpoint was written under (trainer.json's `run_config`), None
    where it has none (checkpoints written before it carried one, an unreadable trainer.json)."""
    try:
        run = json.loads((Path(folder) / "trainer.json").read_text()).get("run_config")
    except (OSError, ValueError, AttributeError):
        run = None
    return run if isinstance(run, dict) else None


def checkpoint_lora(folder: Path) -> LoRAConfig | None:
    """The `lora:` section of a training checkpoint's run (its model then holds adapters beside
    the base), or None; a UserError for a checkpoint that holds adapters without it."""
    from lmforge.dcp_read import read_metadata

    section = (checkpoint_run(folder) or {}).get("lora")
    if section is not None:
        return LoRAConfig(**section)
    keys = read_metadata(folder).state_dict_metadata
    if any(k.startswith("model.") and is_adapter(k) for k in keys):
        raise UserError(
            f"checkpoint '{folder}' holds LoRA adapters but its trainer.json has no run config naming "
            "their lora: settings (an older lmforge wrote it): resume the run once with a newer lmforge"
        )
    return None


def checkpoint_dtype(folder: Path) -> torch.dtype | None:
    """The dtype a training checkpoint holds its model's weights in (bf16 under bf16-sr, else
    fp32); None when they are not all alike."""
    from lmforge.dcp_read import read_metadata

    meta = read_metadata(folder).state_dict_metadata
    dtypes = {
        m.properties.dtype
        for k, m in meta.items()
        if k.startswith("model.") and hasattr(m, "properties")
    }
    return dtypes.pop() if len(dtypes) == 1 else None


def load_checkpoint_model(state: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill `state` (a model state dict, DTensors where sharded) in place from a training
    checkpoint's model part: only the chunks overlapping each tensor are read. A checkpoint that
    does not fit is one UserError."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lmforge.dcp_read import load_state

    check_checkpoint_files(folder)
    try:
        with one_process_quietly():
            load_state({"model": state}, folder)
    except UserError:  # the checkpoint's contents refused (lmforge.dcp_read)
        raise
    # Across processes DCP gathers every rank's failure into a CheckpointException, a BaseException
    # (not an Exception); in one process the planner's own ValueError/RuntimeError comes through.
    except (Exception, CheckpointException) as e:
        raise UserError(
            f"checkpoint '{folder}' does not fit this model ({dcp_error_line(e)}): use the config it "
            "was written with"
        ) from None


def check_checkpoint_files(folder: Path) -> None:
    """A UserError naming the first file of a training checkpoint that does not match the
    checksums written with it (checkpoints written before checksums pass). The ranks read the
    files together."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = checksum_problems(folder, rank, world) or []
    if dist.is_initialized():
        shares: list = [None] * world
        dist.all_gather_object(shares, problems)
        problems = [p for share in shares for p in share]
    if problems:
        raise UserError(
            f"checkpoint '{folder}' is damaged: {problems[0]}: use another checkpoint of the run"
        )


def dcp_error_line(e: BaseException) -> str:
    """The line of a DCP failure worth showing (its last, cut to 300 characters)."""
    text = str(e).strip()
    return text.splitlines()[-1][:300] if text else type(e).__name__


def load_pretrained(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The whole model of an lmforge folder, a Hugging Face folder (converted on the fly) or a
    training checkpoint's weights, in eval mode; `folder` noted on it as `source_folder` (the
    base an adapter loaded onto it is compared with: lmforge.models.peft_read.load_peft_adapter)."""
    folder = Path(path)
    kind = source_kind(folder)

    def fits(cfg: ModelConfig) -> None:  # before anything is built
        check_model_memory(cfg, device, dtype, folder)

    if kind == "lmforge":
        cfg, get = read_folder(folder, fits)
        model = materialize(cfg, ((n, get(n)) for n in get.names), device, dtype)
    elif kind == "hf":
        cfg, tensors = hf_tensors(folder, fits)
        model = materialize(cfg, tensors, device, dtype)
    else:
        model = load_checkpoint_whole(folder, device)
        # a LoRA run's: served, evaluated or trained further merged
        if checkpoint_lora(folder) is not None:
            merge_lora(model)
        model = (model.to(dtype) if dtype is not None else model).eval()
    model.source_folder = folder
    return model


def load_checkpoint_whole(folder: Path, device: torch.device | str | None = None) -> nn.Module:
    """A training checkpoint's whole model as its run held it: a LoRA run's with its adapters
    (unmerged) around a base in the run's dtype (lora.base_dtype). A QLoRA run's checkpoint holds
    no NF4 weights: they are read from the run's model.init_from and quantized as the run
    quantized them (lmforge.parallel.load.read_nf4_base)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from lmforge.models.build import materialize_meta
    from lmforge.models.nf4 import is_nf4, quantize_nf4

    lora = checkpoint_lora(folder)
    cfg = read_config(folder)
    check_model_memory(cfg, device, checkpoint_dtype(folder), folder)  # before anything is built
    if lora is None or lora.base_dtype != "nf4":  # a QLoRA run's NF4 base is not in its checkpoints
        check_weight_bytes(cfg, sum(p.stat().st_size for p in folder.glob("*.distcp")), folder)
    model = build(cfg, device="meta")
    if lora is not None:  # as the run wrapped it, so the checkpoint's names have their places
        apply_lora(model, lora, quiet=True)  # a reader: the line is the training run's
    if lora is not None and lora.base_dtype == "nf4":
        base = ((checkpoint_run(folder) or {}).get("model") or {}).get("init_from")
        base = str(run_path(folder, base)) if base is not None else None
        if base is None:
            raise UserError(
                f"checkpoint '{folder}' is a QLoRA run's over a fresh base (no model.init_from): its NF4 "
                "weights are not in it, so it cannot be read whole; the run's own export "
                "(checkpoint.convert_to_hf=true) holds them"
            )
        if not Path(base).is_dir():
            raise UserError(
                f"checkpoint '{folder}' is a QLoRA run's: its NF4 base weights are not in it but read "
                f"from the run's model.init_from, {base!r}, which is not there: put that folder back "
                "where the run read it"
            )
        # Read whole in bf16 (one process), the same values the run read a block at a time,
        # quantized the same way.
        quantize_nf4(
            model, load_pretrained(base, dtype=torch.bfloat16).state_dict(), device or "cpu"
        )
    materialize_meta(model, device or "cpu")
    held = get_model_state_dict(model)
    state = {k: t for k, t in held.items() if not is_nf4(t)}
    load_checkpoint_model(state, folder)
    set_model_state_dict(model, state, options=StateDictOptions(strict=len(state) == len(held)))
    # non-persistent buffers (rotary frequencies) are not in the checkpoint
    for module in model.modules():
        if module._non_persistent_buffers_set and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model
