"""Attention within packed documents (lmforge.models.documents) against the dense mask it
replaces, and against transformers running each document on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.models import load_pretrained
from lmforge.models.documents import MIN_CHUNK_BY_DEVICE, Documents, document_backend, document_mask
from lmforge.models.hf import import_hf
from tests.conftest import make_hf_model

tf = pytest.importorskip("transformers")

# Sliding windows (mistral, gemma2, gemma3: 8 tokens), grouped query heads, soft-capped scores
# (gemma2), q/k norms.
FAMILIES = ["llama_gqa", "mistral", "gemma2", "gemma3", "gpt_neox", "qwen3", "gpt2"]
LENGTHS = [[13, 30, 5, 40, 1, 20], [64, 36, 12]]  # row 0 ends in 19 padding slots, row 1 in 16


def packed(lengths: list[list[int]], seq: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_ids and position_ids of rows packed with documents of `lengths`, padding after
    them."""
    segments = torch.zeros(len(lengths), seq, dtype=torch.long)
    positions = torch.zeros_like(segments)
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row, start=1):
            segments[r, start : start + n] = d
            positions[r, start : start + n] = torch.arange(n)
            start += n
    return segments, positions


@pytest.fixture(scope="module")
def models(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("documents")
    for name in FAMILIES:
        import_hf(hf_dirs[name], root / name)
    return {name: load_pretrained(root / name) for name in FAMILIES}


def _logits_and_grads(model, ids, **inputs):
    model.zero_grad()
    logits = model(ids, **inputs)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("min_chunk", [1, 32])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_and_gradients_equal_the_dense_mask(family, min_chunk, models, monkeypatch):
    """min_chunk 1: every document its own SDPA call; 32: short documents grouped under a
    block-diagonal mask; each must give the dense mask's logits and gradients (fp32)."""
    monkeypatch.setitem(MIN_CHUNK_BY_DEVICE, "cpu", min_chunk)
    # gradients still flow; GPT-2 imports its dropout, which eval turns off
    model = models[family].eval()
    segments, positions = packed(LENGTHS)
    ids = torch.randint(1, 300, segments.shape, generator=torch.Generator().manual_seed(3))
    dense, dense_grads = _logits_and_grads(
        model, ids, attention_mask=document_mask(segments), position_ids=positions
    )
    split, split_grads = _logits_and_grads(model, ids, segment_ids=segments, position_ids=positions)
    assert (split - dense).abs().max().item() <= 1e-5
    assert split_grads.keys() == dense_grads.keys()
    # fp32 summation order differs: 1e-7 of the largest entry seen
    for name, grad in dense_grads.items():
        assert (split_grads[name] - grad).abs().max().item() <= 1e-5 * grad.abs().max().item(), name


@pytest.mark.parametrize("family", ["mistral", "gemma2", "llama_gqa"])
def test_each_packed_document_reads_as_transformers_reads_it_alone(family, models):
    """The reference written by others: transformers on each document by itself, no packing at
    all."""
    ref = make_hf_model(family)
    ours = models[family].eval()
    segments, positions = packed(LENGTHS)
    ids = torch.randint(1, 300, segments.shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = ours(ids, segment_ids=segments, position_ids=positions)
        for r, row in enumerate(LENGTHS):
            start = 0
            for n in row:
                alone = ref(ids[r : r + 1, start : start + n]).logits[0]
                assert (out[r, start : start + n] - alone).abs().max().item() <= 1e-5
                start += n


def test_the_dense_mask_keeps_attention_inside_documents_and_windows():
    segments = torch.tensor([[1, 1, 1, 2, 2, 0]])
    mask = document_mask(segments, window=2)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0],  # the window: two slots, itself included
            [0, 0, 0, 1, 0, 0],  # a new document sees nothing before it
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )  # padding: itself alone
    assert torch.equal(mask, expected)


def test_a_document_split_in_two_is_refused():
    with pytest.raises(ValueError, match="document 1 of row 0 is not contiguous"):
        Documents.of(torch.tensor([[1, 1, 2, 1, 0]]))


def test_segment_ids_and_attention_mask_together_are_refused(models):
    segments, _ = packed([[3, 2]], seq=8)
    with pytest.raises(ValueError, match="attention_mask or segment_ids"):
        models["llama_gqa"](
            torch.ones(1, 8, dtype=torch.long), attention_mask=segments > 0, segment_ids=segments
        )


def test_the_cpu_uses_the_split_backend():
    """FlexAttention has no backward on the CPU (torch 2.6-2.13): training there must not pick
    it."""
    assert document_backend(torch.device("cpu")) == "split"


