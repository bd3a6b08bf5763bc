"""What an FSDP2 unit returns: no view tensor, which torch warns of (an in-place op on it would drop
the unit's pre-backward hook and the all-gather of its backward).

The pipelined BERT recipe (configs/experiments/bert-mlm-pipeline.yaml, `data_parallel: ddp`) lays
its data-parallel replicas out with FSDP2 (HSDP of one shard: whole parameters on every rank,
gradients all-reduced, DDP's arithmetic): lmforge.parallel.parallelize keeps DDP for layouts of
replicas alone. Its last stage returned the MLM logits as a view (F.linear with a bias), and two
ranks printed torch's warning at the first step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lmforge.models import build
from lmforge.parallel.mesh import torch_version


def test_bert_mlm_logits_are_not_a_view_and_unchanged():
    model = build("tiny-bert", seed=0)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)
    )
    logits = model(ids)
    assert logits._base is None and logits.shape == (2, 8, model.config.vocab_size)
    head, v = model.mlm_head, model.config.vocab_size
    h = head.norm(head.act(head.dense(model.hidden_states(ids))))
    assert torch.equal(logits, F.linear(h, model.embeddings.word.weight[:v], head.bias[:v]))
    logits.logsumexp(-1).sum().backward()
    # padding rows get no gradient
    assert head.bias.grad is not None and head.bias.grad[v:].abs().sum() == 0


@pytest.mark.skipif(torch_version() < (2, 7), reason="FSDP2 on the CPU needs torch 2.7")
def test_an_fsdp_wrapped_bert_returns_no_view(fake_two_ranks):
    """The MLM head's logits leave the root unit without torch's view warning (fake process
    group: shapes only)."""
    from lmforge.parallel.compose import apply_fsdp

    model = build("tiny-bert", seed=0)
    apply_fsdp(model, fake_two_ranks, reshard_after_forward=False)  # as a pipeline stage is wrapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.requires_grad
    assert not [w for w in caught if "view tensor" in str(w.message)]


@pytest.fixture
def fake_two_ranks():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()
