"""How many bytes each rank sends per training step, by parallel dimension: the analytic model
behind the scaling table, so that a user can predict multi-node scaling before renting the nodes.

Ring collectives over n ranks send, per rank: all-reduce 2 (n-1)/n x payload; all-gather and
reduce-scatter (n-1)/n x the full (gathered) tensor. With those:

- data parallel, DDP: one all-reduce of the gradients of the rank's model part per step.
  FSDP (ZeRO-3): all-gather of the parameters for the forward and again for the backward, and a
  reduce-scatter of the gradients: 3 (n-1)/n x the part, vs DDP's 2 (n-1)/n.
- tensor parallel (Megatron, Shoeybi et al. 2019; with sequence parallelism, Korthikanti et al.
  2022): per layer and micro batch, two all-reduces in the forward and two in the backward of the
  (micro, seq, hidden) activations; sequence parallelism replaces each by an all-gather plus a
  reduce-scatter of the same total volume, so the bytes are the same and only the memory changes.
  The vocab-parallel embedding and the head's input add one such exchange each.
- pipeline parallel: each micro batch crosses each stage boundary forward (activations) and
  backward (their gradients); with v virtual stages per rank it crosses v times as many
  (Narayanan et al. 2021: interleaving multiplies the point-to-point volume by v). A middle rank
  sends both ways at each of its v stages (2v sends per micro batch); with 2 pipeline ranks every
  rank holds an end of the pipeline, whose first stage sends no gradient and last no activation
  (2v - 1).

- expert parallel (`expert_bytes`): each MoE layer sends every routed (token, expert) row whose expert lives on
  another rank there and gets its output back (two all-to-alls forward), and the same rows' gradients both ways
  in the backward; with balanced routing (E-1)/E of the rows leave the rank. The ranks holding the same experts
  (data / E of them) all-reduce the experts' gradients once per step.

Counts are per step of `global_batch_size` sequences, for the busiest rank (the first pipeline
stage carries the embedding). Payloads without the ring factor are given too (`payload_*`): they
are what the collectives are handed, which tests check against a real run.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.config import ModelConfig


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1  # data-parallel size (replicas or shards)
    data_parallel: str = "ddp"  # ddp | fsdp
    virtual_stages: int = 1
    sequence_parallel: bool = True

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


def stage_parameters(cfg: ModelConfig, layout: Layout) -> tuple[int, int]:
    """(block parameters, embedding/head parameters) held by the busiest rank: its layers' share of
    the blocks split by TP (norms replicated), and the vocabulary-parallel embedding, learned
    positions and untied head (all on one rank when there is no pipeline; the first stage otherwise)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    attn = d * qkv + cfg.num_heads * hd * d + (qkv if cfg.qkv_bias else 0) + (d if cfg.attention_bias else 0)
    mlp = d * f * (3 if cfg.gated_mlp else 2) + ((f * (2 if cfg.gated_mlp else 1) + d) if cfg.mlp_bias else 0)
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    norms = norm * (1 if cfg.shared_norm else 2)
    layers = -(-cfg.num_layers // layout.pipeline)
    ends = cfg.padded_vocab_size * d // layout.tensor + norm
    if cfg.position_embedding == "learned":
        ends += cfg.max_position_embeddings * d
    if not cfg.tie_embeddings and layout.pipeline == 1:
        ends += cfg.padded_vocab_size * d // layout.tensor
    return layers * ((attn + mlp) // layout.tensor + norms), ends


def step_bytes(cfg: ModelConfig, layout: Layout, seq_length: int, global_batch_size: int,
               micro_batch_size: int, param_bytes: int = 2, grad_bytes: int = 4,
               activation_bytes: int = 2, reduce_scatter_as_all_reduce: bool = False) -> dict[str, float]:
    """Bytes the busiest rank sends per step, by dimension ("data", "tensor", "pipeline", "total"),
    and the payloads handed to the collectives ("payload_data", ...).

    reduce_scatter_as_all_reduce: gloo (CPU) runs a reduce-scatter as a full all-reduce, twice NCCL's
    bytes (measured: tests/parallel/test_comm_volume.py), FSDP's gradient reduce-scatter and sequence
    parallelism's alike; set it to predict CPU runs."""
    t, p, n, v = layout.tensor, layout.pipeline, layout.data, layout.virtual_stages
    if global_batch_size % (micro_batch_size * n):
        raise ValueError(f"global batch {global_batch_size} is not a multiple of micro {micro_batch_size} x data {n}")
    micro_batches = global_batch_size // (micro_batch_size * n)
    blocks, ends = stage_parameters(cfg, layout)
    act = micro_batch_size * seq_length * cfg.hidden_size * activation_bytes  # one (b, s, h) tensor

    if n == 1:
        payload_data = data = 0.0
    elif layout.data_parallel == "fsdp":
        # Every micro batch gathers each block's parameters twice (forward, then again for the backward:
        # blocks reshard after forward) and the root's once (FSDP2 keeps the root unsharded between
        # forward and backward); gradients are reduce-scattered after every micro batch (holding them
        # unsharded until the last would keep the whole model's gradients on every rank).
        gathers = micro_batches * (2 * blocks + ends) * param_bytes
        scatter = micro_batches * (blocks + ends) * grad_bytes * (2 if reduce_scatter_as_all_reduce else 1)
        payload_data = gathers + micro_batches * (blocks + ends) * grad_bytes
        data = (n - 1) / n * (gathers + scatter)
    else:  # DDP: one all-reduce of all gradients per step (no_sync on the other micro batches)
        payload_data = (blocks + ends) * grad_bytes
        data = 2 * (n - 1) / n * payload_data
    layers = -(-cfg.num_layers // p)
    # All-reduces of one (b, s, h) activation per micro batch: 2 per layer forward (attention and MLP
    # outputs) and 2 backward (their inputs' gradients), the embedding's output, the head's input gradient.
    exchanges = 4 * layers + 2
    payload_tensor = micro_batches * exchanges * act if t > 1 else 0.0
    if layout.sequence_parallel:  # each all-reduce is an all-gather plus a reduce-scatter
        tensor = (t - 1) / t * payload_tensor * (1 + (2 if reduce_scatter_as_all_reduce else 1))
    else:
        tensor = 2 * (t - 1) / t * payload_tensor
    # Activations forward and gradients backward, across v boundaries per rank; sequence parallel
    # sends the rank's sequence shard only.
    boundary = act / t if layout.sequence_parallel and t > 1 else act
    sends = 2 * v if p > 2 else 2 * v - 1
    pipeline = micro_batches * sends * boundary if p > 1 else 0.0
    out = {"data": data, "tensor": tensor, "pipeline": pipeline}
    out["total"] = sum(out.values())
    out.update(payload_data=payload_data, payload_tensor=payload_tensor, payload_pipeline=pipeline,
               micro_batches=micro_batches, block_parameters=blocks, end_parameters=ends)
    return out


def expert_bytes(cfg: ModelConfig, expert: int, data: int, tokens: int, micro_batches: int = 1,
                 activation_bytes: int = 2, grad_bytes: int = 4, routed: float | None = None) -> dict[str, float]:
    """Bytes one rank sends per step under expert parallelism (parallel.expert=`expert` over `data` data-parallel
    ranks): "all_to_all", the token rows the MoE layers exchange, and "expert_grads", the all-reduce of the experts'
    gradients over the ranks holding the same ones. `tokens` per micro-batch. `routed`: the rows that left this rank
    for other ranks' experts plus those that arrived from other ranks, over the step's MoE layers and micro-batches,
    if known (a real routing); else balanced routing, tokens x experts_per_token x (E-1)/E each way."""
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if routed is None:
        routed = micro_batches * layers * 2 * tokens * cfg.experts_per_token * (expert - 1) / expert
    # Forward: the rank's rows out and the others' outputs back; backward: the gradients of both, the other way.
    all_to_all = 2 * routed * cfg.hidden_size * activation_bytes
    replicas = data // expert
    local = layers * (cfg.num_experts // expert) * 3 * cfg.hidden_size * (cfg.moe_intermediate_size or 0)
    grads = 2 * (replicas - 1) / replicas * local * grad_bytes  # once per step, after the last micro-batch
    return {"all_to_all": all_to_all, "expert_grads": grads}


def bytes_sent() -> int | None:
    """Bytes this process has written through write()/writev() so far (Linux /proc/self/io `wchar`),
    None elsewhere. gloo sends over TCP with writev, so the difference across a training step on
    CPU is the rank's real wire volume (plus any file writes in between, which a step has none of);
    NCCL traffic on GPUs does not pass through it."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
