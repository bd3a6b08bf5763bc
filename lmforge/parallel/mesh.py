"""The parallel layout: a ParallelConfig and the DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp",
"tp") it makes.

Dimension order follows Megatron/torchtitan: tensor parallelism innermost (neighbouring ranks,
the same node, the fastest links), then context parallelism (a ring or all-gather of keys/values
per layer), then the data dims, pipeline outermost (its point-to-point traffic is the smallest and
tolerates the slowest links). The ranks of a context group read the same samples and split each
sequence; FSDP2 shards parameters over data_shard x context folded into one dim ("dp_shard_cp", as
torchtitan does), so their gradients are reduced over both.

Every check a user can fail runs before any collective, on every rank alike, so a bad layout
ends all ranks with the same one-line UserError instead of a hang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmforge.config import closest
from lmforge.errors import UserError
from lmforge.models.config import ModelConfig

log = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# data_shard x context as one dim of the mesh: FSDP2 shards over it (build_mesh makes it)
SHARD_CONTEXT = "dp_shard_cp"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CONTEXT_METHODS = ("ring", "allgather")  # lmforge.parallel.context_attention.METHODS


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ParallelConfig:
    """`parallel.*` in a run config. data_shard=-1 takes whatever the other dims leave of the
    world."""

    pipeline: int = 1  # pipeline stages, the model split by layer (torch.distributed.pipelining)
    data_replicate: int = 1  # DDP-like replicas (HSDP's replicate dim when data_shard > 1)
    # FSDP2 shards parameters, gradients and optimizer state over this dim (x parallel.context)
    data_shard: int = -1
    # Megatron tensor parallelism: column/row-parallel linears, vocabulary-parallel head
    tensor: int = 1
    # with tensor > 1: norms/dropout on sequence shards (Megatron SP)
    sequence_parallel: bool = True
    # with tensor > 1: cross-entropy on vocabulary shards, no full logits
    loss_parallel: bool = True
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    # per pipeline step; 0: a run derives it, global / (micro x data-parallel size)
    microbatches: int = 0
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b needs >= 2)
    # FSDP2 under bf16-mixed all-gathers bf16 parameters (half the bytes of fp32); gradients are
    # reduce-scattered in this dtype: fp32 (torchtitan's default: sums of many ranks' bf16 gradients
    # lose bits) or bf16.
    fsdp_reduce_dtype: str = "fp32"
    # Mixture-of-experts layers: each expert lives on one of this many data-parallel ranks (the
    # others send it their tokens with all-to-all; beside parallel.tensor its intermediate rows
    # split over the tensor ranks as ever); 1 keeps every expert on every rank. See
    # lmforge/parallel/expert.py.
    expert: int = 1
    # context parallelism: every sequence split over this many ranks in load-balanced chunks, the
    # layers attending across them (lmforge/parallel/context.py); 1 holds each sequence whole
    context: int = 1
    context_method: str = "ring"  # ring | allgather: how keys/values cross the context ranks

    def __post_init__(self) -> None:
        if self.pipeline_schedule not in SCHEDULES:
            hint = closest(self.pipeline_schedule, SCHEDULES)
            raise UserError(
                f"unknown parallel.pipeline_schedule '{self.pipeline_schedule}'{hint}: "
                f"choose one of {', '.join(SCHEDULES)}"
            )
        for name in ("pipeline", "data_replicate", "tensor", "virtual_stages", "expert", "context"):
            if getattr(self, name) < 1:
                raise UserError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.context_method not in CONTEXT_METHODS:
            hint = closest(self.context_method, CONTEXT_METHODS)
            raise UserError(
                f"unknown parallel.context_method '{self.context_method}'{hint}: "
                f"choose one of {', '.join(CONTEXT_METHODS)}"
            )
        if self.fsdp_reduce_dtype not in REDUCE_DTYPES:
            raise UserError(
                f"parallel.fsdp_reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, "
                f"got {self.fsdp_reduce_dtype!r}"
            )
        if self.data_shard == 0 or self.data_shard < -1:
            raise UserError(
                f"parallel.data_shard must be >= 1 or -1 (the rest of the world), got {self.data_shard}"
            )
        if (
            self.pipeline_schedule == "interleaved_1f1b"
            and self.pipeline > 1
            and self.virtual_stages < 2
        ):
            raise UserError(
                "parallel.pipeline_schedule=interleaved_1f1b needs parallel.virtual_stages >= 2: "
                "set it, or use 1f1b"
            )
        if self.pipeline_schedule != "interleaved_1f1b" and self.virtual_stages > 1:
            raise UserError(
                f"parallel.virtual_stages={self.virtual_stages} needs "
                "parallel.pipeline_schedule=interleaved_1f1b"
            )

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or self.pipeline * self.virtual_stages

    def resolved(self, world_size: int) -> ParallelConfig:
        """A copy with data_shard filled in; UserError when the layout does not divide the world."""
        fixed = self.pipeline * self.data_replicate * self.context * self.tensor
        dims = (
            f"parallel.pipeline={self.pipeline} x data_replicate={self.data_replicate} x "
            f"context={self.context} x tensor={self.tensor}"
        )
        shard = self.data_shard
        if shard == -1:
            if world_size % fixed:
                raise UserError(
                    f"{dims} = {fixed} does not divide the world size {world_size}: "
                    "change the layout or the number of processes"
                )
            shard = world_size // fixed
        if fixed * shard != world_size:
            raise UserError(
                f"parallel layout pipeline={self.pipeline} x data_replicate={self.data_replicate} x "
                f"data_shard={shard} x context={self.context} x tensor={self.tensor} = "
                f"{fixed * shard} processes, but the world has {world_size}: make the product equal "
                "the number of processes (data_shard=-1 fills in the rest)"
            )
        return ParallelConfig(**{**self.__dict__, "data_shard": shard})

    @property
    def shards_model(self) -> bool:
        """Whether a rank holds only part of the model (tensor, pipeline or FSDP shards), not a
        whole replica."""
        return self.tensor > 1 or self.pipeline > 1 or self.data_shard > 1 or self.context > 1

    @property
    def data_parallel(self) -> int:
        """The data-parallel size: how many slices the global batch is read in (the ranks of a
        context group read the same samples)."""
        return self.data_replicate * max(self.data_shard, 1)

    @property
    def fsdp_shards(self) -> int:
        """How many ranks FSDP2 shards a parameter over: data_shard x context."""
        return max(self.data_shard, 1) * self.context


def check_model(cfg: ParallelConfig, model: ModelConfig) -> None:
    """UserError when the model's shapes cannot be split as `cfg` asks (run on every rank, before
    any collective)."""
    tp, pp = cfg.tensor, cfg.pipeline
    if cfg.context > 1:
        from lmforge.parallel.context import check_context

        check_context(cfg, model)
    if cfg.expert > 1:
        check_expert(cfg, model)
    if tp > 1 and model.family == "bert" and torch_version() < (2, 11):
        raise UserError(
            f"BERT under tensor parallelism needs torch 2.11 or later (on 2.6-2.10 DTensor's backward "
            f"gives the token-type embedding the word embedding's gradient shape); this is torch "
            f"{torch_release()}: upgrade torch, or set parallel.tensor=1"
        )
    if tp > 1:
        splits = ("num_heads", "num_kv_heads", "intermediate_size") + (
            ("moe_intermediate_size",) if model.num_experts else ()
        )
        for name in splits:
            if getattr(model, name) % tp:
                raise UserError(
                    f"model.{name}={getattr(model, name)} is not divisible by parallel.tensor={tp}: "
                    f"tensor parallelism splits {name.replace('num_', '')} evenly; pick a tensor degree "
                    "that divides it"
                )
        # Each rank's vocabulary shard must be a whole number of `unit` rows (Megatron: 128). The
        # config pads to make_vocab_size_divisible_by alone, so that multiple must already include
        # TP (128 x TP), as Megatron's padding to make_vocab_size_divisible_by x TP does; a multiple
        # below 128 (a toy vocabulary) asks for shards of that many rows only.
        multiple = max(1, model.make_vocab_size_divisible_by)
        unit = min(multiple, 128)
        if model.padded_vocab_size % (unit * tp):
            raise UserError(
                f"the padded vocabulary ({model.padded_vocab_size} rows: vocab_size {model.vocab_size} "
                f"rounded up to make_vocab_size_divisible_by={multiple}) is not a multiple of {unit} x "
                f"parallel.tensor {tp} = {unit * tp}: set model.make_vocab_size_divisible_by="
                f"{unit * tp} (Megatron multiplies by TP itself; here the padding is the model's, so "
                "that a checkpoint resumes at any layout: set it once for the largest TP you will use)"
            )
        if cfg.sequence_parallel and model.num_labels:
            raise UserError(
                "parallel.sequence_parallel needs an LM/MLM head, the model has a classification head: "
                "set parallel.sequence_parallel=false"
            )
    if pp > 1:
        chunks = pp * cfg.virtual_stages
        if model.num_layers % chunks:
            raise UserError(
                f"model.num_layers={model.num_layers} is not divisible by parallel.pipeline={pp} x "
                f"virtual_stages={cfg.virtual_stages} = {chunks}: each pipeline stage holds the same "
                "number of layers; change the pipeline degree or virtual_stages"
            )


def check_expert(cfg: ParallelConfig, model: ModelConfig) -> None:
    """UserError when parallel.expert cannot split the model's experts over the data-parallel
    ranks."""
    ep = cfg.expert
    if not model.num_experts:
        raise UserError(
            f"parallel.expert={ep} needs a mixture-of-experts model, {model.family} has no experts "
            "(model.num_experts=0): set parallel.expert=1"
        )
    if model.num_experts % ep:
        raise UserError(
            f"model.num_experts={model.num_experts} is not divisible by parallel.expert={ep}: each "
            "expert-parallel rank holds the same number of experts; pick a degree that divides it"
        )
    if cfg.data_parallel % ep:
        raise UserError(
            f"parallel.expert={ep} does not divide the data-parallel size {cfg.data_parallel} "
            f"(data_replicate={cfg.data_replicate} x data_shard={cfg.data_shard}): experts are split "
            "over data-parallel ranks; pick a degree that divides it"
        )
    if cfg.data_shard > 1 and not _fully_shard_ignores_params():
        raise UserError(
            f"parallel.expert={ep} under FSDP2 (data_shard={cfg.data_shard}) needs torch 2.7 or later "
            f"(FSDP2 leaves the experts to expert parallelism through fully_shard's ignored_params); "
            f"this is torch {torch_release()}: upgrade torch, or set "
            f"parallel.data_replicate={cfg.data_parallel} parallel.data_shard=1 (DDP)"
        )


def _fully_shard_ignores_params() -> bool:
    import inspect

    from torch.distributed.fsdp import fully_shard

    return "ignored_params" in inspect.signature(fully_shard).parameters


def torch_release() -> str:
    """This torch's release, without its build tag ("2.11.0", not "2.11.0+cu130"): for the
    messages that name it."""
    return torch.__version__.split("+")[0]


def torch_version() -> tuple[int, int]:
    return tuple(int(part) for part in torch_release().split(".")[:2])


def fsdp_shards_experts() -> bool:
    """Whether this torch's FSDP2 can shard expert-parallel weights over the other ranks holding
    them: they are DTensors on the expert mesh, and FSDP2 takes the dims to shard over from that
    mesh only through DataParallelMeshDims (torch 2.12). Before it those ranks keep whole copies
    and all-reduce their gradients."""
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "DataParallelMeshDims")


def expert_shards(cfg: ParallelConfig) -> tuple[int, int]:
    """(replicate, shard): how the data_parallel / expert ranks holding the same experts split
    under FSDP2. Sharded over the data_shard ranks that hold them (data_shard / expert, where
    expert divides data_shard), replicated over the rest (HSDP's replicas; all of them under DDP,
    data_shard = 1, where an expert group spans replicas, or where this torch's FSDP2 cannot
    shard them: fsdp_shards_experts)."""
    shard = (
        cfg.data_shard // cfg.expert
        if cfg.data_shard % cfg.expert == 0 and fsdp_shards_experts()
        else 1
    )
    return cfg.data_parallel // cfg.expert // shard, shard


def dim_size(mesh, name: str) -> int:
    """The size of `mesh`'s dim `name`."""
    return mesh.size(mesh.mesh_dim_names.index(name))


