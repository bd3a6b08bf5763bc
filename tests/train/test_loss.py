"""The chunked cross-entropy (lmforge.train.loss) against F.cross_entropy over full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lmforge.train.loss as loss_mod
from lmforge.models import build
from lmforge.train.loss import linear_cross_entropy
from lmforge.train.tasks import get_task


def _inputs(n=37, d=16, rows=1000, dtype=torch.float32, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(rows, d, generator=gen) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(rows, generator=gen).to(dtype).requires_grad_() if bias else None
    return h, w, b


def _grads(fn, h, w, b, labels, scale=0.37, autocast=False):
    for t in (h, w, b):
        if t is not None:
            t.grad = None
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = fn(h, w, b, labels)
    # an incoming gradient other than 1, as the trainer's normalisation gives
    (loss * scale).backward()
    return loss.detach().double(), [
        t.grad.double() for t in (h, w, b) if t is not None and t.requires_grad
    ]


def _plain(h, w, b, labels, vocab=None, softcap=None):
    v = vocab or w.shape[0]
    logits = F.linear(h, w[:v], b[:v] if b is not None else None)
    if softcap is not None:  # transformers' Gemma 2: logits / cap, tanh, * cap
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("chunk", [8, 1024])
def test_fp32_loss_and_gradients_equal_plain_cross_entropy(bias, ignore, chunk, monkeypatch):
    monkeypatch.setattr(loss_mod, "CPU_BLOCK_BYTES", 3 * 4 * 1000)  # 3 rows per softmax block
    h, w, b = _inputs(bias=bias)
    labels = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    if ignore:
        labels[::3] = -100
    lp, gp = _grads(_plain, h, w, b, labels)
    lf, gf = _grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=chunk), h, w, b, labels)
    assert lf.item() == pytest.approx(lp.item(), rel=1e-6)
    for fused, plain in zip(gf, gp, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [8, 1024])
@pytest.mark.parametrize("softcap", [0.5, 3.0])
def test_soft_capped_loss_and_gradients_equal_plain_cross_entropy_of_capped_logits(
    softcap, chunk, bias, monkeypatch
):
    """Gemma's final-logit cap applied chunk by chunk: loss and gradients (through tanh) of the
    capped logits."""
    monkeypatch.setattr(loss_mod, "CPU_BLOCK_BYTES", 3 * 4 * 1000)
    h, w, b = _inputs(bias=bias)
    labels = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    labels[::4] = -100
    lp, gp = _grads(lambda *a: _plain(*a, softcap=softcap), h, w, b, labels)
    lu, _ = _grads(_plain, h, w, b, labels)
    assert abs(lp - lu) > 0.1 * lu  # the cap bites: these logits reach several units
    lf, gf = _grads(
        lambda *a: linear_cross_entropy(*a, chunk_tokens=chunk, softcap=softcap), h, w, b, labels
    )
    assert lf.item() == pytest.approx(lp.item(), rel=1e-6)
    for fused, plain in zip(gf, gp, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_soft_capped_bf16_gradients_are_as_accurate_as_the_plain_path(monkeypatch):
    monkeypatch.setattr(loss_mod, "CPU_BLOCK_BYTES", 5 * 4 * 1000)
    n, cap = 300, 2.0
    h, w, _ = _inputs(n=n, d=64)
    with torch.no_grad():
        h.copy_(h.bfloat16())
        w.copy_(w.bfloat16())
    labels = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(1))
    lr, gr = _grads(
        lambda *a: _plain(*a, softcap=cap),
        h.detach().double().requires_grad_(),
        w.detach().double().requires_grad_(),
        None,
        labels,
    )
    lp, gp = _grads(lambda *a: _plain(*a, softcap=cap), h, w, None, labels, autocast=True)
    lf, gf = _grads(
        lambda *a: linear_cross_entropy(*a, chunk_tokens=64, softcap=cap),
        h,
        w,
        None,
        labels,
        autocast=True,
    )
    assert abs(lf - lr) <= max(2 * abs(lp - lr), 1e-3 * abs(lr))
    for fused, plain, ref in zip(gf, gp, gr, strict=True):
        err_fused, err_plain = (fused - ref).norm() / ref.norm(), (plain - ref).norm() / ref.norm()
        assert err_fused < 1.5 * err_plain + 1e-4, (err_fused, err_plain)


def test_padding_rows_of_the_head_are_never_scored():
    h, w, b = _inputs(rows=1024, bias=True)  # 1000 real rows + 24 padding rows
    labels = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    lp, gp = _grads(lambda *a: _plain(*a, vocab=1000), h, w, b, labels)
    lf, gf = _grads(
        lambda *a: linear_cross_entropy(*a, vocab_size=1000, chunk_tokens=8), h, w, b, labels
    )
    assert lf.item() == pytest.approx(lp.item(), rel=1e-6)
    for fused, plain in zip(gf, gp, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    assert torch.all(gf[1][1000:] == 0) and torch.all(gf[2][1000:] == 0)


@pytest.mark.parametrize("dtype", ["bf16-mixed", "bf16"])
def test_bf16_gradients_are_as_accurate_as_the_plain_path(dtype, monkeypatch):
    """Against an fp64 reference from the same (bf16-representable) inputs: the fused path's error
    is of the plain autocast path's size (bf16 GEMMs, fp32 softmax in both)."""
    monkeypatch.setattr(loss_mod, "CPU_BLOCK_BYTES", 5 * 4 * 1000)
    n = 300
    h, w, b = _inputs(n=n, d=64, dtype=torch.float32 if dtype == "bf16-mixed" else torch.bfloat16)
    with torch.no_grad():  # bf16-representable values, so the fp64 reference sees the same inputs
        h.copy_(h.bfloat16())
        w.copy_(w.bfloat16())
    labels = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(1))
    autocast = dtype == "bf16-mixed"
    lr, gr = _grads(
        _plain,
        h.detach().double().requires_grad_(),
        w.detach().double().requires_grad_(),
        None,
        labels,
    )
    lp, gp = _grads(_plain, h, w, b, labels, autocast=autocast)
    lf, gf = _grads(
        lambda *a: linear_cross_entropy(*a, chunk_tokens=64), h, w, b, labels, autocast=autocast
    )
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    assert abs(lf - lr) <= max(2 * abs(lp - lr), 1e-3 * abs(lr))
    for fused, plain, ref in zip(gf, gp, gr, strict=True):
        err_fused, err_plain = (fused - ref).norm() / ref.norm(), (plain - ref).norm() / ref.norm()
        assert err_fused < 1.5 * err_plain + 1e-4, (err_fused, err_plain)


