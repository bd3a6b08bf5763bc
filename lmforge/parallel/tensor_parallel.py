"""Megatron-style tensor and sequence parallelism, as DTensor plans applied to a built model.

Per block (every decoder family and BERT):

    attn.qkv   column-parallel: the fused rows are laid out per key/value group
               ([kv_heads, q_per_kv + 2, head_dim], see layers.Attention), so a contiguous split
               hands each rank whole groups: its query heads with their key and value
    attn.proj  row-parallel: partial sums reduced (all-reduce, or reduce-scatter with SP)
    attn.q_norm/k_norm  (Qwen3, Gemma 3) per-head norms on this rank's heads: inputs sharded over heads,
               the weight replicated, its gradient summed over the ranks; (OLMo 2) norms over the whole
               projection: the weight split like the heads, the mean square summed over the ranks
    mlp.up/gate column-parallel; mlp.down row-parallel
    mlp (a mixture of experts: Mixtral, Qwen3-MoE) the router replicated (it sees every token, so its choices and
               losses are one process's); the stacked experts split on their intermediate rows, gate/up like
               column-parallel, down like row-parallel: each rank runs every expert on its slice, and one
               all-reduce (reduce-scatter with SP) after the weighted combine sums the slices; beside expert
               parallelism each rank runs its slice of its ep rank's experts (lmforge.parallel.expert)

Embeddings are vocabulary-parallel (each rank holds padded_vocab / TP rows); the LM head, or the
tied embedding, produces logits sharded over the vocabulary, and `loss_parallel` computes the
cross-entropy on those shards without ever gathering (batch, seq, vocab) logits.

With sequence parallelism (Korthikanti et al. 2022) the residual stream between the TP regions
is split along the sequence: norms and dropout run on 1/TP of the tokens, and each all-reduce
becomes a reduce-scatter + all-gather pair (the same bytes, 1/TP of the activation memory).
Between modules every activation stays a plain local tensor; DTensors live inside the plans.

`apply_tensor_parallel` silences one warning: torch 2.6's distribute_tensor asks on every call
whether the mesh's device keeps DTensor's RNG state, and on a CPU mesh warns "DTensor random
operators may not have complete support" for each weight it shards, though sharding draws nothing
(later releases ask only at a random op, where the warning still shows).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.layers import soft_cap
from lmforge.models.moe import MoE, grouped_experts
from lmforge.parallel.lora import with_lora


class VocabParallelProjection(nn.Module):
    """Stands in for models.layers.VocabProjection under tensor parallelism.

    `weight` (and `bias`) arrive as DTensors sharded by vocabulary row (Shard(0)), so the logits
    come out sharded over the vocabulary (Shard(-1)). The rows past vocab_size (Megatron padding,
    which the single-process model slices off) get -inf logits, so softmax and loss over the padded
    vocabulary equal those over the real one. With loss_parallel the sharded DTensor is returned
    (use it under `torch.distributed.tensor.parallel.loss_parallel()`); otherwise the logits are
    gathered and sliced to vocab_size, exactly the single-process output.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        tp_mesh,
        input_layout,
        loss_parallel: bool,
        softcap: float | None = None,
    ):
        super().__init__()
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.tp_mesh, self.input_layout, self.loss_parallel = tp_mesh, input_layout, loss_parallel
        # Gemma 2's logit cap, elementwise on each rank's shard (before the -inf padding)
        self.softcap = softcap

    def _padding(self, dtype: torch.dtype, device: torch.device) -> DTensor:
        n = self.padded_vocab_size // self.tp_mesh.size()
        first = self.tp_mesh.get_local_rank() * n
        rows = torch.arange(first, first + n, device=device)
        local = torch.zeros(n, dtype=dtype, device=device).masked_fill(
            rows >= self.vocab_size, float("-inf")
        )
        return DTensor.from_local(local, self.tp_mesh, [Shard(0)], run_check=False)

    def forward(self, h: torch.Tensor, weight: DTensor, bias: DTensor | None = None):
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, self.tp_mesh, [self.input_layout], run_check=False)
        h = h.redistribute(self.tp_mesh, [Replicate()])
        logits = F.linear(h, weight, bias)
        if self.softcap is not None:
            logits = soft_cap(logits, self.softcap)
        # contiguous, as the one-process logits (torch 2.11's pipeline stages check
        # strides)
        if not self.loss_parallel:
            return (
                logits.redistribute(self.tp_mesh, [Replicate()])
                .to_local()[..., : self.vocab_size]
                .contiguous()
            )
        if self.padded_vocab_size > self.vocab_size:
            logits = logits + self._padding(logits.dtype, logits.device)
        return logits

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, padded={self.padded_vocab_size}, loss_parallel={self.loss_parallel}"