def dim_mesh(mesh, name: str):
    """The 1-D mesh of `mesh`'s dim `name` through this rank. torch 2.6 slices only a root mesh:
    a slice of one (expert_mesh's) has its root sliced instead, the same ranks."""
    if hasattr(mesh, "_get_root_mesh"):  # torch 2.7+: a slice of a mesh can be sliced again
        return mesh[name]
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)[name]


def expert_mesh(mesh, cfg: ParallelConfig):
    """This pipeline stage's DeviceMesh ("ep_replicate", "ep", "ep_shard") of expert parallelism
    over `mesh`'s data-parallel ranks: "ep" groups parallel.expert neighbouring ones (the
    innermost data dim's, the fastest links), "ep_shard" x "ep_replicate" are the ranks holding
    the same experts (expert_shards). "ep" comes before "ep_shard" in the mesh (not in rank
    order) so that an expert weight sharded by both is Shard(0), Shard(0): each rank's piece one
    box of the whole weight. Under tensor parallelism ("ep_replicate", "ep", "tp", "ep_shard"):
    an "ep" group is the ranks of one tensor-parallel coordinate (they exchange tokens), "tp"
    splits each expert's intermediate rows as tensor parallelism alone does, and comes before
    "ep_shard" for the same reason (FSDP2 may shard the experts along those rows too:
    expert_shard_placement). Every rank must call this (it creates every stage's process groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    replicate, shard = expert_shards(cfg)
    # A stage's data-parallel ranks: replicas outer, shards inner; each data rank's tensor-parallel
    # ranks innermost.
    ranks = mesh.mesh.reshape(cfg.pipeline, replicate, shard, cfg.expert, cfg.tensor)
    names = ["pp", "ep_replicate", "ep", "tp", "ep_shard"]
    if fsdp_shards_experts():
        ranks = ranks.permute(0, 1, 3, 4, 2)
    # "ep_shard" is one rank (expert_shards); torch before 2.12 slices dims only in their
    # ranks' stride order
    else:
        names = ["pp", "ep_replicate", "ep_shard", "ep", "tp"]
    if cfg.tensor == 1:
        ranks, names = ranks.squeeze(names.index("tp")), [n for n in names if n != "tp"]
    full = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(names))
    _inherit_timeout(full, mesh.device_type)
    return full[tuple(names[1:])]


def build_mesh(
    cfg: ParallelConfig,
    model: ModelConfig | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
):
    """The DeviceMesh for `cfg` (dims MESH_DIMS, size-1 dims included) after checking the layout.

    The default process group must exist already (lmforge.parallel.init_world): DeviceMesh would
    otherwise create one itself, without our timeout. None for one process without a process group.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    cfg = cfg.resolved(world_size)
    if model is not None:
        check_model(cfg, model)
    if world_size > 1 and not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs the default process group: call lmforge.parallel.init_world() first"
        )
    if device_type is None:
        from lmforge.devices import accelerator

        found = accelerator()
        device_type = found.type if found is not None else "cpu"
    shape = (cfg.pipeline, cfg.data_replicate, cfg.data_shard, cfg.context, cfg.tensor)
    if world_size == 1 and not dist.is_initialized():
        return None
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    if cfg.context > 1:
        # private in torch 2.6 ... 2.13 (torchtitan's dp_shard_cp is made the same way)
        mesh["dp_shard", "cp"]._flatten(SHARD_CONTEXT)
    _inherit_timeout(mesh, device_type)
    log.info("device mesh %s over %d processes", dict(zip(MESH_DIMS, shape)), world_size)
    return mesh


