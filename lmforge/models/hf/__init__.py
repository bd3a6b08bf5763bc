"""Hugging Face checkpoints in and out, one small adapter per family."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lmforge.config import checked, closest
from lmforge.errors import UserError
from lmforge.fsutil import atomic_dir, folder_file
from lmforge.models.build import build
from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    QKV_SEPARATE,
    SIDE_FILES,
    HFAdapter,
    export_tensors,
    import_tensors,
)
from lmforge.models.hf.bert import BertAdapter
from lmforge.models.hf.gemma2 import Gemma2Adapter
from lmforge.models.hf.gemma3 import Gemma3Adapter, Gemma3TextAdapter
from lmforge.models.hf.gpt2 import GPT2Adapter
from lmforge.models.hf.gpt_neox import GPTNeoXAdapter
from lmforge.models.hf.gptj import GPTJAdapter
from lmforge.models.hf.llama import LlamaAdapter
from lmforge.models.hf.mistral import MistralAdapter
from lmforge.models.hf.mixtral import MixtralAdapter
from lmforge.models.hf.olmo2 import Olmo2Adapter
from lmforge.models.hf.phi3 import Phi3Adapter
from lmforge.models.hf.qwen2 import Qwen2Adapter
from lmforge.models.hf.qwen3 import Qwen3Adapter
from lmforge.models.hf.qwen3_moe import Qwen3MoeAdapter
from lmforge.models.hf.tokenizer import write_tokenizer_files
from lmforge.models.hf.weights import HFWeights, Source
from lmforge.models.io import (
    copy_licenses,
    copy_side_files,
    is_model_dir,
    missing_model_folder,
    read_folder,
    with_special_ids,
    write_config,
    write_safetensors,
)
from lmforge.models.sizes import check_layer_count, check_weight_bytes

log = logging.getLogger(__name__)

ADAPTERS: dict[str, HFAdapter] = {
    a.model_type: a
    for a in (
        GPTNeoXAdapter(),
        LlamaAdapter(),
        GPT2Adapter(),
        GPTJAdapter(),
        BertAdapter(),
        Qwen2Adapter(),
        MistralAdapter(),
        Qwen3Adapter(),
        Olmo2Adapter(),
        Phi3Adapter(),
        Gemma2Adapter(),
        Gemma3TextAdapter(),
        Gemma3Adapter(),
        MixtralAdapter(),
        Qwen3MoeAdapter(),
    )
}


def adapter_for(model_type: str) -> HFAdapter:
    if model_type not in ADAPTERS:
        raise UserError(
            f"unsupported model_type '{model_type}'{closest(model_type, ADAPTERS)}: "
            f"lmforge converts {', '.join(ADAPTERS)}"
        )
    return ADAPTERS[model_type]


def hf_modules(cfg: ModelConfig) -> dict[str, tuple[str | tuple[str, ...], str]]:
    """lmforge module -> (its Hugging Face module name(s), the mapping kind): what a LoRA
    adapter's modules are called in PEFT's format (lmforge.models.peft)."""
    out = {}
    for ours, theirs, kind in adapter_for(cfg.family).mapping(cfg):
        if ours.endswith(".weight"):
            names = (
                tuple(t.removesuffix(".weight") for t in theirs)
                if isinstance(theirs, tuple)
                else theirs.removesuffix(".weight")
            )
            out[ours.removesuffix(".weight")] = (names, kind)
    return out


def hf_module_count(targets: dict[str, list[str]], qkv: tuple[str, ...], cfg: ModelConfig) -> int:
    """How many Hugging Face modules (PEFT's count) lmforge's LoRA targets {module: parts} adapt:
    Llama's q, k, v three where lmforge fuses them into one projection (parts named as in `qkv`),
    Phi-3's gate and up one where Hugging Face fuses them."""
    rows = hf_modules(cfg)
    names = set()
    for module, parts in targets.items():
        theirs, kind = rows[module]
        names.update(
            [n for n, p in zip(theirs, qkv) if p in parts] if kind == QKV_SEPARATE else [theirs]
        )
    return len(names)


def is_hf_dir(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir():
        raise missing_model_folder(folder)
    if not path.is_file():
        if (folder / "lmforge.json").is_file():
            raise UserError(
                f"'{folder}' is an lmforge model folder already (lmforge.json): use it as it is "
                "(model.init_from, generate, serve, eval), or export-hf it to a Hugging Face one"
            )
        raise UserError(f"no config.json in '{folder}': point at a Hugging Face model folder")
    try:
        hf = json.loads(folder_file(folder, path.name).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"'{path}' is not valid JSON ({e})") from None
    if not isinstance(hf, dict) or "model_type" not in hf:
        raise UserError(f"'{path}' has no model_type: it is not a transformers model config")
    check_integers(hf, path)
    return hf


# config.json's counts and sizes, as every family's transformers config names them (Gemma 3 nests
# its text model's under text_config), checked before an adapter reads them: those every model has
# are positive integers, the others integers or null where a family leaves them out; its nested
# sections are mappings.
POSITIVE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
)
INTEGER_KEYS = (
    "num_key_value_heads",
    "head_dim",
    "n_inner",
    "rotary_dim",
    "type_vocab_size",
    "sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "num_labels",
)
MAPPING_KEYS = ("text_config", "rope_scaling", "rope_parameters")
LAYER_KEYS = ("num_hidden_layers", "n_layer")


def check_integers(hf: dict, path: Path) -> None:
    """A UserError naming the first of config.json's sizes (at `path`) that is not what it must
    be (POSITIVE_KEYS, INTEGER_KEYS, MAPPING_KEYS), its value and what it must be."""

    def check(value, hint, key: str) -> None:
        try:
            checked(value, hint, key)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None

    for key in MAPPING_KEYS:
        if key in hf:
            check(hf[key], dict | None, key)
    for section, where in ((hf, ""), (hf.get("text_config") or {}, "text_config.")):
        for key in MAPPING_KEYS[1:]:
            if key in section:
                check(section[key], dict | None, f"{where}{key}")
        for key in INTEGER_KEYS:
            if key in section:
                check(section[key], int | None, f"{where}{key}")
        for key in POSITIVE_KEYS:
            if key in section:
                check(section[key], int, f"{where}{key}")
                if section[key] < 1:
                    raise UserError(
                        f"{path}: {where}{key}: expected a positive integer, got {section[key]}"
                    )


def hf_config(
    folder: Path,
    fits: Callable[[ModelConfig], None] | None = None,
) -> tuple[ModelConfig, HFAdapter, HFWeights]:
    """The ModelConfig of an HF folder, its family's adapter and its weights (not read yet), the
    sizes its config.json declares checked against them (lmforge.models.sizes) before anything is
    built: no more layers than the weights hold tensors, no more parameters than their files hold
    bytes; `fits(cfg)` first, where given (load_pretrained: the device's memory)."""
    hf = read_hf_config(folder)
    adapter = adapter_for(hf["model_type"])
    weights = HFWeights(folder)
    text = hf.get("text_config") or {}
    # before the adapter, which lists the layers (their kinds) in some families
    for key in LAYER_KEYS:
        check_layer_count(
            text.get(key, hf.get(key)), key, len(weights.keys()), folder / "config.json"
        )
    try:
        cfg = adapter.config_from_hf(hf, weights.keys())
    except KeyError as e:
        kind = hf["model_type"]
        raise UserError(
            f"config.json in '{folder}' lacks the field {e} that a {kind} config needs"
        ) from None
    if fits is not None:
        fits(cfg)
    check_weight_bytes(cfg, weights.nbytes(), folder)
    return cfg, adapter, weights


def hf_tensors(
    folder: Path,
    fits: Callable[[ModelConfig], None] | None = None,
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The ModelConfig of an HF folder (hf_config, `fits` as there) and a stream of its tensors in
    lmforge layout.

    When the stream ends, every checkpoint tensor must have been used or be known-ignorable:
    a leftover weight means the model has a part lmforge would silently drop.
    """
    cfg, adapter, weights = hf_config(folder, fits)
    model = build(cfg, device="meta")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    source = Source(weights, adapter.aliases)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        yield from import_tensors(adapter.mapping(cfg), cfg, shapes, model.vocab_parameters, source)
        left = [
            k
            for k in weights.keys()
            if k not in source.used and not any(p in k for p in adapter.ignorable)
        ]
        if left:
            raise UserError(
                f"checkpoint has {len(left)} tensor(s) a {cfg.family} model has no place for, first "
                f"'{left[0]}': this variant is not supported"
            )
        dropped = [k for k in weights.keys() if k not in source.used]
        if dropped:
            log.info("dropped %d unused checkpoint entries (e.g. %s)", len(dropped), dropped[0])

    return cfg, stream()


def import_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> ModelConfig:
    """Convert a Hugging Face folder into an lmforge model folder (written atomically)."""
    hf_dir = Path(hf_dir)
    cfg, tensors = hf_tensors(hf_dir)
    with atomic_dir(out_dir, overwrite) as tmp:
        write_safetensors(tensors, tmp, dtype)
        copy_side_files(hf_dir, tmp, SIDE_FILES)
        copy_licenses(hf_dir, tmp)
        write_config(tmp, cfg, source={"hf_dir": str(hf_dir.resolve()), "model_type": cfg.family})
    return cfg


def export_hf(
    model_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> dict:
    """Write an lmforge model folder as a Hugging Face folder transformers loads directly (a
    training checkpoint: lmforge.models.export.export_folder)."""
    model_dir = Path(model_dir)
    if not is_model_dir(model_dir):
        raise UserError(f"'{model_dir}' is not an lmforge model folder (no lmforge.json)")
    # The export holds the same tensors: about the folder's weight bytes (another dtype: unknown
    # until written).
    needed = (
        sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) if dtype is None else None
    )
    return write_hf(*read_folder(model_dir), model_dir, Path(out_dir), dtype, overwrite, needed)


def write_hf(
    cfg: ModelConfig,
    get,
    side_dir: Path,
    out_dir: Path,
    dtype: torch.dtype | None,
    overwrite: bool,
    needed: int | None,
) -> dict:
    """A Hugging Face folder from a model's config and its tensors by lmforge name (`get`), with
    the tokenizer and generation files found in `side_dir`, written atomically."""
    from lmforge.tokenizers import folder_tokenizer

    adapter = adapter_for(cfg.family)
    tokenizer = folder_tokenizer(side_dir)
    # bos/eos/pad as the exported tokenizer has them, not a preset's (Pythia's eos 0 is "!" to
    # GPT-2's vocabulary: transformers' generate stopped there); a classifier needs a pad id.
    if tokenizer is not None:
        cfg = with_special_ids(cfg, tokenizer)
    hf = adapter.config_to_hf(cfg)
    model = build(cfg, device="meta")
    floats: set[torch.dtype] = set()

    def noted(tensors):  # the dtypes written, for config.json
        for name, t in tensors:
            if t.is_floating_point():
                floats.add(dtype or t.dtype)
            yield name, t

    with atomic_dir(out_dir, overwrite, needed) as tmp:
        write_safetensors(
            noted(export_tensors(adapter.mapping(cfg), cfg, model.vocab_parameters, get)),
            tmp,
            dtype,
        )
        # what save_pretrained writes: transformers 4 and vLLM read an absent one as
        # float32
        if len(floats) == 1:
            # under both names: transformers 5 writes `dtype`, and releases before 4.56 read only
            # `torch_dtype`
            hf["dtype"] = hf["torch_dtype"] = str(floats.pop()).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        copy_side_files(side_dir, tmp, SIDE_FILES)
        copy_licenses(side_dir, tmp)
        own = sorted(side_dir.glob("*tokenizer.json"))
        if not (tmp / "tokenizer.json").exists() and len(own) == 1:
            # transformers never looks for a run's own name (GPT-NeoX's 20B_tokenizer.json): without
            # a tokenizer.json its AutoTokenizer loads an empty tokenizer and says nothing.
            shutil.copy2(folder_file(side_dir, own[0].name), tmp / "tokenizer.json")
        if tokenizer is not None:
            write_tokenizer_files(tokenizer, tmp, cfg.max_position_embeddings, cfg.pad_token_id)
    return hf


__all__ = [
    "ADAPTERS",
    "adapter_for",
    "export_hf",
    "hf_config",
    "hf_tensors",
    "import_hf",
    "is_hf_dir",
    "read_hf_config",
    "write_hf",
]