class WholeProjectionNorm(ParallelStyle):
    """OLMo 2's q/k norm, an RMSNorm over the whole (batch, seq, heads * head_dim) projection,
    while each rank holds only its heads' columns: the input is that Shard(2) of the width, the
    weight is split the same way (Shard(0)), and DTensor sums the mean square over the ranks; the
    output is the rank's columns again."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_weight(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]))
                )

        def columns(mod, inputs, mesh):
            return (DTensor.from_local(inputs[0], mesh, [Shard(2)], run_check=False), *inputs[1:])

        return distribute_module(
            module,
            device_mesh,
            shard_weight,
            input_fn=columns,
            output_fn=lambda mod, out, mesh: out.to_local(),
        )


class ExpertSlices(ParallelStyle):
    """A MoE layer with every expert split on its intermediate rows (Megatron's tensor-parallel
    experts): gate_up (experts, 2, inter, hidden) and down (experts, hidden, inter) as Shard(2).
    The router, left to replicate_remaining, computes on every token on every rank alike. Each
    rank's grouped GEMMs give a partial sum of the output, reduced to `output_layout` (the
    residual stream's) once per layer.

    Backward: the experts' gradients with respect to the tokens and the routing weights are
    partial sums too (each rank's slice of the intermediate rows), summed over the ranks before
    they join the router's own path, which every rank computes whole (from the router losses as
    well).

    Experts that expert parallelism laid out already (lmforge.parallel.expert, over a mesh with
    this "tp" dim: split by expert and on the same intermediate rows) keep that layout and
    dispatch: the router and the reduction after the combine are this style's, as without expert
    parallelism."""

    def __init__(self, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        distribute_module(module.router, device_mesh, input_fn=_to_replicate, output_fn=_to_local)
        experts = module.experts
        if not any(isinstance(p, DTensor) for p in experts.parameters()):
            for key, param in list(experts.named_parameters()):
                owner, _, attr = key.rpartition(".")
                experts.get_submodule(owner).register_parameter(
                    attr,
                    nn.Parameter(
                        distribute_tensor(param, device_mesh, [expert_tp_placement(key)]),
                        requires_grad=param.requires_grad,
                    ),
                )
            module.dispatch = _ExpertSliceDispatch(device_mesh)
        layout = self.output_layout

        def reduce(mod, inputs, out):
            return (
                DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
                .redistribute(device_mesh, [layout])
                .to_local()
            )

        module.register_forward_hook(reduce)
        return module


# LoRA factors of the experts (lmforge.models.lora_experts) split like a linear's
# (lmforge.parallel.lora): gate_up is column-parallel (its A replicated, its B (experts, 2, inter,
# rank) split on inter like the weight), down row-parallel (its A split on inter, its B replicated);
# every other expert tensor is Shard(2).
_EXPERT_LORA = {"lora_A.gate_up": Replicate(), "lora_A.down": Shard(2), "lora_B.down": Replicate()}


def expert_tp_placement(name: str) -> Placement:
    """How tensor parallelism splits the stacked experts' tensor `name` (as
    Experts.named_parameters names it): Shard(2), the intermediate rows, or Replicate() for the
    LoRA factors that hold none (gate_up's A, down's B)."""
    return _EXPERT_LORA.get(name, Shard(2))


def grad_summed(t: torch.Tensor, mesh) -> torch.Tensor:
    """t unchanged; its gradient from here summed over the ranks of the 1-D `mesh` (identity
    forward, all-reduce backward): for a tensor every rank holds whole whose gradient each rank
    has only its slice's share of."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()]
    )


