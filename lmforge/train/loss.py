"""Cross-entropy through the output head, chunk by chunk, so the whole batch's logits never exist.

The plain path (`logits = h @ W.T`, then `F.cross_entropy(logits.float(), labels)`) materialises,
for Pythia's 50k vocabulary and a micro-batch of 8 x 512 tokens, 4096 x 50304 logits (0.8 GB in
fp32), their log-softmax and the gradient of each: several GB written and read per step, and on
CPU about a third of a bf16 training step (BENCHMARKS.md). Here, per chunk of tokens:

    logits = h_c @ W.T              one GEMM in the compute dtype (bf16 under autocast)
    p      = softmax(logits)        in fp32, a few rows at a time (rows that stay in cache)
    loss  += -log p[label]          (log-softmax for the rare rows where p[label] underflows)
    g      = p - onehot(label)      written over the logits buffer, in the compute dtype
    dh_c   = g @ W,  dW += g.T @ h_c

so the gradients are ready when the forward ends, and backward only scales them by the incoming
gradient. The math is the plain path's: softmax and loss in fp32, GEMMs in the compute dtype, the
head's gradient summed over chunks in fp32. Tokens labelled `ignore_index` are dropped before
the head (no GEMM is spent on them, as in SFT prompts).

Soft-capped logits (Gemma 2/3's final_logit_softcapping: c = cap * tanh(z / cap)) are capped block
by block in fp32 like the softmax: the loss is that of c, and the gradient through the cap is (p -
onehot) * (1 - tanh(z / cap)^2), one more block-sized fp32 buffer (the tanh) and no full logits.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
# The batch key of a token loss's scored positions (labels != IGNORE_INDEX, as flat indices), found
# on the host while the batch is still there (lmforge.train.step): dropping the others then needs no
# host sync.
SCORED_ROWS = "scored_rows"
# Beside it, how many of them each row has: a CPU tensor the batch keeps on the host (a per-row
# loss, DPO's, splits SCORED_ROWS by it and knows its blank rows without reading the device).
SCORED_PER_ROW = "scored_per_row"
# fp32 softmax work per block of rows on CPU: small enough to stay in cache across the block's few
# passes, large enough that a step runs few small parallel ops (each one waits for every thread).
CPU_BLOCK_BYTES = 16 << 20
# Below this softmax probability of the label (a loss above ~69 nats) the loss is recomputed with
# log-softmax: fp32 probabilities near 1e-38 lose digits, then underflow to 0 (an infinite loss).
TINY_PROBABILITY = 1e-30


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute the logits in here: autocast's, else the inputs'."""
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return torch.promote_types(h.dtype, weight.dtype)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    chunk_tokens: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    scored_rows: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `h @ weight.T + bias` against `labels` (fp32 scalar), as
    `F.cross_entropy(F.linear(h, weight, bias).float(), labels, reduction="sum")` computes it; with
    `softcap`, of the capped logits `softcap * tanh(logits / softcap)` (as the model's
    SoftCappedVocabProjection gives them).

    h: (..., hidden); labels: the same leading shape; weight: (rows, hidden), of which only the
    first vocab_size rows are the vocabulary (the rest is padding, never scored). scored_rows: the
    flat indices of the labels != ignore_index where the caller knows them (then no host sync here).
    """
    if vocab_size is not None and vocab_size < weight.shape[0]:
        weight, bias = weight[:vocab_size], bias[:vocab_size] if bias is not None else None
    h = h.reshape(-1, h.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != h.shape[0]:
        raise ValueError(f"{labels.shape[0]} labels for {h.shape[0]} hidden states")
    if scored_rows is None:
        keep = labels != ignore_index
        if not bool(keep.all()):
            scored_rows = keep.nonzero().squeeze(1)
    # shapes: known without the device
    if scored_rows is not None and scored_rows.shape[0] < labels.shape[0]:
        h, labels = h.index_select(0, scored_rows), labels.index_select(0, scored_rows)
    needs = tuple(
        torch.is_grad_enabled() and t is not None and t.requires_grad for t in (h, weight, bias)
    )
    return _LinearCrossEntropy.apply(
        h, weight, bias, labels, compute_dtype(h, weight), chunk_tokens, needs, softcap
    )


def _softmax_rows_(
    z: torch.Tensor,
    labels: torch.Tensor,
    losses: torch.Tensor,
    probs: torch.Tensor,
    need_grad: bool,
    on_host: bool | None = None,
    softcap: float | None = None,
    tanh: torch.Tensor | None = None,
) -> None:
    """Per-token losses of a chunk's logits `z`, and (need_grad) z <- softmax(z) -
    onehot(labels), block by block of probs' rows, in fp32 whatever z's dtype. `on_host`
    (default: z on the CPU): whether reading the device is free, so that only the rows whose
    probability underflows get log-softmax; on an accelerator every row's exact loss is computed
    and chosen on the device, without a host sync. softcap: the logits are c = softcap * tanh(z /
    softcap) (`tanh`, probs' shape, holds the block's tanh) and z <- (softmax(c) -
    onehot(labels)) * (1 - tanh^2), the gradient through the cap."""
    if on_host is None:
        on_host = z.device.type == "cpu"
    block = probs.shape[0]
    minus_one = torch.full((block, 1), -1.0, device=z.device)
    for r in range(0, z.shape[0], block):
        zr, yr = z[r : r + block], labels[r : r + block, None]
        pr = probs[: zr.shape[0]]
        if softcap is None:
            torch.softmax(zr, 1, dtype=torch.float32, out=pr)

            def logits(rows=slice(None), zr=zr):
                return zr[rows].float()
        else:
            tr = tanh[: zr.shape[0]]
            torch.div(zr, softcap, out=tr).tanh_()
            torch.softmax(torch.mul(tr, softcap, out=pr), 1, out=pr)

            def logits(rows=slice(None), tr=tr):
                return tr[rows] * softcap

        p_label = pr.gather(1, yr).squeeze(1)
        loss = p_label.log().neg_()
        tiny = p_label < TINY_PROBABILITY
        # -log p loses precision as p underflows: logsumexp(z) - z[label] for those rows
        if not on_host:
            zf = logits()
            exact = torch.logsumexp(zf, 1).sub_(zf.gather(1, yr).squeeze(1))
            loss = torch.where(tiny, exact, loss)
        elif bool(tiny.any()):  # the same, for the rare rows that need it
            rows = tiny.nonzero().squeeze(1)
            exact = torch.log_softmax(logits(rows), 1).gather(1, yr[rows]).squeeze(1).neg()
            loss.index_copy_(0, rows, exact)
        losses[r : r + zr.shape[0]] = loss
        if need_grad:
            pr.scatter_add_(1, yr, minus_one[: zr.shape[0]])
            if softcap is not None:  # d(cap * tanh(z / cap)) / dz = 1 - tanh(z / cap)^2
                pr.mul_(tr.square_().neg_().add_(1))
            zr.copy_(pr)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, labels, dtype, chunk_tokens, needs, softcap):
        """needs: which of (h, weight, bias) need a gradient; none: only the loss is computed."""
        n, vocab = h.shape[0], weight.shape[0]
        need_grad = any(needs)
        device = h.device
        chunk = max(1, min(chunk_tokens, n))
        block = (
            chunk if device.type != "cpu" else max(1, min(chunk, CPU_BLOCK_BYTES // (4 * vocab)))
        )
        logits = torch.empty(chunk, vocab, dtype=dtype, device=device)
        probs = torch.empty(block, vocab, dtype=torch.float32, device=device)
        tanh = torch.empty_like(probs) if softcap is not None else None
        losses = torch.empty(n, dtype=torch.float32, device=device)
        partial = None
        with torch.autocast(device.type, enabled=False):
            hc, w = h.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            grad_h = torch.empty_like(hc) if needs[0] else None
            grad_w = (
                torch.zeros(w.shape, dtype=torch.float32, device=device)
                if needs[1] and n == 0
                else None
            )
            grad_b = torch.zeros(vocab, dtype=torch.float32, device=device) if needs[2] else None
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                z, hs = logits[: end - start], hc[start:end]
                if b is None:
                    torch.mm(hs, w.t(), out=z)
                else:
                    torch.addmm(b, hs, w.t(), out=z)
                _softmax_rows_(
                    z,
                    labels[start:end],
                    losses[start:end],
                    probs,
                    need_grad,
                    softcap=softcap,
                    tanh=tanh,
                )
                if grad_h is not None:
                    torch.mm(z, w, out=grad_h[start:end])
                if grad_b is not None:
                    grad_b.add_(z.sum(0, dtype=torch.float32))
                if not needs[1]:
                    continue
                if dtype == torch.float32:
                    grad_w = z.t() @ hs if grad_w is None else grad_w.addmm_(z.t(), hs)
                else:  # a bf16 GEMM rounds its output: sum the chunks' dW in fp32, not in bf16
                    partial = z.t() @ hs if partial is None else torch.mm(z.t(), hs, out=partial)
                    grad_w = partial.float() if grad_w is None else grad_w.add_(partial)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (h.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return losses.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        (grad_h, grad_w, grad_b), (h_dtype, w_dtype, b_dtype) = ctx.grads, ctx.dtypes
        ctx.grads = None
        grad_h = (grad_h.float() * grad_loss).to(h_dtype) if grad_h is not None else None
        grad_w = grad_w.mul_(grad_loss).to(w_dtype) if grad_w is not None else None
        grad_b = grad_b.mul_(grad_loss).to(b_dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None