@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 2.0)])
def test_flex_block_masks_give_the_dense_mask_attention(window, softcap):
    """The flex backend's mask_mod and score_mod, checked where FlexAttention runs here: the CPU,
    forward only, uncompiled (torch's own reference implementation of the same call)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    segments, _ = packed([[100, 60, 30], [7, 200]], seq=256)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = torch.randn(2, 2, 256, 16, generator=g), torch.randn(2, 2, 256, 16, generator=g)
    from lmforge.models import documents
    from lmforge.models.attention import attention

    docs = Documents.of(segments, [window], backend="flex")
    with torch.no_grad(), pytest.MonkeyPatch.context() as m:
        from torch.nn.attention.flex_attention import flex_attention

        m.setattr(documents, "compiled_flex_attention", lambda: flex_attention)
        out = docs.attend(q, k, v, window, None, softcap, 0.0)
    expected = attention(q, k, v, document_mask(segments, window), False, None, softcap, 0.0)
    assert (out - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window,softcap", [(24, None), (None, 2.0), (24, 2.0), (200, None)])
def test_flex_causal_block_masks_give_the_dense_causal_attention(window, softcap):
    """An unpacked batch (Documents.causal): the causal block mask narrowed to the window, the
    cap as a score_mod, against SDPA-shaped attention with the dense causal band mask. CPU,
    forward only, uncompiled."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    from lmforge.models import documents
    from lmforge.models.attention import attention

    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = torch.randn(2, 2, 256, 16, generator=g), torch.randn(2, 2, 256, 16, generator=g)
    docs = Documents.causal(2, 256, [window], q.device, backend="flex")
    slots = torch.arange(256)
    dense = slots[None, :] <= slots[:, None]
    if window is not None:
        dense &= slots[None, :] > slots[:, None] - window
    with torch.no_grad(), pytest.MonkeyPatch.context() as m:
        m.setattr(documents, "compiled_flex_attention", lambda: flex_attention)
        out = docs.attend(q, k, v, window, 0.3, softcap, 0.0)
    expected = attention(q, k, v, dense, False, 0.3, softcap, 0.0)
    assert (out - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "llama_gqa"])
def test_on_a_flex_device_windowed_and_capped_families_attend_through_flex(
    family, models, monkeypatch
):
    """With the device among FLEX_DEVICES, an unpacked causal batch of a family with sliding
    windows or capped scores attends through FlexAttention in every layer (no dense band mask)
    and gives the dense path's logits; a family with neither keeps SDPA's is_causal. CPU: forward
    only (torch 2.13 has no CPU FlexAttention backward, so the gradients are checked where
    scripts/gpu_check.py runs), uncompiled."""
    from torch.nn.attention.flex_attention import flex_attention

    from lmforge.models import documents

    model = models[family]
    # 5 windows of 8
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        dense = model(ids)
    calls = []
    monkeypatch.setattr(documents, "FLEX_DEVICES", ("cpu",))
    monkeypatch.setattr(documents, "flex_available", lambda: True)
    monkeypatch.setattr(
        documents,
        "compiled_flex_attention",
        lambda: lambda *a, **kw: calls.append(kw["block_mask"]) or flex_attention(*a, **kw),
    )
    with torch.no_grad():
        flex = model(ids)
    assert (flex - dense).abs().max().item() <= 1e-5
    special = any(model.config.window(i) for i in range(model.config.num_layers))
    special = special or model.config.attn_logit_softcapping is not None
    assert len(calls) == (model.config.num_layers if special else 0)


def test_split_attention_skips_the_scores_between_documents():
    """The point of it: per document a causal SDPA call on that document's slots only, no (seq,
    seq) scores."""
    segments, _ = packed([[300, 200, 12]], seq=512)
    q = torch.randn(1, 2, 512, 8)
    calls = []
    original = F.scaled_dot_product_attention

    def spy(q, k, *args, **kwargs):
        calls.append(
            (q.shape[-2], k.shape[-2], kwargs.get("is_causal"), kwargs.get("attn_mask") is not None)
        )
        return original(q, k, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", spy)
        Documents.of(segments, min_chunk=256).attend(q, q, q, None, None, None, 0.0)
    # 300 alone (causal), then 200 + 12 grouped under their own mask; the padding needs no call.
    assert calls == [(300, 300, True, False), (212, 212, False, True)]


def test_flex_backend_sends_heads_narrower_than_its_kernels_allow_the_split_way(monkeypatch):
    """Inductor's FlexAttention refuses heads under 16 wide (seen on an H200): such layers attend
    the split way, with the dense mask's result, and FlexAttention is never called."""
    from lmforge.models import documents
    from lmforge.models.attention import attention

    segments, _ = packed([[30, 50, 20]], seq=128)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 128, 8, generator=g) for _ in range(3))
    monkeypatch.setattr(
        documents, "compiled_flex_attention", lambda: pytest.fail("FlexAttention was called")
    )
    out = Documents.of(segments, [None], backend="flex").attend(q, k, v, None, None, None, 0.0)
    expected = attention(q, k, v, document_mask(segments), False, None, None, 0.0)
    assert (out - expected).abs().max().item() <= 1e-5
