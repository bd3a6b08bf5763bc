"""Autoregressive generation with a KV cache: prefill the prompts, then one token per step.

Prompts of different lengths are left-padded into one batch, with an attention mask and
position ids counted from each row's first real token (cumsum - 1), as transformers does, so a
row generates the same tokens alone or in a batch. A row stops at a stop token (eos), which it
keeps as its last token; generation ends when every row has stopped or after max_new_tokens.

    ids = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=20, temperature=0)   # greedy
    texts = generate_text(model, tokenizer, ["Once upon a time"], max_new_tokens=50, stop=["\\n\\n"])
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.inference.cache import KVCache
from lmforge.inference.decode_step import (
    STATIC_MODES,
    cache_slots,
    check_static,
    compile_mode,
    compiled_decode_step,
    decode_step,
    length_dynamic,
    static_cache,
)
from lmforge.inference.penalties import RowPenalties, RowSettings
from lmforge.inference.sampling import (
    NO_TOKEN,
    RowSampling,
    SamplingParams,
    choose_rows,
    no_token_reason,
    seeded_generator,
)
from lmforge.inference.text import TextStream, completion_text, eos_token_ids, token_ids
from lmforge.models.sizes import check_cache_memory

log = logging.getLogger(__name__)

Prompts = torch.Tensor | Sequence[Sequence[int]]
SYNC_EVERY = 8  # off CPU, decode steps between two checks of "have all rows stopped?" (a host sync)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
):
    """(input_ids, attention_mask), both (batch, longest), padding on the left."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, longest - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, longest - len(p) :] = 1
    return ids.to(device), mask.to(device)


