"""Worker for test_context: context-parallel attention and a tiny decoder on C gloo ranks, each rank
holding its two chunks of the sequence; rank 0 saves the whole outputs and gradients put back
together (gather_sequence) for the test to compare with one process. Run with launch.torchrun:

    context_worker.py OUT.pt
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

# (name, batch, heads, kv_heads, seq, head_dim, document lengths per row or None, window, softcap)
ATTENTION_CASES = [
    ("gqa", 2, 4, 2, 32, 8, None, None, None),
    # Documents of odd lengths: their boundaries fall inside chunks and across them; row 1 ends in
    # padding.
    ("packed_gqa", 2, 4, 1, 32, 8, [[5, 13, 9, 5], [11, 3, 14]], None, None),
    ("packed_window_softcap", 1, 2, 2, 32, 8, [[7, 19, 6]], 5, 30.0),
    ("window", 1, 4, 2, 32, 8, None, 6, None),
]
KERNELS = ("auto", "explicit")  # lmforge.parallel.context_attention.KERNEL
METHODS = ("allgather", "ring")


def packed(
    lengths: list[list[int]] | None, batch: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_ids and position_ids of rows packed with documents of `lengths` (padding after
    them); None: one document per row."""
    if lengths is None:
        return torch.ones(batch, seq, dtype=torch.long), torch.arange(seq).expand(
            batch, seq
        ).clone()
    segments, positions = (
        torch.zeros(batch, seq, dtype=torch.long),
        torch.zeros(batch, seq, dtype=torch.long),
    )
    for r, row in enumerate(lengths):
        start = 0
        for d, n in enumerate(row, start=1):
            segments[r, start : start + n], positions[r, start : start + n] = d, torch.arange(n)
            start += n
    return segments, positions


def attention_inputs(case) -> dict[str, torch.Tensor]:
    _, b, h, g, s, d, lengths, _, _ = case
    gen = torch.Generator().manual_seed(7)
    segments, _ = packed(lengths, b, s)
    return {
        "q": torch.randn(b, h, s, d, generator=gen),
        "k": torch.randn(b, g, s, d, generator=gen),
        "v": torch.randn(b, g, s, d, generator=gen),
        "weight": torch.randn(b, h, s, d, generator=gen),
        "segments": segments,
    }


DECODER = dict(
    family="llama",
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
DECODER_LENGTHS = [[9, 14, 5], [20, 8]]  # row 1 ends in 4 padding slots (labels -100 there)
DECODER_SEQ = 32


def decoder_inputs() -> dict[str, torch.Tensor]:
    segments, positions = packed(DECODER_LENGTHS, 2, DECODER_SEQ)
    ids = torch.randint(
        1, DECODER["vocab_size"], segments.shape, generator=torch.Generator().manual_seed(5)
    )
    labels = torch.where(segments > 0, torch.roll(ids, -1, 1), -100)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels, "segment_ids": segments, "position_ids": positions}


def run_attention(shard, case, method, dtype=torch.float32) -> dict[str, torch.Tensor]:
    from lmforge.parallel.context import gather_sequence, split_sequence
    from lmforge.parallel.context_attention import ContextPlan, context_attention

    name, b, h, g, s, d, lengths, window, softcap = case
    x = attention_inputs(case)
    q, k, v = (split_sequence(x[n], shard, 2).to(dtype).requires_grad_() for n in ("q", "k", "v"))
    seg = split_sequence(x["segments"], shard, 1)
    parts = [torch.empty_like(seg) for _ in range(shard.context)]
    dist.all_gather(parts, seg, group=shard.group)
    plan = ContextPlan(
        shard.group,
        shard.context,
        shard.rank,
        s // (2 * shard.context),
        torch.stack(parts) if lengths is not None else None,
        window,
        None,
        softcap,
    )
    out = context_attention(q, k, v, plan, method)
    (out.float() * split_sequence(x["weight"], shard, 2)).sum().backward()
    return {
        n: gather_sequence(t, shard, 2)
        for n, t in {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}.items()
    }


