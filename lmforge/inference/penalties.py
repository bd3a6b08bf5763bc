"""What the serving engine keeps per row of its batch for the settings that depend on a request's
tokens: repetition, frequency and presence penalties, logit_bias and min_tokens.

One tensor per kind over every row of the engine's cache (rows x vocab), allocated the first time a
request needs it, so each step applies every row's settings in a few tensor operations whatever mix
of requests is running. The order is vLLM's: logit_bias and the min_tokens mask first, then the
penalties, then temperature and the filters (sampling.py).

- repetition_penalty: CTRL's, as transformers' RepetitionPenaltyLogitsProcessor and vLLM apply it,
  over the tokens of the prompt and of the output: a positive score divided by it, a negative one
  multiplied.
- frequency_penalty, presence_penalty: OpenAI's, over the output tokens only: logits[j] -= c[j] *
  frequency_penalty + (c[j] > 0) * presence_penalty, c[j] the times j was generated.
- logit_bias: added to the scores of the ids named.
- min_tokens: the ids that would end the request (eos unless ignore_eos, its stop_token_ids) are
  -inf until it has generated that many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSettings:
    """A request's settings that this module applies."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ending_ids: tuple[int, ...] = ()  # the ids min_tokens masks

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or bool(self.frequency_penalty)
            or bool(self.presence_penalty)
        )


class RowPenalties:
    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.rows, self.vocab, self.device = rows, vocab, device
        self.counts: torch.Tensor | None = None  # (rows, vocab) int32: each output token's count
        self.prompt: torch.Tensor | None = None  # (rows, vocab) bool: the prompt's tokens
        self.bias: torch.Tensor | None = None  # (rows, vocab) float32
        self.ending: torch.Tensor | None = None  # (rows, vocab) bool: what min_tokens masks

    def _table(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if getattr(self, name) is None:
            setattr(self, name, torch.zeros(self.rows, self.vocab, dtype=dtype, device=self.device))
        return getattr(self, name)

    def admit(self, slot: int, prompt_ids: list[int], s: RowSettings) -> None:
        """Set row `slot` for a new request (what its previous one left is cleared)."""
        if s.penalized:
            self._table("counts", torch.int32)
            self._table("prompt", torch.bool)
        for t in (self.counts, self.prompt, self.bias, self.ending):
            if t is not None:
                t[slot].zero_()
        if s.repetition_penalty != 1.0:
            self.prompt[slot, torch.tensor(prompt_ids, device=self.device)] = True
        if s.logit_bias:
            ids = torch.tensor(list(s.logit_bias), device=self.device)
            values = torch.tensor(
                list(s.logit_bias.values()), dtype=torch.float32, device=self.device
            )
            self._table("bias", torch.float32)[slot, ids] = values
        if s.min_tokens and s.ending_ids:
            self._table("ending", torch.bool)[
                slot, torch.tensor(s.ending_ids, device=self.device)
            ] = True

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just chosen for rows `slots` (a NO_TOKEN, negative, counts nothing)."""
        if self.counts is not None:
            real = (tokens >= 0).to(torch.int32)
            self.counts.index_put_((slots, tokens.clamp(min=0)), real, accumulate=True)

    def apply(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        settings: list[RowSettings],
        generated: list[int],
    ) -> torch.Tensor:
        """fp32 logits (len(slots), vocab) with each row's settings applied; `generated`: its
        tokens so far."""
        biased = [bool(s.logit_bias) for s in settings]
        if any(biased):
            logits = logits + self.bias[slots]
        masked = [s.min_tokens > n and bool(s.ending_ids) for s, n in zip(settings, generated)]
        if any(masked):
            rows = torch.tensor(masked, device=logits.device)[:, None]
            logits = logits.masked_fill(self.ending[slots] & rows, float("-inf"))
        if not any(s.penalized for s in settings):
            return logits
        counts = self.counts[slots]
        repetition = [s.repetition_penalty for s in settings]
        if any(p != 1.0 for p in repetition):
            penalty = torch.tensor(repetition, dtype=torch.float32, device=logits.device)[:, None]
            seen = self.prompt[slots] | (counts > 0)
            penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(seen & (penalty != 1.0), penalized, logits)
        frequency = [s.frequency_penalty for s in settings]
        presence = [s.presence_penalty for s in settings]
        if any(frequency) or any(presence):
            f = torch.tensor(frequency, dtype=torch.float32, device=logits.device)[:, None]
            p = torch.tensor(presence, dtype=torch.float32, device=logits.device)[:, None]
            logits = logits - (counts * f + (counts > 0) * p)
        return logits
