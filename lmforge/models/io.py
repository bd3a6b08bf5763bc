"""lmforge model folders: lmforge.json (the ModelConfig) + safetensors shards + tokenizer files.

    OUT_DIR/lmforge.json          {"format": "lmforge-model", "version": 1, "model": {...}}
    OUT_DIR/model.safetensors     (or model-00001-of-0000N.safetensors + model.safetensors.index.json)
    OUT_DIR/tokenizer.json ...    copied from the source

Tensors are in lmforge's own layout (fused grouped qkv, rotary pairing, padded vocabulary). Reading
a model back, whatever folder it is in: lmforge.models.source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lmforge.config import from_dict, to_dict
from lmforge.errors import UserError
from lmforge.fsutil import folder_file, open_safetensors, read_weight_map
from lmforge.models.build import build
from lmforge.models.config import ModelConfig
from lmforge.models.rope import RotaryEmbedding
from lmforge.models.sizes import check_weight_bytes

log = logging.getLogger(__name__)

CONFIG_NAME = "lmforge.json"
FORMAT = "lmforge-model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}': choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write tensors as model.safetensors, or as HF-style numbered shards with an index once they
    pass max_shard_bytes, holding at most one shard in memory."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total, files = 0, 0, []

    def flush() -> None:
        name = f"shard-{len(files):05d}.safetensors"
        save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
        files.append((name, list(shards[-1])))
        shards[-1] = {}

    for name, t in tensors:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (folder / files[0][0]).rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, (name, keys) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (folder / name).rename(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(src: Path, dst: Path, names: Iterable[str]) -> None:
    for name in names:
        if (src / name).is_file():
            shutil.copy2(folder_file(src, name), dst / name)


# A model's license and notice files (Llama's LICENSE and USE_POLICY.md, an Apache NOTICE): their
# terms ask that they go with every copy and derivative, so imports, exports and adapters carry them
# from the folder they came from.
LICENSE_STEMS = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY", "COPYING")


def copy_licenses(src: str | Path | None, dst: Path) -> None:
    if src is None or not Path(src).is_dir():
        return
    for f in sorted(Path(src).iterdir()):
        if f.name.upper().startswith(LICENSE_STEMS) and f.is_file():
            shutil.copy2(folder_file(src, f.name), dst / f.name)


def copy_origin_files(origin: str | Path | None, dst: Path) -> None:
    """What a trained model keeps from the folder it started from
    (lmforge.models.source.model_origin): the license files, and the generation settings
    (sampling defaults, stop ids) its users expect of it."""
    copy_licenses(origin, dst)
    if origin is not None:
        copy_side_files(Path(origin), dst, ["generation_config.json"])


def write_config(folder: Path, cfg: ModelConfig, **extra) -> None:
    meta = {"format": FORMAT, "version": 1, "model": to_dict(cfg), **extra}
    (folder / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def is_model_dir(path: Path) -> bool:
    return (path / CONFIG_NAME).is_file()


def missing_model_folder(folder: str | Path) -> UserError:
    """ "model folder 'X' does not exist", naming the checkpoints beside it where X looks like
    one of a run's (RUN/checkpoints/step-N): a mistyped step is corrected from the message."""
    folder = Path(folder)
    message = f"model folder '{folder}' does not exist"
    parent = folder.parent
    steps = (
        sorted(
            p.name
            for p in parent.iterdir()
            if p.name.startswith("step-") and (p / "trainer.json").is_file()
        )
        if folder.name.startswith("step-") and parent.is_dir()
        else []
    )
    if steps:
        shown = ", ".join(steps[-5:])
        message += (
            f": {parent} holds {len(steps)} checkpoint{'s' * (len(steps) > 1)}, "
            f"{'the latest ' if len(steps) > 5 else ''}{shown}: give one of them"
        )
    return UserError(message)


