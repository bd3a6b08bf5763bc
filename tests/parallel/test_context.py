"""Context parallelism (lmforge.parallel.context) on 2 and 4 gloo ranks against one process:
attention outputs and q/k/v gradients against lmforge's own attention over the whole sequence
under the dense document mask (lmforge.models.documents.document_mask), and a tiny grouped-query
decoder's loss and every parameter's gradient on packed documents against the same decoder in one
process; both methods (all-gather, ring)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmforge.models import build
from lmforge.models.attention import attention
from lmforge.models.documents import document_mask
from lmforge.parallel.comm_volume import context_bytes
from lmforge.parallel.context import ContextShard, split_batch, split_sequence
from tests.parallel import context_worker as cw
from tests.parallel.launch import torchrun

WORKER = Path(cw.__file__)


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("context") / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    r = torchrun(request.param, [str(WORKER), str(out)], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


def reference_attention(case, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One process, lmforge's attention on the whole sequence; `dtype`: the inputs rounded to it
    first, then computed in fp32 and in that dtype (the one-process result at that precision)."""
    name, b, h, g, s, d, lengths, window, softcap = case
    x = cw.attention_inputs(case)
    q, k, v = (x[n].to(dtype).to(torch.float32).requires_grad_() for n in ("q", "k", "v"))
    mask = (
        document_mask(x["segments"], window) if lengths is not None or window is not None else None
    )
    out = attention(q, k, v, mask, mask is None, None, softcap, 0.0)
    (out * x["weight"]).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", cw.KERNELS)
@pytest.mark.parametrize("method", cw.METHODS)
@pytest.mark.parametrize("case", cw.ATTENTION_CASES, ids=[c[0] for c in cw.ATTENTION_CASES])
def test_attention_and_gradients_equal_one_process(results, case, method, kernel):
    """Per block SDPA's CPU kernel ("auto"; a soft cap takes the explicit math) or the explicit
    fp32 math."""
    ref = reference_attention(case)
    got = results[(method, kernel, case[0])]
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=f"{name}")


@pytest.mark.slow
@pytest.mark.parametrize("method", cw.METHODS)
def test_bf16_inputs_are_as_close_as_one_process_in_bf16(results, method):
    """bf16 q/k/v (fp32 inside the blocks): within bf16's rounding of the fp32 result on the same
    rounded inputs, and no further from it than one process's bf16 SDPA."""
    case = cw.ATTENTION_CASES[1]
    exact = reference_attention(case, torch.bfloat16)
    x = cw.attention_inputs(case)
    q, k, v = (x[n].to(torch.bfloat16).requires_grad_() for n in ("q", "k", "v"))
    one = attention(q, k, v, document_mask(x["segments"]), False, None, None, 0.0)
    (one.float() * x["weight"]).sum().backward()
    one_process = {"out": one.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    got = results[(method, "packed_gqa_bf16")]
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == torch.bfloat16
        ours = (got[name].float() - exact[name]).abs().max()
        theirs = (one_process[name].float() - exact[name]).abs().max()
        assert ours <= theirs * 1.5 + 1e-3, (name, ours, theirs)
        torch.testing.assert_close(got[name].float(), exact[name], atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("method", cw.METHODS)
def test_decoder_loss_and_gradients_equal_one_process(results, method):
    model = build(cw.DECODER, seed=3)
    batch = cw.decoder_inputs()
    logits = model(
        batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"]
    )
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    got = results[(method, "decoder")]
    torch.testing.assert_close(got["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[f"grad.{n}"], p.grad, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("method", cw.METHODS)
def test_bytes_handed_to_the_collectives_match_the_formula(results, method):
    """Every rank hands the collectives what comm_volume.context_bytes predicts for the decoder's
    step (fp32 K/V: kv_bytes 4; packed segment ids gathered once per forward)."""
    from lmforge.models.config import ModelConfig

    cfg = ModelConfig(**cw.DECODER)
    counts = results[(method, "bytes")]
    want = context_bytes(cfg, len(counts), cw.DECODER_SEQ, 2, method, kv_bytes=4, packed=True)
    for rank in counts:
        assert rank["forward"] == want["forward"]
        assert rank["total"] == want["total"]


@pytest.mark.slow
@pytest.mark.parametrize("method", cw.METHODS)
def test_context_groups_inside_a_larger_world(results, method):
    """Two context groups of 2 in a world of 4 (as a mesh builds them): each equals one process."""
    if (method, "subgroups") not in results:
        pytest.skip("the world of 4 runs it")
    ref = reference_attention(cw.ATTENTION_CASES[1])
    for got in results[(method, "subgroups")]:
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_split_holds_chunks_i_and_2c_minus_1_minus_i():
    """Every slot on exactly one rank; rank i holds chunks i and 2C-1-i; position ids travel with
    their tokens."""
    seq, context = 16, 4
    ids = torch.arange(seq)[None] * 10
    held = []
    for rank in range(context):
        shard = ContextShard(context, rank)
        local = split_batch({"input_ids": ids}, shard)
        chunks = local["position_ids"][0].view(2, -1)[:, 0] // (seq // (2 * context))
        assert chunks.tolist() == [rank, 2 * context - 1 - rank]
        assert torch.equal(local["input_ids"], local["position_ids"] * 10)
        assert torch.equal(shard.slots(seq), local["position_ids"][0])
        held += shard.slots(seq).tolist()
    assert sorted(held) == list(range(seq))
    # Causal pairs per rank: every rank's queries see the same number of keys (the load balance).
    seen = [sum(int(s) + 1 for s in ContextShard(context, r).slots(seq)) for r in range(context)]
    assert len(set(seen)) == 1


def test_uneven_sequence_is_refused():
    from lmforge.errors import UserError

    with pytest.raises(UserError, match="multiple of 8"):
        split_sequence(torch.zeros(1, 12), ContextShard(4, 0))


@pytest.mark.parametrize(
    "setting,match",
    [
        ({"causal": False}, "causal"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling dynamic"),
    ],
)
def test_settings_it_cannot_run_exactly_are_refused(setting, match):
    from lmforge.errors import UserError
    from lmforge.parallel.context import context_parallel_decoder

    model = build({**cw.DECODER, **setting}, device="meta")
    with pytest.raises(UserError, match=match), context_parallel_decoder(model, ContextShard(2, 0)):
        pass