def run_decoder(shard, method) -> dict[str, torch.Tensor]:
    """Loss summed over every token of the batch over the global count (as one process divides),
    gradients summed over the ranks (what FSDP's reduce-scatter does)."""
    from lmforge.models import build
    from lmforge.parallel.context import ContextDocuments, context_parallel_decoder, split_batch

    model = build(DECODER, seed=3)
    batch = decoder_inputs()
    tokens = (batch["labels"] != -100).sum()
    local = split_batch(batch, shard)
    with context_parallel_decoder(model, shard, method):
        seen = []
        model.layers[0].attn.register_forward_pre_hook(lambda m, a: seen.append(type(a[2])))
        logits = model(
            local["input_ids"], segment_ids=local["segment_ids"], position_ids=local["position_ids"]
        )
    assert seen == [ContextDocuments], seen
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), local["labels"].flatten(), reduction="sum"
    )
    loss = loss / tokens
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[n] = p.grad
    return {"loss": total, **{f"grad.{n}": t for n, t in grads.items()}}


def count_bytes(shard, method) -> dict[str, int]:
    """The bytes this rank hands to the collectives over the decoder's forward and backward, as a
    ring algorithm moves them: a send whole, an all-gather or reduce-scatter C-1 of the rank's
    parts."""
    sent = {"n": 0}
    isend, all_gather, reduce_scatter = dist.isend, dist.all_gather, dist.reduce_scatter

    def counting_isend(t, *a, **k):
        sent["n"] += t.numel() * t.element_size()
        return isend(t, *a, **k)

    def counting_all_gather(parts, t, *a, **k):
        sent["n"] += (len(parts) - 1) * t.numel() * t.element_size()
        return all_gather(parts, t, *a, **k)

    def counting_reduce_scatter(out, parts, *a, **k):
        sent["n"] += (len(parts) - 1) * out.numel() * out.element_size()
        return reduce_scatter(out, parts, *a, **k)

    dist.isend, dist.all_gather, dist.reduce_scatter = (
        counting_isend,
        counting_all_gather,
        counting_reduce_scatter,
    )
    try:
        from lmforge.models import build
        from lmforge.parallel.context import context_parallel_decoder, split_batch

        model = build(DECODER, seed=3)
        local = split_batch(decoder_inputs(), shard)
        with context_parallel_decoder(model, shard, method):
            logits = model(
                local["input_ids"],
                segment_ids=local["segment_ids"],
                position_ids=local["position_ids"],
            )
        forward = sent["n"]
        logits.square().mean().backward()
    finally:
        dist.isend, dist.all_gather, dist.reduce_scatter = isend, all_gather, reduce_scatter
    return {"forward": forward, "total": sent["n"]}


def main(out: str) -> None:
    from lmforge.parallel import context_attention
    from lmforge.parallel.context import ContextShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    shard = ContextShard.of()
    results = {}
    for method in METHODS:
        # The ring runs its queries 3 at a time (tiles that do not divide the chunk), the all-gather
        # whole chunks.
        context_attention.QUERY_TILE = 3 if method == "ring" else 1024
        for kernel in KERNELS:
            context_attention.KERNEL = kernel
            for case in ATTENTION_CASES:
                results[(method, kernel, case[0])] = run_attention(shard, case, method)
        context_attention.KERNEL = "auto"
        results[(method, "packed_gqa_bf16")] = run_attention(
            shard, ATTENTION_CASES[1], method, torch.bfloat16
        )
        results[(method, "decoder")] = run_decoder(shard, method)
        counts = [None] * shard.context
        dist.all_gather_object(counts, count_bytes(shard, method))
        results[(method, "bytes")] = counts
    if shard.context == 4:
        # Two context groups of 2 inside the 4 ranks, as a mesh makes them: peers are named by
        # global rank.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = ContextShard.of(groups[dist.get_rank() // 2])
        for method in METHODS:
            got = [None] * 4
            dist.all_gather_object(got, run_attention(sub, ATTENTION_CASES[1], method))
            results[(method, "subgroups")] = [got[0], got[2]]
    if shard.rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