def read_config(folder: Path) -> ModelConfig:
    try:
        meta = json.loads(folder_file(folder, CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read '{folder / CONFIG_NAME}': {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "model" not in meta:
        shown = meta.get("format") if isinstance(meta, dict) else None
        raise UserError(
            f"'{folder / CONFIG_NAME}' is not an lmforge model config (format={shown!r})"
        )
    return from_dict(ModelConfig, meta["model"], where="model.")


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (one model.safetensors, or shards and
    their index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return read_weight_map(index)
    single = folder / "model.safetensors"
    if not single.is_file():
        raise UserError(f"no model.safetensors in '{folder}': is it an lmforge model folder?")
    with open_safetensors(folder_file(folder, single.name)) as f:
        return dict.fromkeys(f.keys(), single)


def read_tensors(folder: Path) -> Callable[[str], torch.Tensor]:
    """name -> tensor over an lmforge folder's safetensors (single file or sharded); `.names`
    lists them."""
    where = safetensors_index(folder)
    handles: dict[Path, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise UserError(f"tensor '{name}' is missing from '{folder}': the folder is incomplete")
        path = where[name]
        if path not in handles:
            handles[path] = open_safetensors(path)
        return stored_layout(name, handles[path].get_tensor(name))

    get.names = list(where)  # type: ignore[attr-defined]
    get.nbytes = sum(p.stat().st_size for p in set(where.values()))  # type: ignore[attr-defined]
    return get


def read_folder(
    folder: Path,
    fits: Callable[[ModelConfig], None] | None = None,
) -> tuple[ModelConfig, Callable[[str], torch.Tensor]]:
    """An lmforge model folder's config and its tensors (read_tensors), the parameters its config
    declares checked against the bytes its files hold before anything is built
    (lmforge.models.sizes); `fits(cfg)` first, where given (load_pretrained: the device's
    memory)."""
    cfg = read_config(folder)
    if fits is not None:
        fits(cfg)
    get = read_tensors(folder)
    check_weight_bytes(cfg, get.nbytes, folder)
    return cfg, get


def stored_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor as this version lays it out: folders written before Experts.gate_up had its
    (experts, 2, inter, hidden) shape hold it as (experts, 2 * inter, hidden), the same values in
    the same order."""
    if name.endswith("experts.gate_up") and t.dim() == 3:
        return t.unflatten(1, (2, -1))
    return t


def materialize(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """A model whose parameters are filled from `tensors`, allocated once, in `dtype` (meta build
    + to_empty)."""
    model = build(cfg, device="meta")
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=device or "cpu")
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, t in tensors:
            if name not in params:
                raise UserError(f"checkpoint tensor '{name}' has no place in a {cfg.family} model")
            if params[name].shape != t.shape:
                raise UserError(
                    f"tensor '{name}' has shape {tuple(t.shape)}, the model expects "
                    f"{tuple(params[name].shape)}: the weights do not belong to this config"
                )
            params[name].copy_(t)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise UserError(
            f"checkpoint lacks {len(missing)} tensor(s), first '{missing[0]}': it is incomplete"
        )
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    return model.eval()


def save_model(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer_from: str | Path | None = None,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an in-memory model (plain, DDP or FSDP2) as an lmforge model folder, atomically."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lmforge.fsutil import atomic_dir
    from lmforge.tokenizers import load_tokenizer

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    cfg = getattr(model, "module", model).config
    tokenizer = load_tokenizer(tokenizer_from) if tokenizer_from is not None else None
    with atomic_dir(out_dir, overwrite) as tmp:
        write_safetensors(((name, t.detach().cpu()) for name, t in state.items()), tmp, dtype)
        write_config(tmp, cfg if tokenizer is None else with_special_ids(cfg, tokenizer))
        if tokenizer is not None:
            tokenizer.save(tmp)
    return Path(out_dir)


def with_special_ids(cfg: ModelConfig, tokenizer) -> ModelConfig:
    """`cfg` with the bos/eos/pad ids of the tokenizer the model reads
    (Tokenizer.model_special_ids)."""
    declared = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return dataclasses.replace(
        cfg, **tokenizer.model_special_ids(declared, classifier=cfg.num_labels > 0)
    )