def check_can_generate(model: nn.Module, what: str = "generate text") -> None:
    """Raise UserError unless the model is a decoder language model (one that predicts the next
    token)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not cfg.is_decoder or getattr(model, "score", None) is not None:
        kind = (
            "a sequence classifier (its head scores labels, not tokens)"
            if cfg is not None and cfg.num_labels
            else f"a {getattr(cfg, 'family', '?')} model (not a decoder language model)"
        )
        raise UserError(f"cannot {what} with {kind}: give a decoder language model")


def context_overflow(
    prompt_len: int, max_new_tokens: int | None, context: int, param: str = "max_new_tokens"
) -> str | None:
    """Why a prompt and max_new_tokens new tokens do not fit a context, or None when they do.

    The one rule of `generate`, the engine and the server (as OpenAI's API counts): the prompt and
    every new token fit the model's context, whatever its position embeddings. Past its positions a
    rotary model goes on without an error but not as trained, so it is refused rather than run or
    cut short unannounced. max_new_tokens None: the prompt must leave room for one token.
    """
    room, need = context - prompt_len, max(max_new_tokens or 1, 1)
    if room < 1:
        if need >= context:
            return (
                f"this model's context is {context} tokens and the prompt has {prompt_len}: lower {param} below "
                f"{context} and shorten the prompt to fit beside it"
            )
        return (
            f"this model's context is {context} tokens and the prompt has {prompt_len}: shorten the prompt "
            f"to at most {context - need} tokens"
            + (f" (with {param} {need})" if max_new_tokens else "")
        )
    if max_new_tokens is not None and max_new_tokens > room:
        return (
            f"this model's context is {context} tokens: the prompt's {prompt_len} and {max_new_tokens} new "
            f"ones do not fit; lower {param} to at most {room} or shorten the prompt"
        )
    return None


def check_fits(
    prompt_len: int, max_new_tokens: int | None, context: int, param: str = "max_new_tokens"
) -> None:
    """Raise context_overflow's line as a UserError."""
    problem = context_overflow(prompt_len, max_new_tokens, context, param)
    if problem:
        raise UserError(problem)


def _batch(
    model: nn.Module, prompts: Prompts, attention_mask: torch.Tensor | None, pad_id: int | None
):
    device = next(model.parameters()).device
    if pad_id is None:
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if isinstance(prompts, torch.Tensor):
        ids = prompts[None] if prompts.dim() == 1 else prompts
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.reshape(ids.shape)
        ids, mask = ids.to(device), mask.to(device=device, dtype=torch.long)
        if not mask[:, -1].all():
            raise UserError(
                "attention_mask pads on the right: generation needs left padding (see left_pad)"
            )
    else:
        if not len(prompts):
            raise UserError("no prompts given: pass at least one")
        ids, mask = left_pad(prompts, pad_id, device)
    lengths = mask.sum(-1)
    if (lengths == 0).any():
        raise UserError(
            f"prompt {int((lengths == 0).nonzero()[0, 0])} is empty: give it at least one token"
        )
    vocab = model.config.vocab_size
    real = ids[mask.bool()]
    bad = real[(real < 0) | (real >= vocab)]
    if bad.numel():
        raise UserError(
            f"prompt token id {int(bad[0])} is outside this model's vocabulary [0, {vocab})"
        )
    return ids, mask, pad_id


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompts: Prompts,
    max_new_tokens: int = 32,
    *,
    temperature: float = 1.0,
    do_sample: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    stop_token_ids: int | Iterable[int] | None = None,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    compile: bool | str = False,
) -> list[list[int]]:
    """The generated ids of each prompt (prompt not included), a stop token ending a row kept last.

    prompts: a list of token id lists (left-padded here), or a (batch, seq) / (seq,) tensor, all
    real tokens unless attention_mask (1 = token, 0 = padding, left padding) says otherwise.
    temperature 0 or do_sample=False is greedy. The penalties are the serving engine's
    (lmforge.inference.penalties: repetition_penalty over prompt and output as transformers applies
    it, frequency_penalty and presence_penalty OpenAI's over the output), then temperature, top-k,
    top-p and min-p as a request's (sampling.choose_rows). stop_token_ids: None = the model config's eos; [] =
    never stop early. seed makes sampling reproducible (a torch.Generator of its own; without it the
    global RNG is used). should_stop(row, ids_so_far) is asked after each new token of a running row
    (stop strings in generate_text). compile=True (or "default") runs each decode step through
    torch.compile; compile="reduce-overhead" (or "max-autotune") compiles a static-shape step that
    CUDA graphs capture on CUDA (lmforge.inference.decode_step). The first call compiles (seconds to
    a minute), later calls with the same model, batch size and cache size (a power of two) reuse the
    graph; greedy tokens are those of eager. Under "reduce-overhead" the model holds its cache
    between calls: one such call at a time per model.
    """
    check_can_generate(model)
    mode = compile_mode(compile)
    static = mode in STATIC_MODES
    if static:
        check_static(model)
    params = SamplingParams(temperature, top_k, top_p, repetition_penalty, do_sample, min_p)
    for name, value in (
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        if not -2.0 <= value <= 2.0:  # OpenAI's range, as the server takes them
            raise UserError(f"{name} must be in [-2, 2] (0 = off), got {value}")
    settings = RowSettings(repetition_penalty, frequency_penalty, presence_penalty)
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids, mask, pad_id = _batch(model, prompts, attention_mask, pad_token_id)
    b, s = ids.shape
    cfg, device = model.config, ids.device
    if max_new_tokens == 0:
        return [[] for _ in range(b)]
    check_fits(s, max_new_tokens, cfg.max_position_embeddings)
    stop_ids = eos_token_ids(model) if stop_token_ids is None else token_ids(stop_token_ids)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    generator = seeded_generator(seed, device)
    rows = torch.arange(b, device=device)
    penalties = None
    if settings.penalized:  # each row's prompt tokens (padding excluded) and output counts
        penalties = RowPenalties(b, cfg.vocab_size, device)
        for row in range(b):
            penalties.admit(row, ids[row][mask[row].bool()].tolist(), settings)

    # The last generated token is never fed back, so the cache needs one slot less than the total.
    slots = cache_slots(s + max_new_tokens - 1, mode)
    check_cache_memory(
        cfg,
        b,
        slots,
        next(model.parameters()).dtype,
        device,
        "the prompt and max_new_tokens",
        "lower max_new_tokens",
    )
    cache = static_cache(model, b, slots) if static else KVCache.for_model(model, b, slots)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    # attend over the prompt's slots only, not the whole buffer
    prefill = cache.view(slice(None), s)
    h = model.hidden_states(ids, mask, position_ids, prefill, torch.arange(s, device=device))
    logits = model.logits(h[:, -1])
    next_position, cache_position = position_ids[:, -1:] + 1, torch.tensor([s], device=device)
    step_fn = compiled_decode_step(mode) if mode else decode_step
    reencode_at = _reencode_length(cfg)

    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    host = [[] for _ in range(b)] if should_stop is not None else None
    # Without stop tokens or strings every row runs to max_new_tokens: no stop bookkeeping at all.
    # Asking whether all rows have stopped waits for the device; on CPU that costs nothing (ops run
    # in order, at once), elsewhere it is asked every SYNC_EVERY steps (a few extra steps, trimmed
    # away, at most).
    watch = bool(stop.numel()) or host is not None
    check_every = 1 if device.type == "cpu" or host is not None else SYNC_EVERY
    steps, lost = 0, torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        scores = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        if penalties is not None:
            scores = penalties.apply(scores, rows, [settings] * b, [step] * b)
        token = choose_rows(scores, RowSampling.of([params] * b, device), generator)
        if watch:
            token = torch.where(finished, pad_id, token)  # a finished row keeps padding
        # A row with no score left (NO_TOKEN) stops, fed padding (never an id past the embedding),
        # and is reported when generation ends: no host sync here.
        lost_now = token == NO_TOKEN
        lost = lost | lost_now
        token = torch.where(lost_now, pad_id, token)
        out[:, step] = token
        steps = step + 1
        if penalties is not None:
            penalties.record(rows, token)
        if watch:
            running = ~finished
            finished = finished | torch.isin(token, stop) | lost_now
        if host is not None:
            was_running = running.tolist()
            for row, t in enumerate(token.tolist()):
                if was_running[row]:
                    host[row].append(t)
                    if not finished[row] and should_stop(row, host[row]):
                        finished[row] = True
        if steps == max_new_tokens or (watch and steps % check_every == 0 and bool(finished.all())):
            break
        # Attend over the filled slots only: at long contexts reading the keys/values costs as much
        # as the weights.
        view = cache.view(slice(None), s + steps)
        if s + steps == reencode_at:
            logits = _reencode(model, view, ids, mask, out[:, :steps])
            next_position, cache_position = next_position + 1, cache_position + 1
            continue
        start = time.perf_counter()
        if static:  # the whole cache: no shape changes from step to step (a CUDA graph replays it)
            torch.compiler.cudagraph_mark_step_begin()
            logits = step_fn(model, cache, token[:, None], next_position, cache_position)
        else:
            logits = step_fn(
                model,
                length_dynamic(view) if mode else view,
                token[:, None],
                next_position,
                cache_position,
            )
        if mode and step == 0:
            log.info(
                "first decode step (compiles it unless cached) took %.1f s",
                time.perf_counter() - start,
            )
        next_position, cache_position = next_position + 1, cache_position + 1
    if bool(lost.any()):  # the reason read from the row's last scores: a broken model's stay NaN
        row = int(lost.nonzero()[0, 0])
        raise UserError(f"generation of prompt {row} stopped: {no_token_reason(logits[row])}")
    return _trim(out[:, :steps].tolist(), stop.tolist(), host)


def _reencode_length(cfg) -> int | None:
    """The sequence length at which the cached keys must be rotated again: LongRoPE switches
    every position to its long factors once a forward reaches past the pretraining context, and
    keys cached with the short ones would no longer match (transformers' Phi-3 re-encodes the
    whole sequence at that step too)."""
    s = cfg.rope_scaling
    return (
        s.original_max_position_embeddings + 1 if s is not None and s.type == "longrope" else None
    )


def _reencode(
    model: nn.Module, cache: KVCache, ids: torch.Tensor, mask: torch.Tensor, new: torch.Tensor
) -> torch.Tensor:
    """Prefill the prompts and the tokens generated so far again, over the same cache slots; the
    last logits."""
    full = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    h = model.hidden_states(
        full, full_mask, position_ids, cache, torch.arange(full.shape[1], device=full.device)
    )
    return model.logits(h[:, -1])


def _trim(rows: list[list[int]], stop: list[int], host: list[list[int]] | None) -> list[list[int]]:
    """Each row up to and including its first stop token (or as far as should_stop let it run)."""
    if host is not None:
        return host
    stops, result = set(stop), []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        result.append(row[:end])
    return result


def generate_text(
    model: nn.Module,
    tokenizer,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    *,
    stop: str | Sequence[str] | None = None,
    add_bos: bool | None = None,
    stop_token_ids: int | Iterable[int] | None = None,
    skip_special_tokens: bool = True,
    **kwargs,
) -> list[str]:
    """Completions (prompt not included) of text prompts, or of prompts already token ids (a chat
    template's); keyword arguments as for generate.

    Generation of a row stops at eos (the model's and the tokenizer's) or once its text contains a
    stop string, and the text is cut before the first stop string (as OpenAI's API does). add_bos
    None: the tokenizer's rule (Tokenizer.add_bos_token: Llama's <s> yes, GPT-2 and NeoX no).
    Special tokens are left out of the text unless `skip_special_tokens` is off
    (lmforge.inference.text).
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    if all(isinstance(p, str) for p in prompts):
        encoded = tokenizer.encode_batch(
            prompts, add_bos=tokenizer.add_bos_token if add_bos is None else add_bos
        )
    else:
        encoded = [list(p) for p in prompts]
    stop_ids = (
        eos_token_ids(model, tokenizer) if stop_token_ids is None else token_ids(stop_token_ids)
    )
    streams = [TextStream(tokenizer, ids, stops, skip_special_tokens) for ids in encoded]

    def has_stop(row: int, ids: list[int]) -> bool:
        stream, stopped = streams[row], False
        for token in ids[len(stream.ids) :]:
            stopped = stream.push(token)[1] or stopped
        return stopped

    outputs = generate(
        model,
        encoded,
        max_new_tokens,
        stop_token_ids=sorted(stop_ids),
        should_stop=has_stop if stops else None,
        **kwargs,
    )
    texts = []
    for prompt_ids, ids in zip(encoded, outputs):
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        text = completion_text(tokenizer, prompt_ids, ids, skip_special_tokens)
        cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
        texts.append(text[:cut])
    return texts
