"""Log-probabilities of chosen tokens and of the most likely ones, as the OpenAI API returns them.

They are the model's own distribution: the log-softmax of its raw logits, before temperature,
penalties, logit_bias or any filter (vLLM's default, logprobs_mode "raw_logprobs"), so they score
text the same whatever a request's sampling settings, which is what an evaluator that sends `echo` +
`logprobs` needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the most alternatives a token gets (OpenAI's top_logprobs limit, vLLM's max_logprobs)
MAX_TOP_LOGPROBS = 20
# -inf has no JSON spelling: a token the model gives no probability at all reports this instead (as
# vLLM does).
FLOOR = -9999.0


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None  # None: a prompt's first token, which nothing scores
    # the most likely tokens at that position, most likely first
    top: list[tuple[int, float]] | None


def token_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, top: list[int]
) -> list[TokenLogprob]:
    """For each row of logits (rows, vocab): the chosen token's log-probability and the top[row]
    most likely ones.

    One log-softmax and one top-k for all rows, and one copy to the host.
    """
    logp = logits.float().log_softmax(dim=-1)
    picked = logp.gather(-1, chosen.clamp(min=0)[:, None])[:, 0]
    k = min(max(top, default=0), logp.shape[-1])
    values, ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], chosen[:, None][:, :0])
    picked, values, ids = (
        picked.clamp(min=FLOOR).tolist(),
        values.clamp(min=FLOOR).tolist(),
        ids.tolist(),
    )
    return [
        TokenLogprob(t, p, list(zip(i[:n], v[:n])))
        for t, p, i, v, n in zip(chosen.tolist(), picked, ids, values, top)
    ]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
    """The prompt's own tokens scored by the logits at the positions before them (len(prompt) - 1
    rows): the first token has none (logprob and top None, as OpenAI and vLLM give)."""
    first = TokenLogprob(prompt_ids[0], None, None)
    if len(prompt_ids) < 2:
        return [first]
    chosen = torch.tensor(prompt_ids[1:], device=logits.device)
    return [
        first,
        *token_logprobs(logits[: len(prompt_ids) - 1], chosen, [top] * (len(prompt_ids) - 1)),
    ]