class _ExpertSliceDispatch:
    """MoE.dispatch under ExpertSlices: grouped_experts on this rank's slice of every expert. Of
    a LoRA factor that is replicated, each rank's gradient is its slice's share (gate_up's A sees
    only this rank's rows of its B, down's B only this rank's partial sum through its A): summed
    over the ranks, as x's and the routing weights'."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, x, chosen, weights, gate_up, down, act, lora=None):
        if lora is not None:
            lora = lora.map(
                lambda name, t: (
                    grad_summed(t.to_local(), self.mesh)
                    if isinstance(expert_tp_placement(name), Replicate)
                    else t.to_local()
                )
            )
        return grouped_experts(
            grad_summed(x, self.mesh),
            chosen,
            grad_summed(weights, self.mesh),
            gate_up.to_local(),
            down.to_local(),
            act,
            lora,
        )


class VocabParallelEmbedding(RowwiseParallel):
    """torch's RowwiseParallel for an embedding (rows split by vocabulary), its partial sums
    reduced synchronously.

    torch reduces them with async_op=True: the local output is then an AsyncCollectiveTensor, and
    one that enters a compiled block (trainer.compile) as its input loses its gradient edge in
    AOTAutograd: torch 2.13 unwraps such an input with trigger_wait(), which drops requires_grad
    (pytorch/pytorch#179849; the fix is PR #191113). Seen on CPU/gloo, but not device-specific: a
    bare ColwiseParallel Linear, compiled, fed `DTensor(Partial).redistribute( Replicate,
    async_op=True).to_local()` gives its input no gradient; in the model the embedding's backward
    failed with "'Tensor' object has no attribute '_local_tensor'". Here a plain tensor crosses
    into the first block, which needs the whole embedding at once anyway."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs


def _block_plan(cfg: ModelConfig, block: nn.Module, sequence_parallel: bool) -> dict:
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=seq),
    }
    if not isinstance(block.mlp, MoE):  # a MoE layer's plan is ExpertSlices (apply_tensor_parallel)
        plan["mlp.up"] = ColwiseParallel()
        plan["mlp.down"] = RowwiseParallel(output_layouts=seq)
        if cfg.gated_mlp:
            plan["mlp.gate"] = ColwiseParallel()
    if cfg.qk_norm == "head":  # q/k arrive as (batch, heads, seq, head_dim), this rank's heads only
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    elif cfg.qk_norm == "full":  # (batch, seq, heads * head_dim): this rank's heads' columns
        plan["attn.q_norm"] = WholeProjectionNorm()
        plan["attn.k_norm"] = WholeProjectionNorm()
    if sequence_parallel:
        # Attention and MLP need every token: gather the sequence shards on the way in.
        # Attention.forward(x, rope, mask, cache): only x is laid out.
        plan["attn"] = PrepareModuleInput(
            input_layouts=(seq, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        )
        for norm in ("norm1", "norm2", "post_attn_norm", "post_mlp_norm"):  # those the block has
            if getattr(block, norm, None) is not None:
                plan[norm] = SequenceParallel(use_local_output=True)
    return plan


def _to_sequence_shards() -> PrepareModuleOutput:
    """For a replicated embedding (positions, token types) added to a sequence-sharded stream: keep
    this rank's slice of the output. Its backward all-gathers, so the table's gradient is whole."""
    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))


def _top_plan(model: nn.Module, cfg: ModelConfig, sequence_parallel: bool) -> dict:
    seq = Shard(1) if sequence_parallel else Replicate()
    # rows split by vocabulary
    embed = VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=seq)
    plan: dict = {}
    if cfg.family == "bert":
        plan["embeddings.word"] = embed
        if sequence_parallel:
            plan["embeddings.position"] = _to_sequence_shards()
            plan["embeddings.token_type"] = _to_sequence_shards()
            plan["embeddings.norm"] = SequenceParallel(use_local_output=True)
            # MLMHead.forward(h, word_embeddings): its dense + norm run on whole sequences.
            plan["mlm_head"] = PrepareModuleInput(
                input_layouts=(seq, None),
                desired_input_layouts=(Replicate(), None),
                use_local_output=True,
            )
    else:
        plan["embed"] = embed
        if sequence_parallel:
            plan["pos_embed"] = _to_sequence_shards()
            plan["norm"] = SequenceParallel(use_local_output=True)
        # Its forward never runs (VocabParallelProjection reads the weight); the style shards rows.
        plan["lm_head"] = ColwiseParallel()
    return {k: v for k, v in plan.items() if _has(model, k)}  # a pipeline stage holds only some


