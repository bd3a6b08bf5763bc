"""The decode step `generate` runs once per new token, eager or through torch.compile.

Two compiled forms:

- "default" (generate(compile=True)): the step attends over the cache slots filled so far, a view
  whose length grows by one per token and is the graph's one symbolic size, so a single graph serves
  every step and reads no empty slot.
- "reduce-overhead" (and "max-autotune"), the modes that capture CUDA graphs: a graph replays fixed
  addresses and fixed shapes, so the step has none that changes from token to token. It attends over
  the whole preallocated cache (empty slots masked), the token, its position and its cache slot are
  tensors of fixed shape, and the step holds no Python branch on data and no host sync. The cache's
  buffers are marked static addresses (written in place by the graph, never copied in) and kept on
  the model between calls of the same batch size and cache length, so a later call replays the
  graphs already recorded instead of recording new ones (as gpt-fast's and transformers' static
  caches do). On the CPU the same mode compiles the same static graph with Inductor; CUDA graphs
  exist only on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.inference.cache import KVCache

MIN_COMPILED_SLOTS = 128  # the smallest cache under compile (see cache_slots)
COMPILED_GRAPHS = 64  # per process: models x batch sizes x cache sizes (torch's default limit is 8)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
STATIC_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that capture CUDA graphs
# the model attribute holding its static cache between calls
HELD_CACHE = "_lmforge_static_kv_cache"


def compile_mode(compile: bool | str | None) -> str | None:
    """generate's `compile` argument as a torch.compile mode: None (eager), True = "default", or
    a mode name."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "default"
    if compile not in COMPILE_MODES:
        raise UserError(
            f"compile must be True/False or one of {', '.join(COMPILE_MODES)}, got {compile!r}"
        )
    return compile


def check_static(model: nn.Module) -> None:
    """Raise UserError for a model whose decode step cannot have static shapes."""
    if getattr(model.config, "num_experts", 0):
        raise UserError(
            "a mixture-of-experts model cannot decode with compile='reduce-overhead': its experts take "
            "a data-dependent number of tokens each (a host sync per layer); use compile=True (--compile)"
        )


def cache_slots(needed: int, mode: str | None) -> int:
    """Cache length: exact in eager; compiled, a power of two (at least MIN_COMPILED_SLOTS),
    because the buffer's length is in the strides of every view of it, and, for the static step,
    in every shape: calls of different lengths share a graph, and a model/batch size needs at
    most a few."""
    return max(MIN_COMPILED_SLOTS, 1 << (needed - 1).bit_length()) if mode else needed


def static_cache(model: nn.Module, batch: int, slots: int) -> KVCache:
    """The model's static cache for this batch size and length, emptied: the one of the previous
    call when it fits (its addresses are those the recorded graphs write), else a new one, which
    the model then holds."""
    p = next(model.parameters())
    held = getattr(model, HELD_CACHE, None)
    if (
        held is not None
        and held.valid.shape == (batch, slots)
        and held.k[0].dtype == p.dtype
        and held.valid.device == p.device
    ):
        held.reset()
        return held
    cache = KVCache.for_model(model, batch, slots)
    for t in (
        *cache.k,
        *cache.v,
        cache.valid,
        *cache.ring_slots.values(),
        *cache.ring_real.values(),
    ):
        torch._dynamo.mark_static_address(t)
    # a plain attribute: not a submodule, not in the state dict
    object.__setattr__(model, HELD_CACHE, cache)
    return cache


def compiled_decode_step(mode: str):
    """decode_step under torch.compile in `mode`. Dynamo keeps the graphs of one function
    together and, past its recompile limit, fails under fullgraph=True: one process serving or
    testing several models and batch sizes needs more than the default 8, so the limit is raised
    (once) to COMPILED_GRAPHS."""
    config = torch._dynamo.config
    # (torch 2.6's name)
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < COMPILED_GRAPHS:
        setattr(config, name, COMPILED_GRAPHS)
    # two functions: a graph cache each
    step = static_decode_step if mode in STATIC_MODES else decode_step
    return torch.compile(
        step, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode
    )


def length_dynamic(view: KVCache) -> KVCache:
    """Mark the number of filled slots (grows by one per step) as a symbolic size for
    torch.compile, so one graph serves every step; everything else in the decode step has a fixed
    shape (a ring's slots included)."""
    for t, ring in zip((*view.k, *view.v), view.rings * 2, strict=True):
        if not ring:
            torch._dynamo.mark_dynamic(t, 2)
    torch._dynamo.mark_dynamic(view.valid, 1)
    return view


def decode_step(
    model: nn.Module,
    cache: KVCache,
    token: torch.Tensor,
    position_ids: torch.Tensor,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    """Logits (batch, vocab) after feeding one token per row: the function handed to torch.compile.

    What changes from step to step (token, position ids, cache slot) is a tensor of fixed shape.
    Compiled, norms, rotary, the attention mask and residuals fuse into a few kernels between the
    matmuls, where eager spends its per-op overhead.
    """
    h = model.hidden_states(token, None, position_ids, cache, cache_position)
    return model.logits(h[:, -1])


def static_decode_step(
    model: nn.Module,
    cache: KVCache,
    token: torch.Tensor,
    position_ids: torch.Tensor,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    """decode_step over the whole static cache: the function the CUDA-graph modes compile."""
    return decode_step(model, cache, token, position_ids, cache_position)
