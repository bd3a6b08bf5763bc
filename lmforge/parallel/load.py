"""Weights into a model laid out over a DeviceMesh, without any rank building the whole model.

    model = meta_model(folder)                  # shapes only: nothing is allocated
    pm = parallelize(model, layout, mesh)       # pipeline split, DTensor plans and FSDP2 work on meta tensors
    stats = load_sharded(pm, folder)            # to_empty on the device, then each rank's own pieces

`load_sharded` allocates only this rank's shards (`to_empty`) and fills every parameter it holds
with just its local piece, the rows/columns that the DTensor placements give this rank (the same
arithmetic DCP uses for its chunks). Sources:

- an lmforge model folder: each local piece is read with safetensors' `get_slice`, so a rank copies
  out only its own rows and columns;
- a Hugging Face folder: the adapter's conversion (q/k/v fused, rotary rows permuted, vocabulary
  padded) streams one full tensor at a time, restricted to the tensors this rank holds (a pipeline
  rank reads no other stage's layers); each is cut to the local piece and dropped;
- a training checkpoint (DCP): dcp.load into the local shards reads only the overlapping chunks.

A LoRA-wrapped meta model (lmforge.train.lora.apply_run_lora) gets its base filled here; its
adapters, in no source, are drawn after (lmforge.models.lora.init_adapters).

Peak memory per rank: its shards plus one source tensor and the copy its conversion makes
(safetensors maps files: what a rank touches of them is page cache, shared by the ranks of a node).
A tied embedding's copy on the last pipeline stage is read like the first stage's, so both hold the
same values, as when every rank built the same model. Non-persistent buffers (rotary frequencies)
come from the config and are recomputed after `to_empty`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.errors import UserError
from lmforge.fsutil import open_safetensors
from lmforge.models.build import build, init_weights, local_piece, materialize_meta
from lmforge.models.config import ModelConfig
from lmforge.models.io import is_model_dir, read_config, safetensors_index, stored_layout
from lmforge.models.lora import is_adapter
from lmforge.models.nf4 import check_shardable, is_nf4, log_quantized, nf4_weights, to_nf4_parameter
from lmforge.models.source import RUN_OVERRIDES, is_checkpoint, load_checkpoint_model, source_config

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass
class LoadStats:
    """What one rank did: the bytes of its shards (parameters and buffers), the bytes it read
    from the source (None: not counted, DCP), the size of the source's weight files (what a
    whole-model load reads on every rank)."""

    local_bytes: int
    read_bytes: int | None
    source_bytes: int


def meta_model(folder: str | Path) -> nn.Module:
    """The model of an lmforge or Hugging Face folder on the meta device (weights: load_sharded)."""
    return build(source_config(folder), device="meta")


def load_sharded(pm, source: str | Path) -> LoadStats:
    """Allocate `pm`'s parts (a ParallelModel of a meta-built model) on its device and fill this
    rank's pieces from `source`: an lmforge model folder, a Hugging Face folder or a training
    checkpoint."""
    source = Path(source)
    cfg: ModelConfig = pm.parts[0].config
    for part in pm.parts:
        materialize_meta(part, pm.device)
    # No source holds LoRA's adapters; QLoRA's NF4 weights were read before the layout
    # (read_nf4_base).
    targets = {n: t for n, t in local_tensors(pm).items() if not is_adapter(n) and not is_nf4(t)}
    with torch.no_grad():
        if is_checkpoint(source):
            read, total = _from_checkpoint(pm, source), _files_bytes(source, "*.distcp")
        elif is_model_dir(source):
            read, total = _from_lmforge(source, cfg, targets)
        else:
            read, total = _from_hf(source, cfg, targets)
        _recompute_buffers(pm)
    stats = LoadStats(allocated_bytes(pm), read, total)
    log.info(
        "loaded this rank's shards from %s: holds %.1f MiB, read %s of %.1f MiB",
        source,
        stats.local_bytes / MiB,
        "(DCP)" if read is None else f"{read / MiB:.1f} MiB",
        total / MiB,
    )
    return stats


def read_nf4_base(
    model: nn.Module, source: str | Path, device: torch.device, shards: int = 1
) -> int:
    """QLoRA's base (lora.base_dtype=nf4) for a model still on the meta device (LoRA-wrapped or
    not): each weight NF4 quantizes (lmforge.models.nf4.nf4_weights) is read whole from `source`, an
    lmforge or Hugging Face folder, in bf16 on `device`, one block's weights at a time, and
    quantized there. The rest of the model stays on the meta device for load_sharded, which keeps
    these. Called before the model is laid out, so that FSDP2 shards the NF4 weights themselves
    (torchao's NF4 tensor implements FSDP2's all-gather): a rank then holds its shards of the NF4
    base, never the base in bf16. Peak while reading: the NF4 weights plus one block's in bf16.
    Returns the bytes read. `shards`: the FSDP2 ranks that will shard it (a UserError first where a
    weight cannot be split so).
    """
    source = Path(source)
    cfg: ModelConfig = model.config
    quantized, kept = nf4_weights(model)
    check_shardable(quantized, shards)
    blocks: dict[str, list[str]] = {}
    for name in quantized:  # "layers.3.attention.qkv.weight" -> "layers.3"
        blocks.setdefault(re.match(r"(.*?layers\.\d+)\.", name).group(1), []).append(name)
    read = 0
    with torch.no_grad():
        for names in blocks.values():
            targets = {
                n: torch.empty(getattr(*quantized[n]).shape, dtype=torch.bfloat16, device=device)
                for n in names
            }
            read += (_from_lmforge if is_model_dir(source) else _from_hf)(source, cfg, targets)[0]
            for n in names:
                setattr(*quantized[n], to_nf4_parameter(targets.pop(n)))
    log_quantized(quantized, kept)
    return read


def init_sharded(pm, seed: int) -> int:
    """Allocate `pm`'s parts (a ParallelModel of a meta-built model) on its device and initialise
    the pieces this rank holds, as build(config, seed=seed) initialises the whole model: each
    weight is drawn whole on the CPU, one at a time, from its own generator
    (lmforge.models.build.init_weights), and this rank keeps its rows and columns. Peak memory:
    this rank's shards plus one whole weight. A LoRA-wrapped model's adapters are left to
    lmforge.models.lora.init_adapters. Returns the bytes this rank holds."""
    cfg: ModelConfig = pm.parts[0].config
    for part in pm.parts:
        part.to_empty(device=pm.device)
        init_weights(part, cfg, seed, skip=is_adapter)
    _recompute_buffers(pm)
    held = allocated_bytes(pm)
    log.info("initialised this rank's shards of a fresh model: %.1f MiB", held / MiB)
    return held


def materialize_empty(pm) -> None:
    """Allocate `pm`'s parts on its device, uninitialised (a fake-tensor trace, which reads no
    values)."""
    for part in pm.parts:
        materialize_meta(part, pm.device)


def local_tensors(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers under the model's names (DTensors where
    sharded)."""
    out: dict[str, torch.Tensor] = {}
    for part in pm.parts:
        out.update(part.named_parameters())
        for name, buf in part.named_buffers():
            owner, _, leaf = name.rpartition(".")
            if leaf not in part.get_submodule(owner)._non_persistent_buffers_set:
                out[name] = buf
    return out


