"""Log-likelihoods of token continuations, batched: what lm-evaluation-harness's `loglikelihood` and
`loglikelihood_rolling` requests come down to once tokenized.

A request is (context ids, continuation ids). As in lm-eval's causal backends, the model reads
(context + continuation)[:-1], cut from the left to `max_length`, and the continuation's tokens are
scored at the last len(continuation) positions: their summed log-probability, and whether each is
the greedy choice.

Two things make this cheaper than a forward over every request that keeps the whole (batch, seq,
vocab) log-softmax, and neither changes a number:

* the output head runs only at the scored positions. On a multiple-choice prompt that is one or two
  positions of a few hundred, and for a small model with a 50k vocabulary the head is over half of
  the FLOPs per token;
* a causal model's output at a position depends on the tokens up to it only, so a request whose
  input is a prefix of another's (every choice of a one-token answer shares context + answer[:-1] =
  the context) is read from that other request's row: one forward serves them all;
* a log-probability is the target's logit less the row's logsumexp: the logits of HEAD_CHUNK
  positions go into one buffer kept for the whole call and are reduced a few rows at a time, where
  log_softmax wrote a second (positions, vocab) tensor and each chunk got fresh memory (on
  perplexity, every position scored, the head's share of the time fell by ~1/6 on a CPU: 206 MB of
  fresh pages per chunk at pythia's 50k vocabulary).

Rows are sorted by length, longest first, and padded on the right, where padding cannot reach the
real positions before it. A batch ends before a row shorter than 3/4 of its longest: padding is
computed like any token (a 1,356-token article batched with 2,048-token windows ran 692 positions of
padding through every layer), so rows of very different lengths run apart; neighbours in the sorted
order are close in length, so batches of similar rows stay whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.models.layers import VocabProjection

# scored positions per head matmul: bounds the (positions, vocab) logits held at once
HEAD_CHUNK = 1024
# logits rows per logsumexp: its temporaries stay small enough for the allocator to reuse
LSE_ROWS = 64
MIN_FILL = 0.75  # a row joins a batch if it is at least this fraction of the batch's longest row


@dataclass
class _Scored:
    """One request: its model input, and where in that input its continuation is scored."""

    inputs: tuple[int, ...]
    targets: list[int]
    row: int = -1  # the row (a request's input, or one it is a prefix of) that is computed


def model_inputs(
    context: Sequence[int], continuation: Sequence[int], max_length: int
) -> tuple[tuple[int, ...], list[int]]:
    """(input ids, target ids) of one request: the tokens the model reads and the ones it is
    scored on."""
    if not continuation:
        raise UserError("a loglikelihood request has an empty continuation: nothing to score")
    if len(continuation) > max_length:
        raise UserError(
            f"a continuation of {len(continuation)} tokens is longer than the model's context "
            f"({max_length} tokens): shorten it or evaluate a model with a longer context"
        )
    tokens = [*context, *continuation][-(max_length + 1) :]
    return tuple(tokens[:-1]), list(continuation)


def _rows(requests: list[_Scored]) -> list[tuple[int, ...]]:
    """The inputs to compute: each request's, less those that are a prefix of another's. Sorted,
    a sequence that is a prefix of any other is a prefix of the one right after it, so one pass
    finds every covering row."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].inputs)
    rows: list[tuple[int, ...]] = []
    for k in reversed(range(len(order))):
        here = requests[order[k]].inputs
        if rows and rows[-1][: len(here)] == here:
            requests[order[k]].row = len(rows) - 1  # its own input, or one extending it
        else:
            rows.append(here)
            requests[order[k]].row = len(rows) - 1
    return rows


