"""What a model config declares, counted before anything is built: its parameters and their bytes, a
KV cache's bytes, and whether they fit the device's memory (or the weight files they are to be read
from).

A config from elsewhere can declare any size: vocab_size 10**12 is an embedding of terabytes, 10**6
layers a build that runs for minutes, max_position_embeddings 10**12 a server's KV cache of
petabytes. Each is counted here in Python integers (no tensor: nothing overflows, nothing is
allocated) and refused in one line naming the sizes and the bytes before the model or the cache is
built. The counts are exact: tests compare them with every preset's built model and KVCache.nbytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
# What no stored format holds a parameter in less than: 4-bit weights. A config declaring more
# parameters than the weight files could hold at that is not theirs.
MIN_BITS_PER_PARAMETER = 4


def human_bytes(n: int) -> str:
    """'512.0 TiB', '3.2 GiB', '17 bytes'."""
    unit = 0
    value = float(n)
    while value >= 1024 and unit < len(UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{n} bytes" if unit == 0 else f"{value:.1f} {UNITS[unit]}"


def moe_layer_count(cfg: ModelConfig) -> int:
    """The layers whose MLP is a mixture of experts (ModelConfig.is_moe_layer), counted without a
    loop over them."""
    if not cfg.num_experts:
        return 0
    # listed: within the layers
    dense = sum(1 for i in set(cfg.dense_layers or ()) if (i + 1) % cfg.moe_every == 0)
    return cfg.num_layers // cfg.moe_every - dense


def _norm(cfg: ModelConfig, dim: int) -> int:
    # LayerNorm: weight and bias; RMSNorm: weight
    return dim * (2 if cfg.norm == "layernorm" else 1)


def block_parameters(cfg: ModelConfig, moe: bool = False) -> int:
    """One block's parameters (lmforge.models.layers.Block): attention, its q/k norms, the
    block's norms and its MLP (a dense one, or `moe`: the router and the stacked experts)."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = (h + 2 * kv) * hd
    attn = d * qkv + (qkv if cfg.qkv_bias else 0) + h * hd * d + (d if cfg.attention_bias else 0)
    if cfg.qk_norm == "head":
        attn += 2 * _norm(cfg, hd)
    elif cfg.qk_norm == "full":
        attn += _norm(cfg, h * hd) + _norm(cfg, kv * hd)
    inputs, outputs = cfg.norm_position != "output", cfg.norm_position in ("output", "sandwich")
    norms = (int(inputs) + int(inputs and not cfg.shared_norm) + 2 * int(outputs)) * _norm(cfg, d)
    if moe:
        return (
            attn + norms + d * cfg.num_experts + cfg.num_experts * 3 * d * cfg.moe_intermediate_size
        )
    f, gated = cfg.intermediate_size, cfg.gated_mlp
    mlp = d * f * (3 if gated else 2) + ((f * (2 if gated else 1) + d) if cfg.mlp_bias else 0)
    return attn + norms + mlp


def parameter_parts(cfg: ModelConfig, padded: bool = True) -> dict[str, int]:
    """The model's parameters by part: "embeddings" (vocabulary rows: the embedding, an untied
    head, BERT's MLM bias), "positions" (learned position and token-type embeddings), "blocks",
    "rest" (final norm, pooler, heads). `padded`: the vocabulary padded as the model holds it
    (make_vocab_size_divisible_by), else as a Hugging Face checkpoint stores it."""
    d = cfg.hidden_size
    vocab = cfg.padded_vocab_size if padded else cfg.vocab_size
    moe = moe_layer_count(cfg)
    blocks = (cfg.num_layers - moe) * block_parameters(cfg) + (
        moe * block_parameters(cfg, moe=True) if moe else 0
    )
    if cfg.family == "bert":
        mlm = cfg.num_labels == 0
        return {
            "embeddings": vocab * d + (vocab if mlm else 0),
            "positions": (cfg.max_position_embeddings + cfg.type_vocab_size) * d,
            "blocks": blocks,
            "rest": _norm(cfg, d)
            + (d * d + d if cfg.pooler else 0)
            + (d * d + d + _norm(cfg, d) if mlm else d * cfg.num_labels + cfg.num_labels),
        }
    head = not cfg.tie_embeddings and not cfg.num_labels
    return {
        "embeddings": vocab * d + (vocab * d + (vocab if cfg.lm_head_bias else 0) if head else 0),
        "positions": cfg.max_position_embeddings * d if cfg.position_embedding == "learned" else 0,
        "blocks": blocks,
        "rest": _norm(cfg, d) + d * cfg.num_labels,
    }


def parameter_count(cfg: ModelConfig, padded: bool = True) -> int:
    """The parameters of the model `cfg` builds (lmforge.models.build.num_parameters with the
    vocabulary padding counted; `padded` False: without it, as the published count)."""
    return sum(parameter_parts(cfg, padded).values())


def describe_parts(cfg: ModelConfig, parts: dict[str, int]) -> str:
    """The sizes behind the largest part, and its share: '(vocab_size 1000000000000 x hidden_size
    64: 100%)'."""
    total = max(sum(parts.values()), 1)
    largest = max(parts, key=parts.get)
    d = f"hidden_size {cfg.hidden_size}"
    named = {
        "embeddings": f"vocab_size {cfg.vocab_size} x {d}",
        "positions": f"max_position_embeddings {cfg.max_position_embeddings} x {d}",
        "blocks": f"num_layers {cfg.num_layers} x ({d}, intermediate_size {cfg.intermediate_size}"
        + (f", num_experts {cfg.num_experts}" if cfg.num_experts else "")
        + ")",
        "rest": f"{d}, num_labels {cfg.num_labels}",
    }[largest]
    return f"{named}: {100 * parts[largest] / total:.0f}% of them"


