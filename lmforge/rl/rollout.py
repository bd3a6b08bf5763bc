"""Rollouts on lmforge's own decoder: num_generations completions per prompt, with the
log-probabilities of the sampled tokens, and the trainer-side recomputation of those
log-probabilities (one forward of prompt + completion).

Both score a token as TRL does: log_softmax(logits / temperature) at the sampled id, over the whole
vocabulary (top-k/top-p choose which tokens may be drawn, not the probabilities the loss uses).

The rollout decodes with the KV cache, one token per row per step (lmforge.inference.generate's
loop, the same sampling and the same random numbers); the recomputation runs the whole sequence at
once. In fp32 the two agree to a few units in the last place, not bit for bit: a decode step's
matrix products have one row per sequence (another kernel, another summation order, than a forward's
rows x length) and its attention reads a cache of another length. `completion_logps` is what the
loss takes as the old policy's log-probabilities: run under no_grad on the whole rollout it equals,
bit for bit, its value in the training step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.errors import UserError
from lmforge.inference.cache import KVCache
from lmforge.inference.decode_step import decode_step
from lmforge.inference.generate import check_can_generate, check_fits, left_pad
from lmforge.inference.sampling import (
    NO_TOKEN,
    SamplingParams,
    choose_next,
    no_token_reason,
    seeded_generator,
)
from lmforge.inference.text import eos_token_ids, token_ids


@dataclass
class Rollout:
    """A batch of completions, rows grouped by prompt (row i is a completion of prompt i //
    num_generations)."""

    prompt_ids: torch.Tensor  # (rows, prompt length), left-padded
    prompt_mask: torch.Tensor  # (rows, prompt length): 1 = token, 0 = padding
    completion_ids: torch.Tensor  # (rows, completion length), right-padded with pad_id
    # (rows, completion length): 1 on the generated tokens, a final stop token too
    completion_mask: torch.Tensor
    truncated: torch.Tensor  # (rows,) bool: reached max_completion_length without a stop token
    # (rows, completion length) fp32: the sampled tokens' log-probabilities, 0 on pad
    sampling_logps: torch.Tensor
    num_generations: int

    def completions(self) -> list[list[int]]:
        """Each row's generated ids (a final stop token kept), as TRL hands them to reward
        functions."""
        lengths = self.completion_mask.sum(-1).tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]

    def loss_mask(self, mask_truncated_completions: bool) -> torch.Tensor:
        return loss_mask(self.completion_mask, self.truncated, mask_truncated_completions)


def loss_mask(
    completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool
) -> torch.Tensor:
    """The tokens the loss counts: every generated one, or (mask_truncated_completions, DAPO)
    none of a truncated completion's, which was cut before it could be judged on its end."""
    return (
        completion_mask * (~truncated)[:, None].to(completion_mask.dtype)
        if mask_truncated
        else completion_mask
    )


@torch.no_grad()
def rollout(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    num_generations: int,
    max_completion_length: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
) -> Rollout:
    """Sample `num_generations` completions of each prompt (token ids) with the model as it is
    (its training weights: no copy). stop_token_ids None: the model config's eos. seed: a
    generator of its own, so a seeded rollout draws what lmforge.inference.generate draws for the
    same rows and seed."""
    check_can_generate(model, "roll out completions")
    if temperature <= 0:
        raise UserError(
            f"temperature must be > 0 for a rollout (its log-probabilities divide by it), got {temperature}"
        )
    if max_completion_length < 1:
        raise UserError(f"max_completion_length must be >= 1, got {max_completion_length}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("a rollout needs prompts of at least one token each")
    cfg = model.config
    pad_id = (
        pad_token_id
        if pad_token_id is not None
        else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    )
    device = next(model.parameters()).device
    rows = [list(p) for p in prompts for _ in range(num_generations)]
    ids, mask = left_pad(rows, pad_id, device)
    b, s = ids.shape
    check_fits(s, max_completion_length, cfg.max_position_embeddings, "max_completion_length")
    stops = sorted(eos_token_ids(model) if stop_token_ids is None else token_ids(stop_token_ids))
    stop = torch.tensor(stops, dtype=torch.long, device=device)
    params = SamplingParams(temperature, top_k or None, top_p, 1.0, True)
    generator = seeded_generator(seed, device)

    cache = KVCache.for_model(model, b, s + max_completion_length - 1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    h = model.hidden_states(
        ids, mask, position_ids, cache.view(slice(None), s), torch.arange(s, device=device)
    )
    logits = model.logits(h[:, -1])
    next_position, cache_position = position_ids[:, -1:] + 1, torch.tensor([s], device=device)
    out = torch.full((b, max_completion_length), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros(b, max_completion_length, dtype=torch.float32, device=device)
    live = torch.zeros(b, max_completion_length, dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(max_completion_length):
        token = choose_next(logits, params, None, generator)
        if bool((token == NO_TOKEN).any()):
            row = int((token == NO_TOKEN).nonzero()[0, 0])
            raise UserError(f"rollout row {row} stopped: {no_token_reason(logits[row])}")
        scored = (
            torch.log_softmax(logits.float() / temperature, dim=-1)
            .gather(-1, token[:, None])
            .squeeze(-1)
        )
        running = ~finished
        out[:, step] = torch.where(running, token, pad_id)
        logps[:, step] = torch.where(running, scored, 0.0)
        live[:, step] = running.long()
        finished = finished | torch.isin(token, stop)
        if step + 1 == max_completion_length or bool(finished.all()):
            break
        view = cache.view(slice(None), s + step + 1)
        logits = decode_step(model, view, out[:, step : step + 1], next_position, cache_position)
        next_position, cache_position = next_position + 1, cache_position + 1
    length = int(live.sum(-1).max())
    return Rollout(
        ids, mask, out[:, :length], live[:, :length], ~finished, logps[:, :length], num_generations
    )


def completion_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probabilities, entropies) of the completion tokens, (rows, completion length) fp32,
    from one forward of prompt + completion under `model` (with its gradient where grad is
    enabled): the trainer's recomputation. Positions count from each row's first real token, as
    in the rollout; padding scores 0."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    s, c = prompt_ids.shape[1], completion_ids.shape[1]
    logits = model(ids, attention_mask=mask, position_ids=position_ids)
    if isinstance(logits, DTensor):
        from lmforge.parallel.data_parallel import unwrap

        logits = full_logits(logits, unwrap(model).config.vocab_size)
    logits = logits[:, s - 1 : s + c - 1]
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, completion_ids[..., None]).squeeze(-1) * completion_mask
    entropy = None
    # a metric: no gradient, and no (rows, length, vocab) tensor kept for a backward
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1) * completion_mask
    return logps, entropy


def full_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocabulary-sharded logits (tensor parallelism with loss_parallel) gathered, with their
    gradient, and cut to the vocabulary (its padding rows are -inf there); others as they are:
    the scoring then reads what one process reads."""
    if not isinstance(logits, DTensor):
        return logits
    return logits.full_tensor()[..., :vocab_size]


def logprob_diff(
    sampling: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout's log-probabilities are from the trainer's on the generated tokens:
    mean and max |diff|."""
    diff = (sampling - trainer).abs()[mask.bool()]
    if not diff.numel():
        return {"logprob_diff/mean": 0.0, "logprob_diff/max": 0.0}
    return {"logprob_diff/mean": float(diff.mean()), "logprob_diff/max": float(diff.max())}
