"""How many bytes each rank sends per training step, by parallel dimension: the analytic model
behind the scaling table, so that a user can predict multi-node scaling before renting the nodes.

Ring collectives over n ranks send, per rank: all-reduce 2 (n-1)/n x payload; all-gather and
reduce-scatter (n-1)/n x the full (gathered) tensor. With those:

- data parallel, DDP: one all-reduce of the gradients of the rank's model part per step.
  FSDP (ZeRO-3): all-gather of the parameters for the forward and again for the backward, and a
  reduce-scatter of the gradients: 3 (n-1)/n x the part, vs DDP's 2 (n-1)/n. FSDP2 pays it every
  micro batch: each block's parameters gathered twice (blocks reshard after forward), the root's
  once (FSDP2 keeps the root unsharded from forward to backward), and the gradients
  reduce-scattered after every micro batch (holding them unsharded until the last would keep the
  whole model's gradients on every rank).
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

- expert parallel (`expert_bytes`): each MoE layer sends every routed (token, expert) row whose
  expert lives on another rank there and gets its output back (two all-to-alls forward), and the
  same rows' gradients both ways in the backward; with balanced routing (E-1)/E of the rows leave
  the rank. The data / E ranks holding the same experts reduce the experts' gradients once per step:
  under DDP one all-reduce; under FSDP2 the experts are sharded over F of them
  (lmforge.parallel.mesh.expert_shards) and replicated over the other R: all-gathers of the rank's
  experts per micro batch (forward and backward; once per step in a pipeline, which keeps them
  gathered), a reduce-scatter over F and an all-reduce of the shard over R once per step. Data
  parallelism's own bytes (`step_bytes`, Layout.expert > 1) then leave the experts out, and its
  "expert" entry adds them. Beside tensor parallelism (T ranks) every tensor-parallel rank routes
  the whole micro-batch and exchanges its rows with the ranks of its own tensor coordinate: the
  all-to-all bytes per rank are those without TP, the experts' weights and gradients per rank 1 / T
  of them.
- a MoE layer under tensor parallelism also all-reduces its routing weights' gradient in the
  backward (tokens x experts_per_token, fp32), and its input's gradient with an all-reduce, not a
  reduce-scatter, under sequence parallelism (the same bytes on gloo, which runs a reduce-scatter as
  an all-reduce).
- context parallel (`context_bytes`, lmforge.parallel.context): per layer and micro batch, each of
  the C ranks holds 1/C of the sequence's keys and values. All-gather: the forward gathers K and V,
  (C-1)/C of the whole sequence's, that is C-1 of the rank's blocks; the backward reduce-scatters
  their fp32 gradients, C-1 blocks. Ring: the forward passes C-1 K/V blocks on; the backward passes
  C-1 again and C-1 blocks of fp32 dK/dV beside them. A packed batch's segment ids are all-gathered
  once per forward. Recomputed layers (activation checkpointing) pay their forward again.

Counts are per step of `global_batch_size` sequences, for the busiest rank (the first pipeline
stage carries the embedding). Payloads without the ring factor are given too (`payload_*`): they
are what the collectives are handed, which tests check against a real run.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.config import ModelConfig
from lmforge.parallel.mesh import fsdp_shards_experts


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1  # data-parallel size (replicas or shards)
    data_parallel: str = "ddp"  # ddp | fsdp
    virtual_stages: int = 1
    sequence_parallel: bool = True
    # parallel.expert: a MoE model's experts split over this many data-parallel ranks
    expert: int = 1
    data_replicate: int = 1  # HSDP's replicas among `data` (FSDP): where the experts' copies are

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data


def _layer_parameters(cfg: ModelConfig, layer: int, tensor: int, with_experts: bool) -> int:
    """One block's parameters on a rank: attention and MLP split by TP, norms replicated. A MoE
    layer's MLP is its router (replicated under TP) and its stacked experts (split on their
    intermediate rows), the latter left out when expert parallelism holds them (`with_experts`
    False)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    attn = (
        d * qkv
        + cfg.num_heads * hd * d
        + (qkv if cfg.qkv_bias else 0)
        + (d if cfg.attention_bias else 0)
    )
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    norms = norm * (1 if cfg.shared_norm else 2)
    if cfg.is_moe_layer(layer):
        experts = expert_parameters(cfg, [layer]) if with_experts else 0
        return (attn + experts) // tensor + d * cfg.num_experts + norms
    mlp = d * f * (3 if cfg.gated_mlp else 2) + (
        (f * (2 if cfg.gated_mlp else 1) + d) if cfg.mlp_bias else 0
    )
    return (attn + mlp) // tensor + norms


def expert_parameters(cfg: ModelConfig, layers) -> int:
    """The stacked experts' parameters (gate, up, down of every expert) of the MoE layers among
    `layers`."""
    moe = sum(cfg.is_moe_layer(i) for i in layers)
    return moe * cfg.num_experts * 3 * cfg.hidden_size * (cfg.moe_intermediate_size or 0)