def allocated_bytes(pm) -> int:
    """The bytes of this rank's parameters and buffers (local pieces of DTensors)."""
    seen: dict[int, torch.Tensor] = {}
    for part in pm.parts:
        for t in [*part.parameters(), *part.buffers()]:
            seen[id(t)] = t
    return sum(map(tensor_bytes, seen.values()))


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds on this rank: a DTensor's local piece; a wrapper tensor
    (torchao's NF4 weight, whose numel and dtype are the bf16 weight's) as the tensors it wraps."""
    t = _local(t)
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None:
        return sum(tensor_bytes(getattr(t, name)) for name in inner()[0])
    return t.numel() * t.element_size()


def local_box(t: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the global tensor that this rank's piece of `t` holds."""
    return local_piece(t)[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _check_config(source: ModelConfig, target: ModelConfig, where: Path) -> None:
    same = dataclasses.replace(source, **{k: getattr(target, k) for k in RUN_OVERRIDES})
    if same != target:
        diff = [
            f.name
            for f in dataclasses.fields(target)
            if getattr(same, f.name) != getattr(target, f.name)
        ]
        raise UserError(
            f"the model being loaded differs from '{where}' in {', '.join(diff)}: build it from the "
            "folder's own config (lmforge.parallel.load.meta_model)"
        )


def _files_bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def _missing(targets: dict[str, torch.Tensor], filled: set[str], where: Path) -> None:
    missing = sorted(set(targets) - filled)
    if missing:
        raise UserError(
            f"'{where}' lacks {len(missing)} tensor(s) of this model, first '{missing[0]}': it is "
            "incomplete"
        )


# --- lmforge model folders: slices straight from safetensors
# ---------------------------------------


def _from_lmforge(
    folder: Path, cfg: ModelConfig, targets: dict[str, torch.Tensor]
) -> tuple[int, int]:
    src_cfg = read_config(folder)
    _check_config(src_cfg, cfg, folder)
    where = safetensors_index(folder)
    known = build(cfg, device="meta")
    extra = sorted(set(where) - set(known.state_dict()))
    if extra:
        raise UserError(f"tensor '{extra[0]}' in '{folder}' has no place in a {cfg.family} model")
    vocab = set(known.vocab_parameters)
    handles: dict[Path, object] = {}
    read, filled = 0, set()
    for name, t in targets.items():
        if name not in where:
            continue
        if where[name] not in handles:
            handles[where[name]] = open_safetensors(where[name])
        piece = handles[where[name]].get_slice(name)
        shape = tuple(piece.get_shape())
        box, local = local_box(t), _local(t)
        if (
            len(shape) == t.dim() - 1
            and stored_layout(name, torch.empty(shape, device="meta")).shape == t.shape
        ):
            # an older folder's layout: read whole
            piece, shape = stored_layout(name, piece[:]), tuple(t.shape)
        # padded to another multiple: real rows, then zeros
        if name in vocab and shape[0] != t.shape[0]:
            if shape[0] < cfg.vocab_size or shape[1:] != tuple(t.shape[1:]):
                raise UserError(
                    f"tensor '{name}' has shape {shape} in '{folder}', the model expects "
                    f"{tuple(t.shape)}: the weights do not belong to this config"
                )
            rows = box[0]
            real = max(0, min(rows.stop, cfg.vocab_size) - rows.start)
            local[real:].zero_()
            box = (slice(rows.start, rows.start + real), *box[1:])
            local = local[:real]
        elif shape != tuple(t.shape):
            raise UserError(
                f"tensor '{name}' has shape {shape} in '{folder}', the model expects {tuple(t.shape)}: "
                "the weights do not belong to this config"
            )
        if local.numel():
            data = piece[box] if box else piece[:]
            local.copy_(data)
            read += data.numel() * data.element_size()
        filled.add(name)
    _missing(targets, filled, folder)
    return read, sum(p.stat().st_size for p in set(where.values()))


# --- Hugging Face folders: the converted stream, this rank's tensors only ------------------------


def _from_hf(folder: Path, cfg: ModelConfig, targets: dict[str, torch.Tensor]) -> tuple[int, int]:
    from lmforge.models.hf import adapter_for, read_hf_config
    from lmforge.models.hf.base import import_tensors
    from lmforge.models.hf.weights import HFWeights

    hf = read_hf_config(folder)
    adapter = adapter_for(hf["model_type"])
    weights = HFWeights(folder)
    _check_config(source_config(folder), cfg, folder)
    model = build(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    mapping = adapter.mapping(cfg)
    _check_unused(weights, mapping, adapter, cfg)
    source = _CountingSource(weights, adapter.aliases)
    filled = set()
    for row in mapping:
        if row[0] not in targets:  # another pipeline stage's: not even read
            continue
        # One row per call, the generator run out: a suspended one would hold the previous full
        # tensor while the next converts. The target config pads vocab rows to the run's multiple.
        [(name, full)] = list(import_tensors([row], cfg, shapes, model.vocab_parameters, source))
        target = targets[name]
        _local(target).copy_(full[local_box(target)])
        filled.add(name)
        del full
    _missing(targets, filled, folder)
    return source.read, _hf_files_bytes(folder)


def _hf_files_bytes(folder: Path) -> int:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            files = set(json.loads((folder / index).read_text())["weight_map"].values())
            return sum((folder / f).stat().st_size for f in files)
    single = folder / "model.safetensors"
    return (single if single.is_file() else folder / "pytorch_model.bin").stat().st_size


class _CountingSource:
    """lmforge.models.hf.weights.Source that counts the bytes it hands out."""

    def __init__(self, weights, aliases):
        from lmforge.models.hf.weights import Source

        self.source, self.read = Source(weights, aliases), 0

    def __call__(self, name: str, *shape: int) -> torch.Tensor:
        t = self.source(name, *shape)
        self.read += t.numel() * t.element_size()
        return t


def _check_unused(weights, mapping, adapter, cfg: ModelConfig) -> None:
    """What hf_tensors checks at the end of its stream, from the names alone (this rank reads
    only some): a checkpoint tensor the mapping has no place for means a part lmforge would
    silently drop."""
    used = set()
    for _, theirs, _ in mapping:
        for name in theirs if isinstance(theirs, tuple) else (theirs,):
            used.update(n for n in [name, *adapter.aliases(name)] if n in weights)
    left = [
        k for k in weights.keys() if k not in used and not any(p in k for p in adapter.ignorable)
    ]
    if left:
        raise UserError(
            f"checkpoint has {len(left)} tensor(s) a {cfg.family} model has no place for, first "
            f"'{left[0]}': this variant is not supported"
        )


# --- training checkpoints and buffers ------------------------------------------------------------


def _from_checkpoint(pm, folder: Path) -> None:
    from lmforge.parallel.state import load_model_state_dict, model_state_dict

    state = model_state_dict(pm)
    # A LoRA-wrapped model's adapters are no part of the source (init_adapters): DCP fills the
    # base's tensors in place.
    load_checkpoint_model({k: t for k, t in state.items() if not is_adapter(k)}, folder)
    load_model_state_dict(pm, state)


def _recompute_buffers(pm) -> None:
    """Non-persistent buffers are never in a source: recompute them (rotary inv_freq) from the
    config."""
    for part in pm.parts:
        for module in part.modules():
            if module._non_persistent_buffers_set:
                reset = getattr(module, "reset_parameters", None)
                if reset is None:
                    raise RuntimeError(
                        f"{type(module).__name__} has non-persistent buffers but no "
                        "reset_parameters() to recompute them after to_empty"
                    )
                reset()