@torch.inference_mode()
def score_requests(
    model: nn.Module,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    max_length: int | None = None,
    greedy: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether every continuation token is the
    argmax) of each (context ids, continuation ids) request, in the order given. greedy=False
    skips the argmax (perplexity needs none; the flag is then False). progress(n) is called as
    rows finish."""
    if batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {batch_size}")
    max_length = max_length or model.config.max_position_embeddings
    scored = [_Scored(*model_inputs(ctx, cont, max_length)) for ctx, cont in requests]
    rows = _rows(scored)
    by_row: dict[int, list[int]] = {}
    for i, req in enumerate(scored):
        by_row.setdefault(req.row, []).append(i)
    device = next(model.parameters()).device
    results: list[tuple[float, bool]] = [(0.0, False)] * len(scored)
    head = _Head(model)
    for batch in batches([len(row) for row in rows], batch_size):
        longest = len(rows[batch[0]])
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        for b, r in enumerate(batch):
            ids[b, : len(rows[r])] = torch.tensor(rows[r], dtype=torch.long)
        hidden = model.hidden_states(ids.to(device))
        where_b, where_t, targets, owners = [], [], [], []
        for b, r in enumerate(batch):
            for i in by_row[r]:
                n, end = len(scored[i].targets), len(scored[i].inputs)
                where_b += [b] * n
                where_t += range(end - n, end)
                targets += scored[i].targets
                owners += [i] * n
        logprobs, argmax = head.score(hidden, where_b, where_t, targets, greedy)
        sums = torch.zeros(len(scored), dtype=torch.float64)
        sums.index_add_(0, torch.tensor(owners), logprobs.double())
        misses = torch.zeros(len(scored), dtype=torch.long)
        misses.index_add_(0, torch.tensor(owners), (~argmax).long())
        for i in dict.fromkeys(owners):
            results[i] = (float(sums[i]), bool(misses[i] == 0))
        if progress is not None:
            progress(sum(len(by_row[r]) for r in batch))
    return results


def batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of rows of these lengths in forward batches: longest first, at most `batch_size`
    to a batch, and a batch ended before a row shorter than MIN_FILL of its first (longest) row,
    so padding stays under 1/4."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        if out and len(out[-1]) < batch_size and lengths[i] >= MIN_FILL * lengths[out[-1][0]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class _Head:
    """The output head at scored positions, HEAD_CHUNK at a time, its logits written into one
    buffer reused over a score_requests call (a plain projection; a soft-capped or
    vocabulary-parallel one makes its own)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.plain = type(getattr(model, "vocab_projection", None)) is VocabProjection
        self.buffer: torch.Tensor | None = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if not self.plain:
            return self.model.logits(h)
        weight, bias = self.model.head()
        v = self.model.vocab_projection.vocab_size
        if self.buffer is None or self.buffer.shape[0] < h.shape[0]:
            self.buffer = h.new_empty(HEAD_CHUNK, v, dtype=weight.dtype)
        out = self.buffer[: h.shape[0]]
        if bias is None:
            return torch.mm(h.to(weight.dtype), weight[:v].t(), out=out)
        return torch.addmm(bias[:v], h.to(weight.dtype), weight[:v].t(), out=out)

    def score(
        self,
        hidden: torch.Tensor,
        where_b: list[int],
        where_t: list[int],
        targets: list[int],
        greedy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of `targets` at the (row, position) pairs, and whether each is the
        argmax there (all False without `greedy`): the target's logit less its row's logsumexp,
        in fp32."""
        device = hidden.device
        picked = hidden[torch.tensor(where_b, device=device), torch.tensor(where_t, device=device)]
        target = torch.tensor(targets, device=device)
        logprobs, argmax = [], []
        for s in range(0, len(targets), HEAD_CHUNK):
            logits, t = self.logits(picked[s : s + HEAD_CHUNK]), target[s : s + HEAD_CHUNK]
            lse = torch.cat(
                [
                    torch.logsumexp(logits[r : r + LSE_ROWS].float(), -1)
                    for r in range(0, logits.shape[0], LSE_ROWS)
                ]
            )
            logprobs.append(logits.gather(-1, t[:, None])[:, 0].float() - lse)
            argmax.append(
                logits.argmax(-1) == t if greedy else torch.zeros_like(t, dtype=torch.bool)
            )
        return torch.cat(logprobs).cpu(), torch.cat(argmax).cpu()