def _has(model: nn.Module, path: str) -> bool:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return isinstance(obj, nn.Module)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model or of a pipeline stage (whose layers iterate like the
    model's)."""
    return list(model.layers)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, sequence_parallel: bool = True, loss_parallel: bool = True
) -> None:
    """Shard `model` (a Decoder, a Bert, or a pipeline stage of one) over the 1-D `tp_mesh`, in
    place.

    Shapes must divide (lmforge.parallel.mesh.check_model). With loss_parallel, the model's LM/MLM
    logits are a DTensor sharded over the padded vocabulary (padding columns at -inf): compute the
    loss, and its backward, under `loss_parallel()` (ParallelModel.loss_context()).
    """
    with warnings.catch_warnings():
        # torch 2.6 warns of DTensor's random ops for each weight it shards on a CPU mesh, though
        # sharding draws nothing (see the module docstring).
        warnings.filterwarnings(
            "ignore", message="DTensor random operators may not have complete support"
        )
        _apply_tensor_parallel(model, tp_mesh, sequence_parallel, loss_parallel)


def _apply_tensor_parallel(
    model: nn.Module, tp_mesh, sequence_parallel: bool, loss_parallel: bool
) -> None:
    cfg: ModelConfig = model.config
    seq = Shard(1) if sequence_parallel else Replicate()
    # torch's SequenceParallel makes its replicated weights trainable whatever they were: a frozen
    # norm (a LoRA run's base) would train. Frozen stays frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, _top_plan(model, cfg, sequence_parallel))
    for block in blocks(model):
        parallelize_module(
            block, tp_mesh, with_lora(block, _block_plan(cfg, block, sequence_parallel))
        )
        if isinstance(block.mlp, MoE):
            parallelize_module(block.mlp, tp_mesh, ExpertSlices(seq))
    if cfg.family == "bert":
        head = getattr(model, "mlm_head", None)
        if head is not None:
            bias = head.bias
            head.bias = nn.Parameter(
                DTensor.from_local(
                    bias.detach().chunk(tp_mesh.size())[tp_mesh.get_local_rank()].clone(),
                    tp_mesh,
                    [Shard(0)],
                    run_check=False,
                )
            )
            # The head gathered the sequence (plan above) before its dense layer.
            head.vocab_projection = VocabParallelProjection(
                cfg.vocab_size, cfg.padded_vocab_size, tp_mesh, Replicate(), loss_parallel
            )
    elif getattr(model, "vocab_projection", None) is not None:
        model.vocab_projection = VocabParallelProjection(
            cfg.vocab_size,
            cfg.padded_vocab_size,
            tp_mesh,
            seq,
            loss_parallel,
            cfg.final_logit_softcapping,
        )
    replicate_remaining(model, tp_mesh)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    if sequence_parallel:
        first = getattr(model, "embeddings", None) or getattr(model, "embed", None)
        if first is not None:  # a last stage's tied copy holds one too, but never calls it
            first.register_forward_pre_hook(_SequenceCheck(tp_mesh.size()), prepend=True)


class _SequenceCheck:
    """Sequence parallelism splits every sequence evenly over the TP ranks: say so before any
    collective (an uneven split would make the ranks' messages differ in size, which gloo/NCCL
    cannot recover from)."""

    def __init__(self, tp: int):
        self.tp = tp

    def __call__(self, module, inputs):
        length = inputs[0].shape[1]
        if length % self.tp:
            raise UserError(
                f"sequence length {length} is not divisible by parallel.tensor={self.tp}: sequence "
                f"parallelism splits each sequence evenly; pad batches to a multiple of {self.tp} "
                "(data.seq_length) or set parallel.sequence_parallel=false"
            )


def _to_replicate(module, inputs, mesh):
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _to_local(module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def replicate_remaining(model: nn.Module, tp_mesh) -> None:
    """Make every parameter the plans left alone (norms without SP, position and token-type tables,
    BERT's MLM transform and pooler, classification heads) a replicated DTensor, computing on local
    inputs.

    Their computation was already identical on every TP rank; as DTensors, every parameter of the
    model lives on the TP mesh, so optimizers (foreach kernels), gradient clipping and DCP see one
    kind of tensor instead of a mix of plain tensors and DTensors.
    """

    def partition(name, module, mesh):
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                local = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
                module.register_parameter(
                    key, nn.Parameter(local, requires_grad=param.requires_grad)
                )

    for module in list(model.modules()):
        own = [p for p in module._parameters.values() if p is not None]
        if own and not all(isinstance(p, DTensor) for p in own):
            distribute_module(
                module, tp_mesh, partition, input_fn=_to_replicate, output_fn=_to_local
            )