def free_memory(device: torch.device | str | None) -> tuple[int, str] | None:
    """(bytes free on `device`, its name) before anything more is allocated: a CUDA device's free
    memory plus what torch's allocator holds unused (torch.cuda.mem_get_info; an accelerator
    whose torch module has mem_get_info alike), the host's available RAM for the CPU
    (host_available); None where it cannot be told."""
    device = torch.device(device or "cpu")
    if device.type == "cpu":
        return host_available(), "the host"
    module = getattr(torch, device.type, None)
    if getattr(module, "mem_get_info", None) is None:
        return None
    try:
        free = int(module.mem_get_info(device)[0])
        if hasattr(module, "memory_reserved"):  # cached blocks the next allocation takes first
            free += int(module.memory_reserved(device) - module.memory_allocated(device))
    # no such device, no driver: the allocation says so itself
    except (RuntimeError, AssertionError, ValueError):
        return None
    return free, str(device)


def host_available() -> int:
    """The host's available RAM: /proc/meminfo's MemAvailable (free plus what the kernel can
    reclaim), else the physical memory (os.sysconf)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def element_size(dtype: torch.dtype | None) -> int:
    return (dtype or torch.float32).itemsize


def check_model_memory(
    cfg: ModelConfig,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    where: str | Path,
) -> None:
    """A UserError where the model `where` declares would not fit `device`'s free memory in
    `dtype` (float32 where None): its parameters, the sizes behind most of them, the bytes, what
    the device has."""
    parts = parameter_parts(cfg)
    n = sum(parts.values())
    need = n * element_size(dtype)
    free = free_memory(device)
    if free is None or need <= free[0]:
        return
    name = str(dtype or torch.float32).removeprefix("torch.")
    raise UserError(
        f"'{where}' declares a model of {n:,} parameters ({describe_parts(cfg, parts)}), "
        f"{human_bytes(need)} in {name}: more than the {human_bytes(free[0])} free on {free[1]}: check its "
        "config, or load it where there is the memory for it"
    )


def check_weight_bytes(cfg: ModelConfig, stored: int, where: str | Path) -> None:
    """A UserError where the weight files of `where` (`stored` bytes) are too small to hold the
    parameters its config declares, even at 4 bits each: the config does not belong to them (a
    mistake, or a config written to make lmforge build something huge)."""
    parts = parameter_parts(cfg, padded=False)
    n = sum(parts.values())
    if n * MIN_BITS_PER_PARAMETER // 8 <= stored:
        return
    raise UserError(
        f"'{where}' declares a model of {n:,} parameters ({describe_parts(cfg, parts)}) but its weight "
        f"files hold {human_bytes(stored)}, too few for them even at 4 bits each: the config does not "
        "belong to these weights: use the config written with them"
    )


def check_layer_count(layers: object, key: str, tensors: int, where: str | Path) -> None:
    """A UserError where a config declares more layers (`layers`, its `key`) than its weights
    hold tensors: every layer has tensors of its own. Asked before the config is read further,
    which lists its layers."""
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > tensors:
        raise UserError(
            f"'{where}' declares {key} {layers} but its weights hold {tensors} tensors in all, and every "
            "layer has its own: the config does not belong to these weights: use the config written with "
            "them"
        )


def kv_cache_bytes(
    cfg: ModelConfig,
    batch_size: int,
    max_len: int,
    dtype: torch.dtype | None = None,
    ring: bool = True,
) -> int:
    """Bytes of the key/value buffers of lmforge.inference.KVCache(cfg, batch_size, max_len,
    dtype, ring=ring) (its nbytes), counted without a loop over the layers where they all attend
    alike."""
    kinds = cfg.layer_types or [None]
    counts = {
        kind: (kinds.count(kind) if cfg.layer_types else cfg.num_layers) for kind in set(kinds)
    }
    slots = 0
    for kind, layers in counts.items():
        window = cfg.sliding_window if kind in (None, "sliding_attention") else None
        if window is not None and (window >= max_len or not ring):
            window = None  # a window covering the whole cache keeps every slot, as KVCache does
        slots += layers * (window or max_len)
    return 2 * batch_size * cfg.num_kv_heads * cfg.head_dim * slots * element_size(dtype)


def check_cache_memory(
    cfg: ModelConfig,
    batch_size: int,
    max_len: int,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    sized_by: str,
    fix: str,
    ring: bool = True,
) -> None:
    """A UserError where a KV cache of `batch_size` rows of `max_len` slots (`sized_by` says
    where that came from) would not fit `device`'s free memory; it ends with `fix`."""
    need = kv_cache_bytes(cfg, batch_size, max_len, dtype, ring)
    free = free_memory(device)
    if free is None or need <= free[0]:
        return
    name = str(dtype or torch.float32).removeprefix("torch.")
    raise UserError(
        f"the KV cache of {batch_size} row(s) x {max_len} tokens ({sized_by}) takes {human_bytes(need)} in "
        f"{name}: more than the {human_bytes(free[0])} free on {free[1]}: {fix}"
    )