@pytest.mark.parametrize("on_host", [True, False], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("gap", [30.0, 60.0, 80.0, 200.0])
def test_a_confident_wrong_answer_costs_its_exact_loss(gap, on_host, monkeypatch):
    """A label `gap` nats below the top logit costs ~gap: exact whether -log p is read off the
    softmax (p >= 1e-30) or p underflows and the row is recomputed with log-softmax (on the CPU),
    or every row's logsumexp(z) - z[label] is chosen on the device (on an accelerator: no host
    sync)."""
    import functools

    import lmforge.train.loss as loss_module

    monkeypatch.setattr(
        loss_module,
        "_softmax_rows_",
        functools.partial(loss_module._softmax_rows_, on_host=on_host),
    )
    h = torch.zeros(2, 4, requires_grad=True)
    h.data[:, 0] = 1.0
    w = torch.zeros(10, 4, requires_grad=True)
    w.data[3, 0] = gap
    labels = torch.tensor([5, 3])
    for softcap in (None, 100.0):  # capped: 100 * tanh(gap / 100), still past 1e-30 from gap 80 on
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, None, labels, softcap=softcap)
        ref = _plain(h.detach().double(), w.detach().double(), None, labels, softcap=softcap)
        assert torch.isfinite(loss) and loss.item() == pytest.approx(ref.item(), rel=1e-6)
        loss.backward()
        assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_scored_rows_given_by_the_caller_give_the_same_loss_and_gradients():
    """The trainer finds the scored positions on the host (SCORED_ROWS): the loss and gradients
    are those of the rows found on the device, bit for bit."""
    h, w, b = _inputs(bias=True)
    labels = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    labels[::3] = -100
    rows = (labels != -100).nonzero().squeeze(1)
    found = _grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=8), h, w, b, labels)
    given = _grads(
        lambda *a: linear_cross_entropy(*a, chunk_tokens=8, scored_rows=rows), h, w, b, labels
    )
    assert found[0] == given[0]
    for a, g in zip(found[1], given[1], strict=True):
        assert torch.equal(a, g)


def test_without_grad_it_only_scores():
    h, w, _ = _inputs()
    labels = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, None, labels, chunk_tokens=8)
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(
        _plain(h.detach(), w.detach(), None, labels).item(), rel=1e-6
    )


def test_a_frozen_head_passes_gradients_to_the_hidden_states_only():
    h, w, _ = _inputs()
    w.requires_grad_(False)
    labels = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    _, (grad_plain,) = _grads(_plain, h, w, None, labels)
    _, (grad_fused,) = _grads(
        lambda *a: linear_cross_entropy(*a, chunk_tokens=8), h, w, None, labels
    )
    assert w.grad is None
    torch.testing.assert_close(grad_fused, grad_plain, rtol=1e-5, atol=1e-6)


# own head, tied, head with bias, tied and soft-capped
@pytest.mark.parametrize("preset", ["tiny-neox", "tiny-gpt2", "tiny-gptj", "tiny-gemma2"])
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_task_loss_through_the_model_equals_the_plain_path(preset, task):
    model = build(preset, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (3, 17), generator=gen)
    if task == "pretrain":
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    else:
        labels = tokens.clone()
        labels[:, :5] = -100  # the prompt is not scored
        batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": labels}
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        loss, count, _ = get_task(task).loss(model, batch, fused=fused)
        (loss / count).backward()
        results.append(
            (loss.item(), count, {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    (lp, cp, gp), (lf, cf, gf) = results
    assert cf == cp and lf == pytest.approx(lp, rel=1e-6)
    assert gf.keys() == gp.keys()
    for name in gp:  # fp32 rounding only: relative to each gradient's scale
        assert (gf[name] - gp[name]).abs().max() <= 1e-5 * gp[name].abs().max(), name


def test_soft_capped_logits_are_what_training_scores():
    """Gemma 2 caps its logits: the task loss (fused or not) is the cross-entropy of the capped
    logits."""
    model = build("tiny-gemma2", seed=0)
    with torch.no_grad():
        model.embed.weight.mul_(30)  # logits of several units, which a cap of 1 squeezes hard
    tokens = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    labels = torch.roll(tokens, -1, 1)
    model.config.final_logit_softcapping = model.vocab_projection.softcap = 1.0
    with torch.no_grad():
        logits = model(tokens)
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        uncapped = F.cross_entropy(
            F.linear(model.hidden_states(tokens), model.embed.weight[:1000]).flatten(0, 1),
            labels.flatten(),
            reduction="sum",
        )
        assert logits.abs().max() <= 1.0 and abs(expected - uncapped) > 10.0
        for fused in (False, True):
            loss, _, _ = get_task("pretrain").loss(
                model, {"tokens": tokens, "labels": labels}, fused=fused
            )
            assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