def _inherit_timeout(mesh, device_type: str) -> None:
    """Give the mesh's sub-groups the default group's collective timeout (init_world's): torch
    creates them with its own default (30 min on gloo, 10 on NCCL), so a hung rank would stall
    the others for that long in a tensor- or pipeline-parallel collective."""
    from torch.distributed import distributed_c10d as c10d

    if "fake" in str(dist.get_backend()):  # lmforge plan's stand-in world: no collective ever waits
        return
    try:  # private torch API (2.6 ... 2.13): guarded, the groups keep torch's default without it
        timeout = c10d._get_default_group()._get_backend(torch.device(device_type)).options._timeout
        meshes = [mesh[name] for name in mesh.mesh_dim_names]
        if "cp" in mesh.mesh_dim_names and dim_size(mesh, "cp") > 1:
            meshes.append(fsdp_mesh(mesh, False))
        for sub in meshes:
            group = sub.get_group()
            if group is not c10d._get_default_group():
                c10d._set_pg_timeout(timeout, group)
    except (AttributeError, RuntimeError, ValueError) as e:
        log.warning(
            "could not set the device mesh's collective timeouts (%s): torch's default applies", e
        )


def data_parallel_rank(mesh) -> tuple[int, int]:
    """(rank, size) among the data-parallel replicas: which slice of the global batch this rank
    reads.

    Ranks that differ only in their pipeline, context or tensor coordinate read the same samples.
    """
    if mesh is None:
        return 0, 1
    r, s = mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard")
    shard = mesh["dp_shard"].size()
    return r * shard + s, mesh["dp_replicate"].size() * shard


def all_reduce_data_parallel(values: torch.Tensor, mesh, context: bool = False) -> torch.Tensor:
    """Sum `values` over the data-parallel ranks in place (both data dims); with `context` over
    the context ranks too (what each computed on its own chunks of the sequences)."""
    if mesh is None:
        return values
    for name in ("dp_replicate", "dp_shard", *(("cp",) if context else ())):
        if mesh[name].size() > 1:
            dist.all_reduce(values, group=mesh[name].get_group())
    return values


def fsdp_mesh(mesh, replicate: bool):
    """The mesh FSDP2 shards over: "dp_shard", or "dp_shard_cp" under context parallelism; with
    `replicate` HSDP's ("dp_replicate", that). torch 2.13 warns that slicing a flattened dim from
    the root will be deprecated; the warning is silenced here, where the slice is taken."""
    import warnings

    shard = SHARD_CONTEXT if dim_size(mesh, "cp") > 1 else "dp_shard"
    names = ("dp_replicate", shard) if replicate else shard
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


def context_size(mesh) -> int:
    """How many ranks split each sequence (the mesh's "cp" dim; 1 without a mesh)."""
    return 1 if mesh is None else dim_size(mesh, "cp")