def stage_parameters(cfg: ModelConfig, layout: Layout) -> tuple[int, int]:
    """(block parameters, embedding/head parameters) held by the busiest rank and reduced by data
    parallelism: its layers' share of the blocks split by TP (norms, MoE routers replicated), a
    MoE layer's experts counted as experts, not a dense MLP (and left out under expert
    parallelism, which reduces them itself: expert_bytes), and the vocabulary-parallel embedding,
    learned positions and untied head (all on one rank when there is no pipeline; the first stage
    otherwise)."""
    d = cfg.hidden_size
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    layers = -(-cfg.num_layers // layout.pipeline)  # the first stage's
    blocks = sum(
        _layer_parameters(cfg, i, layout.tensor, layout.expert == 1) for i in range(layers)
    )
    ends = cfg.padded_vocab_size * d // layout.tensor + norm
    if cfg.position_embedding == "learned":
        ends += cfg.max_position_embeddings * d
    if not cfg.tie_embeddings and layout.pipeline == 1:
        ends += cfg.padded_vocab_size * d // layout.tensor
    return blocks, ends


def step_bytes(
    cfg: ModelConfig,
    layout: Layout,
    seq_length: int,
    global_batch_size: int,
    micro_batch_size: int,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    activation_bytes: int = 2,
    reduce_scatter_as_all_reduce: bool = False,
) -> dict[str, float]:
    """Bytes the busiest rank sends per step, by dimension ("data", "tensor", "pipeline",
    "expert", "total"), and the payloads handed to the collectives ("payload_data", ...).
    "expert": expert parallelism's (Layout.expert > 1; expert_bytes with balanced routing), whose
    experts "data" leaves out.

    reduce_scatter_as_all_reduce: gloo (CPU) runs a reduce-scatter as a full all-reduce, twice
    NCCL's bytes (measured: tests/parallel/test_comm_volume.py), FSDP's gradient reduce-scatter
    and sequence parallelism's alike; set it to predict CPU runs."""
    t, p, n, v = layout.tensor, layout.pipeline, layout.data, layout.virtual_stages
    if global_batch_size % (micro_batch_size * n):
        raise ValueError(
            f"global batch {global_batch_size} is not a multiple of micro {micro_batch_size} x data {n}"
        )
    micro_batches = global_batch_size // (micro_batch_size * n)
    blocks, ends = stage_parameters(cfg, layout)
    act = micro_batch_size * seq_length * cfg.hidden_size * activation_bytes  # one (b, s, h) tensor

    if n == 1:
        payload_data = data = 0.0
    elif layout.data_parallel == "fsdp":
        # Per micro batch: blocks gathered twice (they reshard after forward), the root once, the
        # gradients reduce-scattered (the FSDP bullet of the module docstring says why).
        gathers = micro_batches * (2 * blocks + ends) * param_bytes
        scatter = (
            micro_batches
            * (blocks + ends)
            * grad_bytes
            * (2 if reduce_scatter_as_all_reduce else 1)
        )
        payload_data = gathers + micro_batches * (blocks + ends) * grad_bytes
        data = (n - 1) / n * (gathers + scatter)
    else:  # DDP: one all-reduce of all gradients per step (no_sync on the other micro batches)
        payload_data = (blocks + ends) * grad_bytes
        data = 2 * (n - 1) / n * payload_data
    layers = -(-cfg.num_layers // p)
    # (b, s, h) all-reduces per micro batch: 4 a layer (attention and MLP outputs forward, their
    # inputs' gradients backward), the embedding's output and the head's input gradient.
    exchanges = 4 * layers + 2
    payload_tensor = micro_batches * exchanges * act if t > 1 else 0.0
    if layout.sequence_parallel:  # each all-reduce is an all-gather plus a reduce-scatter
        tensor = (t - 1) / t * payload_tensor * (1 + (2 if reduce_scatter_as_all_reduce else 1))
    else:
        tensor = 2 * (t - 1) / t * payload_tensor
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(layers)) if t > 1 else 0
    # (module docstring) the routing weights' gradient; SP's all-reduce of the input's
    # gradient
    if moe_layers:
        weights = (
            micro_batches * moe_layers * micro_batch_size * seq_length * cfg.experts_per_token * 4
        )
        payload_tensor += weights
        tensor += 2 * (t - 1) / t * weights
        if layout.sequence_parallel and not reduce_scatter_as_all_reduce:
            tensor += (t - 1) / t * micro_batches * moe_layers * act
    # Activations forward and gradients backward, across v boundaries per rank; sequence parallel
    # sends the rank's sequence shard only.
    boundary = act / t if layout.sequence_parallel and t > 1 else act
    sends = 2 * v if p > 2 else 2 * v - 1
    pipeline = micro_batches * sends * boundary if p > 1 else 0.0
    expert = 0.0
    if layout.expert > 1:
        tokens = micro_batch_size * seq_length
        e = expert_bytes(
            cfg,
            layout.expert,
            n,
            tokens,
            micro_batches,
            activation_bytes,
            grad_bytes,
            data_parallel=layout.data_parallel,
            data_replicate=layout.data_replicate,
            param_bytes=param_bytes,
            pipeline=p,
            tensor=t,
            reduce_scatter_as_all_reduce=reduce_scatter_as_all_reduce,
        )
        expert = sum(e.values())
    out = {"data": data, "tensor": tensor, "pipeline": pipeline, "expert": expert}
    out["total"] = sum(out.values())
    out.update(
        payload_data=payload_data,
        payload_tensor=payload_tensor,
        payload_pipeline=pipeline,
        micro_batches=micro_batches,
        block_parameters=blocks,
        end_parameters=ends,
    )
    return out


def expert_bytes(
    cfg: ModelConfig,
    expert: int,
    data: int,
    tokens: int,
    micro_batches: int = 1,
    activation_bytes: int = 2,
    grad_bytes: int = 4,
    routed: float | None = None,
    data_parallel: str = "ddp",
    data_replicate: int = 1,
    param_bytes: int = 2,
    pipeline: int = 1,
    tensor: int = 1,
    reduce_scatter_as_all_reduce: bool = False,
) -> dict[str, float]:
    """Bytes one rank sends per step under expert parallelism (parallel.expert=`expert` over
    `data` data-parallel ranks, `data_replicate` of them HSDP's replicas), by kind: "all_to_all",
    the token rows the MoE layers exchange; "expert_grads", the reduction of the experts'
    gradients over the ranks holding the same ones (DDP: an all-reduce; FSDP: a reduce-scatter,
    then an all-reduce of the shard over the replicas); "expert_gathers", FSDP's all-gathers of
    the rank's experts (`param_bytes` each: bf16 under bf16-mixed). `tokens` per micro-batch;
    `pipeline`: the rank holds the first of that many stages' layers and gathers its experts once
    per step; `tensor`: each expert's intermediate rows split over that many tensor-parallel
    ranks, each of which exchanges the micro-batch's rows with the ranks of its tensor
    coordinate. `routed`: the rows that left this rank for other ranks' experts plus those that
    arrived from other ranks, over the step's MoE layers and micro-batches, if known (a real
    routing); else balanced routing, tokens x experts_per_token x (E-1)/E each way.
    reduce_scatter_as_all_reduce: gloo's (see step_bytes)."""
    stage = range(-(-cfg.num_layers // pipeline))
    layers = sum(cfg.is_moe_layer(i) for i in stage)
    if routed is None:
        routed = micro_batches * layers * 2 * tokens * cfg.experts_per_token * (expert - 1) / expert
    # Forward: the rank's rows out and the others' outputs back; backward: the gradients of both,
    # the other way.
    all_to_all = 2 * routed * cfg.hidden_size * activation_bytes
    # this rank's experts (its rows of them)
    local = expert_parameters(cfg, stage) // expert // tensor
    same = data // expert  # ranks holding the same experts
    if data_parallel == "fsdp" and fsdp_shards_experts():  # lmforge.parallel.mesh.expert_shards
        shard_dim = data // data_replicate
        shard = shard_dim // expert if shard_dim % expert == 0 else 1
    else:
        shard = 1
    replicas = same // shard
    # forward and backward of each micro batch
    gathers_per_step = 1 if pipeline > 1 else 2 * micro_batches
    gathers = gathers_per_step * (shard - 1) / shard * local * param_bytes
    scatter = (shard - 1) / shard * local * grad_bytes * (2 if reduce_scatter_as_all_reduce else 1)
    # Once per step, after the last micro-batch: the shard's all-reduce over the replicas (every
    # copy under DDP).
    grads = scatter + 2 * (replicas - 1) / replicas * local / shard * grad_bytes
    return {"all_to_all": all_to_all, "expert_grads": grads, "expert_gathers": gathers}


def context_bytes(
    cfg: ModelConfig,
    context: int,
    seq_length: int,
    micro_batch: int,
    method: str,
    kv_bytes: int = 2,
    packed: bool = False,
    recompute: bool = False,
    layers: int | None = None,
) -> dict[str, float]:
    """Bytes one rank sends per micro batch under context parallelism over `context` ranks (see
    the module docstring): "forward", "backward" and "total". `kv_bytes`: the keys' and values'
    element size (the model's activation dtype); their gradients travel in fp32. `layers`: the
    rank's layers (all of the model's if None). `packed`: segment ids (int64) are gathered too."""
    if method not in ("allgather", "ring"):
        raise ValueError(f"unknown context-parallel method {method!r}")
    layers = cfg.num_layers if layers is None else layers
    # K and V, elements
    block = 2 * micro_batch * cfg.num_kv_heads * cfg.head_dim * seq_length // context
    hops = context - 1
    forward = layers * hops * block * kv_bytes
    grads = layers * hops * block * 4
    backward = grads if method == "allgather" else grads + forward
    if recompute:
        backward += forward
    if packed:
        forward += hops * micro_batch * seq_length // context * 8
    return {"forward": forward, "backward": backward, "total": forward + backward}


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
