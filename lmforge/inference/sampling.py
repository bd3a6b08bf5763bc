"""Choosing the next token: repetition penalty, temperature, top-k, top-p (nucleus), min-p, then
sample or argmax.

The steps and their order are those of transformers' `generate` (RepetitionPenaltyLogitsProcessor,
then TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper), so a seeded run
of ours and theirs filter the same tokens. Filtered logits become -inf, never a finite "small"
number.

Each row may have settings of its own (`RowSampling`: one tensor per setting, a value per row), so
the serving engine samples a batch of different requests in one call; a row computes the same
numbers in a batch as alone, and a row with a generator of its own draws from it alone, so a seeded
request's tokens do not depend on its batch.

Every row is safe on its own, whatever its settings or the model's scores, so that one request never
fails the rows sampled beside it: a temperature below SAMPLING_EPS decodes greedily (dividing by it
overflows fp32, and 1e-300 is 0 there); a NaN score counts as -inf; a row whose scores overflowed to
+inf (a repetition_penalty of 1e-40) is decided greedily, the limit of its distribution; a row with
no score left gets NO_TOKEN, for the caller to end it alone, instead of NaN probabilities that make
torch.multinomial raise for the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmforge.errors import UserError

# Temperatures below this decode greedily (vLLM's _SAMPLING_EPS): there the softmax is one-hot but
# for scores closer than ~1e-4, fp32's rounding of a logit in the hundreds; above it a logit up to
# 1e33 divides without overflow.
SAMPLING_EPS = 1e-5
NO_TOKEN = -1  # choose_next's token for a row with no score left (NaN or -inf everywhere)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) = greedy
    top_k: int | None = None  # None or 0 = off
    top_p: float | None = None  # None or 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in prompt + output
    do_sample: bool = True  # False = greedy, whatever the temperature
    # 0 = off; else tokens less likely than min_p x the most likely one's probability go
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):  # nan passes every comparison below
                raise UserError(f"{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise UserError(f"top_k must be >= 1 (or 0 for off), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise UserError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < SAMPLING_EPS


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def seeded_generator(
    seed: int | None, device: torch.device | str | None = None
) -> torch.Generator | None:
    """A generator of its own for reproducible sampling (None without a seed); a seed torch
    cannot take is a UserError, not the RuntimeError torch raises."""
    if seed is None:
        return None
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise UserError(f"seed {seed} is out of range: use an integer in [-2**63, 2**64)")
    return torch.Generator(device=device).manual_seed(seed)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL (Keskar et al. 2019), as transformers applies it: for tokens already seen, divide a
    positive logit by the penalty and multiply a negative one, so the token always gets less likely
    (penalty > 1).

    logits (batch, vocab); seen (batch, vocab) bool, True where the token is in the prompt or
    output.
    """
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def top_k_filter(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept too), -inf elsewhere."""
    if not k or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | None, min_keep: int = 1) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al. 2019): keep the smallest set of most likely tokens whose
    probability reaches p, and never fewer than min_keep (the most likely token always survives).

    Sorted ascending, a token goes when the probability mass at or below it is <= 1 - p: the same
    sums as transformers' TopPLogitsWarper, so the kept sets agree to the last rounding.
    """
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= 1 - p
    remove_sorted[..., -min_keep:] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


@dataclass
class RowSampling:
    """The sampling settings of a batch, a value per row: what one call of choose_rows applies.

    A greedy row gets temperature 1 and no filter: its token is the argmax of its scores as they
    come in. The top-p cut 1 - p is taken in float64 and then rounded, as a Python float compared
    with a float32 tensor is.
    """

    greedy: torch.Tensor  # (batch,) bool
    temperature: torch.Tensor  # (batch,) float32
    top_k: torch.Tensor  # (batch,) long, 0 = off
    # (batch,) float32: a token goes where the mass at or below it is <= this; -1 = off
    top_p_cut: torch.Tensor
    min_p: torch.Tensor  # (batch,) float32, 0 = off
    sampled: bool  # any row samples
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # the settings the rows came from (which rows sample, known on the host)
    params: tuple[SamplingParams, ...]

    @classmethod
    def of(
        cls, params: list[SamplingParams], device: torch.device | str | None = None
    ) -> RowSampling:
        greedy = [p.greedy for p in params]
        top_k = [0 if g or not p.top_k else p.top_k for p, g in zip(params, greedy)]
        cut = [
            -1.0 if g or p.top_p is None or p.top_p >= 1.0 else 1 - p.top_p
            for p, g in zip(params, greedy)
        ]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p_cut=torch.tensor(cut, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            sampled=not all(greedy),
            any_top_k=any(top_k),
            any_top_p=any(c >= 0 for c in cut),
            any_min_p=any(min_p),
            params=tuple(params),
        )


