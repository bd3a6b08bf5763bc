"""What the SFT task hands the model: the documents of a packed batch, nothing for a right-padded
one; the loss and gradients equal those of the masks it built before (a dense document mask, a
padding mask)."""

from __future__ import annotations

import torch

from lmforge.data.collate import PadCollator
from lmforge.models import build
from lmforge.models.documents import document_mask
from lmforge.train.tasks import get_task
from lmforge.train.tasks.base import lm_loss


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.item(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert abs(la - lb) <= 1e-6 * abs(la)
    assert ga.keys() == gb.keys()
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() <= 1e-5 * ga[name].abs().max(), name


def _items(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    items = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=gen)
        labels = ids.clone()
        labels[: n // 3] = -100
        items.append(
            {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(n, dtype=torch.long)}
        )
    return items


def test_right_padded_sft_runs_causal_with_the_padding_masks_loss():
    model = build("tiny-llama", seed=0)
    batch = PadCollator(0)(_items([9, 31, 20], model.config.vocab_size))
    task = get_task("sft")
    ids, labels, inputs = task.inputs(batch)
    assert inputs == {}  # no mask: SDPA's is_causal
    new = _loss_and_grads(model, lambda: task.loss(model, batch)[0])
    old = _loss_and_grads(
        model,
        lambda: lm_loss(
            model, {"input_ids": ids, "attention_mask": batch["attention_mask"]}, labels
        ),
    )
    _assert_same(old, new)


def test_packed_sft_hands_the_model_its_documents():
    model = build("tiny-mistral", seed=0)  # a sliding window shorter than the documents
    items = _items([12, 30, 7, 25], model.config.vocab_size)
    seq = 80
    batch = {
        k: torch.zeros(1, seq, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "position_ids", "segment_ids")
    }
    batch["labels"] = torch.full((1, seq), -100)
    start = 0
    for d, item in enumerate(items, start=1):
        n = len(item["input_ids"])
        for key in ("input_ids", "labels", "attention_mask"):
            batch[key][0, start : start + n] = item[key]
        batch["position_ids"][0, start : start + n] = torch.arange(n)
        batch["segment_ids"][0, start : start + n] = d
        start += n
    task = get_task("sft")
    ids, labels, inputs = task.inputs(batch)
    assert set(inputs) == {"segment_ids", "position_ids"}
    new = _loss_and_grads(model, lambda: task.loss(model, batch)[0])
    dense = {
        "attention_mask": document_mask(batch["segment_ids"]),
        "position_ids": batch["position_ids"],
    }
    old = _loss_and_grads(model, lambda: lm_loss(model, {"input_ids": ids, **dense}, labels))
    _assert_same(old, new)