def filter_rows(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of each row's own settings on fp32 logits (batch,
    vocab)."""
    logits = logits / rows.temperature[:, None]
    if rows.any_top_k:
        k = rows.top_k.clamp(max=logits.shape[-1])
        top = torch.topk(logits, int(k.max()), dim=-1).values
        kth = top.gather(-1, (k - 1).clamp(min=0)[:, None])  # ties with the k-th kept too
        logits = logits.masked_fill((logits < kth) & (k[:, None] > 0), float("-inf"))
    if rows.any_top_p:  # top_p_filter with a cut per row (a row that is off removes nothing)
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        remove_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= rows.top_p_cut[:, None]
        remove_sorted[..., -1:] = False
        logits = logits.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))
    # the most likely token always stays (min_p <= 1): min_tokens_to_keep=1 holds by itself
    if rows.any_min_p:
        probs = logits.softmax(dim=-1)
        floor = rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


Generators = torch.Generator | list[torch.Generator | None] | None


def _draw(probs: torch.Tensor, picked: list[bool], generators: Generators) -> torch.Tensor:
    """A token per row of `probs` (only the rows `picked` matter): one draw for the rows that
    share a generator (or use torch's), and one for each row that has its own, from that row
    alone."""
    if not isinstance(generators, list):
        return torch.multinomial(probs, 1, generator=generators).squeeze(-1)
    token = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    shared = [k for k, (g, on) in enumerate(zip(generators, picked)) if on and g is None]
    if shared:
        index = torch.tensor(shared, device=probs.device)
        token[index] = torch.multinomial(probs[index], 1).squeeze(-1)
    # a per-request generator draws for its row alone
    for k, (g, on) in enumerate(zip(generators, picked)):
        if on and g is not None:
            token[k] = torch.multinomial(probs[k : k + 1], 1, generator=g)[0, 0]
    return token


def choose_rows(
    logits: torch.Tensor, rows: RowSampling, generators: Generators = None
) -> torch.Tensor:
    """Next token ids (batch,) from logits (batch, vocab) already penalized, each row by its own
    settings; NO_TOKEN for a row with no score left. `generators`: one for the whole batch, or one
    (or None) per row.

    No row can make the call raise (the module's docstring says how each is made safe), and no host
    sync is added: healthy rows draw exactly the numbers they draw without the guards.
    """
    logits = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    peak, best = logits.max(dim=-1)  # best: the first index of the largest score, as argmax
    token = best
    if rows.sampled:
        filtered = filter_rows(logits, rows)
        top, top_best = filtered.max(dim=-1)
        probs = filtered.softmax(dim=-1)
        # Where the peak is +inf or -inf the softmax is NaN: that row's probability goes to its best
        # token instead.
        broken = ~top.isfinite()
        probs = probs.nan_to_num(nan=0.0).scatter_add_(
            -1, top_best[:, None], broken[:, None].to(probs.dtype)
        )
        picked = [not p.greedy for p in rows.params]  # known on the host: no device sync
        token = torch.where(rows.greedy, best, _draw(probs, picked, generators))
    return torch.where(peak > -math.inf, token, NO_TOKEN)


def process_logits(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalty, temperature, top-k, top-p, min-p on fp32 logits (batch, vocab); greedy applies only
    the penalty.

    A NaN logit (a broken or overflowing model's) becomes -inf first: never chosen, and no NaN
    reaches the sums.
    """
    logits = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    return filter_rows(logits, RowSampling.of([params] * logits.shape[0], logits.device))


def choose_next(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (batch,) from the last position's logits (batch, vocab), every row with the
    same settings (and `seen`, the tokens the repetition penalty counts); NO_TOKEN for a row with
    no score left."""
    logits = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return choose_rows(logits, RowSampling.of([params] * logits.shape[0], logits.device), generator)


def model_scores_broken(logits: torch.Tensor) -> bool:
    """Whether a row of raw logits (vocab,) has no usable score of its own (NaN or -inf
    everywhere)."""
    return not bool((logits.float().nan_to_num(nan=-math.inf) > -math.inf).any())


def no_token_reason(logits: torch.Tensor) -> str:
    """Why choose_next found no token in a row of raw logits (vocab,): the model's scores, or the
    settings."""
    if model_scores_broken(logits):
        return (
            "the model's scores for the next token are NaN or -inf for every token: its weights are broken or "
            "overflow their dtype (try float32)"
        )
    return (
        "its sampling settings (repetition_penalty, logit_bias, min_tokens) took every token's score to -inf: "
        "use a repetition_penalty closer to 1 or fewer masked tokens"
    )
