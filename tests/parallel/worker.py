"""One rank of the parallelism tests (started by launch.run_ranks). Not a test module itself.

    worker.py cases CASES.json OUT.json   run each case; rank 0 writes the comparisons to OUT.json
    worker.py error CASE.json             build the mesh/model of one bad layout, exit like the CLI

For each case every rank also runs the *single-process* model on the whole global batch (the
reference) and compares loss, every gradient (gathered with full_tensor) and the gradient norm.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lmforge.errors import UserError
from lmforge.models import build, preset
from lmforge.models.build import local_piece
from lmforge.models.router_losses import router_losses
from lmforge.parallel import (
    ParallelConfig,
    all_reduce_data_parallel,
    build_mesh,
    data_parallel_rank,
    grad_norm,
    init_world,
    load_model_state_dict,
    model_state_dict,
    parallelize,
    pipeline_eval,
    pipeline_step,
    with_router_loss,
)
from lmforge.parallel.data_parallel import gradient_sync
from lmforge.train.optim import AdamWSR, by_mesh

BATCH, SEQ = 8, 16


def model_config(case: dict):
    return replace(preset(case["model"]), **case.get("model_overrides", {}))


def make_batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    kwargs = {}
    # sequence classification: one label per row, rows right-padded (a pipeline's last stage
    if cfg.num_labels:
        # finds each row's last token by the mask)
        labels = torch.randint(0, cfg.num_labels, (BATCH,), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        kwargs = {"attention_mask": (torch.arange(SEQ)[None] < lengths[:, None]).long()}
    elif cfg.family == "bert":  # MLM: ~1/4 of the tokens labelled, right padding, two segments
        labels[torch.rand(BATCH, SEQ, generator=g) > 0.25] = -100
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        labels[mask == 0] = -100
        kwargs = {
            "attention_mask": mask,
            "token_type_ids": (torch.arange(SEQ)[None] >= lengths[:, None] // 2).long(),
        }
    else:
        labels[:, :2] = -100  # some ignored positions, as after a prompt
    return ids, labels, kwargs


def ce_sum(logits, labels):
    if logits.dim() == 2:
        return F.cross_entropy(logits.float(), labels, reduction="sum")
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build_case(cfg, case: dict, seed: int = 0) -> torch.nn.Module:
    """The case's model: `cfg` built from `seed`, with LoRA adapters where the case has a "lora"
    section (their B drawn non-zero, so that every adapter has a gradient: at PEFT's init B = 0
    and A's gradient is zero)."""
    model = build(cfg, seed=seed)
    if "lora" in case:
        from lmforge.models.lora import LoRAConfig, apply_lora

        apply_lora(model, LoRAConfig(**case["lora"]), seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def reference(cfg, batch, seed: int = 0, chunks: int = 1, case: dict | None = None):
    """The one-process model's loss and gradients on the global batch. A mixture of experts adds
    its router losses the trainer's way: per forward, here per `chunks` consecutive slices of the
    batch (the data-parallel ranks' pipeline microbatches), averaged over them."""
    ref = build_case(cfg, case or {}, seed)
    return ref, ref_backward(ref, cfg, batch, chunks)


def ref_backward(ref, cfg, batch, chunks: int = 1) -> float:
    """Forward and backward of the one-process model `ref` on the global batch, router losses per
    `chunks` slices as reference() adds them; the loss (without router losses)."""
    ids, labels, kwargs = batch
    count = (labels != -100).sum()
    if not cfg.num_experts:
        chunks = 1
    total, ref.router_means = 0.0, [0.0, 0.0]  # the aux and z-loss, means over the chunks
    for rows in torch.arange(BATCH).chunk(chunks):
        loss = (
            ce_sum(ref(ids[rows], **{k: v[rows] for k, v in kwargs.items()}), labels[rows]) / count
        )
        extra = router_losses(ref, cfg)
        (loss if extra is None else loss + extra.loss / chunks).backward()
        total += loss.item()
        if extra is not None:
            ref.router_means = [
                m + v.item() / chunks
                for m, v in zip(ref.router_means, (extra.aux_loss, extra.z_loss))
            ]
    return total


def parallel_step(pm, mesh, batch, accumulate: int = 1, router: list | None = None) -> float:
    """One forward/backward of the global batch split over the data-parallel ranks; the global
    loss. A MoE model (no pipeline) runs its rows as `accumulate` micro-batches, gradients
    synchronised on the last, as the trainer; `router` then receives the aux and z-loss, means
    over every rank's micro-batches (reference()'s chunks)."""
    ids, labels, kwargs = batch
    count = (labels != -100).sum()
    rank, size = data_parallel_rank(mesh)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    # Normalised by the global count; x dp size because FSDP averages gradients over the dp ranks.
    loss_fn = lambda out, y: ce_sum(out, y) / count * size  # noqa: E731
    kwargs = {k: v[rows] for k, v in kwargs.items()}
    cfg = getattr(pm.parts[0], "module", pm.parts[0]).config  # through DDP's wrapper
    # the router losses as the trainer adds them (ParallelTraining.step)
    if cfg.num_experts and not pm.pipelined:
        total, means = 0.0, torch.zeros(2, dtype=torch.float64)
        for i, micro in enumerate(torch.arange(rows.start, rows.stop).chunk(accumulate)):
            with gradient_sync(pm.parts[0], i == accumulate - 1), pm.loss_context():
                loss = loss_fn(
                    pm(ids[micro], **{k: v[micro - rows.start] for k, v in kwargs.items()}),
                    labels[micro],
                )
                extra = router_losses(pm.parts[0], cfg)
                with_router_loss(loss, extra.loss / accumulate).backward()
            total = total + full(loss).detach().double()
            means += (
                torch.stack([extra.aux_loss.detach(), extra.z_loss.detach()]).double() / accumulate
            )
        loss = total
        if router is not None:
            router[:] = (all_reduce_data_parallel(means, mesh) / size).tolist()
    else:
        loss = pipeline_step(pm, ids[rows], labels[rows], loss_fn, **kwargs)
    return all_reduce_data_parallel(loss.reshape(1), mesh).item() / size


def parallel_eval(pm, mesh, batch) -> float:
    ids, labels, kwargs = batch
    count = (labels != -100).sum()
    rank, size = data_parallel_rank(mesh)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    loss = pipeline_eval(
        pm,
        ids[rows],
        labels[rows],
        lambda out, y: ce_sum(out, y) / count,
        **{k: v[rows] for k, v in kwargs.items()},
    )
    return all_reduce_data_parallel(loss.reshape(1), mesh).item()


def named_parameters(pm):
    """(model name, parameter) of this rank's parts; DDP's wrapper prefix left out."""
    for part in pm.parts:
        for name, p in part.named_parameters():
            yield name.removeprefix("module."), p


def compare_grads(pm, ref) -> tuple[float, list[str]]:
    """max over parameters of max|grad - ref grad| / max|ref grad|, and the names compared here."""
    ref_params = dict(ref.named_parameters())
    worst, names = 0.0, []
    for name, p in named_parameters(pm):
        # frozen (a LoRA base): no gradient on either side (see run_case)
        if ref_params[name].grad is None:
            names.append(name)
            continue
        g, r = full(p.grad), ref_params[name].grad
        worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item())
        names.append(name)
    return worst, names


def adam_step_error(pm, ref, optimizer=None) -> float:
    """One AdamW step (foreach kernels, as the trainer's) on both models: max |p - p_ref| / max
    |dp_ref|. A large eps keeps Adam's update smooth in tiny gradients, so it compares like the
    gradients do. `optimizer(params)`: another optimizer to step with (lmforge's AdamWSR)."""
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for params in (list(pm.parameters()), list(ref.parameters())):
        # expert-parallel experts beside FSDP/DDP's
        params = [{"params": group} for group in by_mesh(params)]
        if optimizer is None:
            torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1, foreach=True).step()
        else:
            optimizer(params).step()
    ref_params, worst = dict(ref.named_parameters()), 0.0
    for name, p in named_parameters(pm):
        r = ref_params[name].detach()
        step = (r - before[name]).abs().max().clamp_min(1e-12)
        worst = max(worst, ((full(p.detach()) - r).abs().max() / step).item())
    return worst


def sgd_(params, lr: float = 0.5) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None


def run_case(case: dict, world: int) -> dict:
    cfg = model_config(case)
    pcfg = ParallelConfig(**case["parallel"])
    mesh = build_mesh(pcfg, cfg)
    batch = make_batch(cfg, seed=1)
    accumulate = case.get("accumulate", 1)
    chunks = data_parallel_rank(mesh)[1] * (
        pcfg.num_microbatches if pcfg.pipeline > 1 else accumulate
    )
    ref, ref_loss = reference(cfg, batch, chunks=chunks, case=case)
    pm = parallelize(build_case(cfg, case), pcfg, mesh)
    router: list = []
    loss = parallel_step(pm, mesh, batch, accumulate, router)
    worst, names = compare_grads(pm, ref)
    eval_loss = parallel_eval(pm, mesh, batch)
    all_names: list = [None] * world
    dist.all_gather_object(all_names, names)
    ref_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None])
    ).item()
    held = {n for ns in all_names for n in ns}
    # Trainable here and frozen in one process, or the other way round, or frozen with a gradient (a
    # LoRA base's norms made trainable by a tensor-parallel style, its tied embedding given a zero
    # gradient by a pipeline).
    ref_trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    flipped = [
        n
        for n, p in named_parameters(pm)
        if p.requires_grad != (n in ref_trainable)
        or (n not in ref_trainable and p.grad is not None)
    ]
    result = {
        "loss": loss,
        "ref_loss": ref_loss,
        "eval_loss": eval_loss,
        "grad_err": worst,
        "flipped": flipped,
        "grad_norm": grad_norm(pm).item(),
        "ref_grad_norm": ref_norm,
        "missing": sorted({n for n, _ in ref.named_parameters()} - held),
    }
    # a pipeline's router losses, means over the data-parallel ranks' microbatches
    if pm.router is not None:
        router = (
            all_reduce_data_parallel(pm.router.losses.clone(), mesh) / data_parallel_rank(mesh)[1]
        ).tolist()
    if router:
        result["router_losses"], result["ref_router_losses"] = router, ref.router_means
    # One AdamW step, then one of lmforge's AdamWSR (the bf16-sr optimizer; on fp32 weights its
    # update is AdamW's), which updates each rank's local shard: a gradient laid out unlike its
    # parameter (a sequence-parallel norm's partial sum, a vocabulary-parallel embedding's
    # replicated gradient) must be laid out like it first.
    adam = adam_step_error(pm, ref)
    adamwsr = adam_step_error(pm, ref, lambda ps: AdamWSR(ps, lr=1e-2, eps=1e-3, weight_decay=0.1))
    worst_all = torch.tensor([worst, adam, adamwsr])
    dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    result["grad_err"], result["adam_err"], result["adamwsr_err"] = worst_all.tolist()
    # each adapter's split on this rank, e.g. "layers.0.attn.qkv.lora_B.q": "S(0)"
    if "lora" in case:
        result["lora_layout"] = {
            n: "".join(map(str, p.placements)) if isinstance(p, DTensor) else "local"
            for part in pm.parts
            for n, p in part.named_parameters()
            if ".lora_" in n
        }
    if cfg.num_experts:  # the most bytes of expert weights (and of their gradients) a rank holds
        held = torch.tensor(
            [
                sum(local_piece(t)[0].numel() * t.element_size() for t in ts)
                for ts in (
                    [p for n, p in named_parameters(pm) if ".experts." in n],
                    [
                        p.grad
                        for n, p in named_parameters(pm)
                        if ".experts." in n and p.grad is not None
                    ],
                )
            ]
        )
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        result["expert_bytes"], result["expert_grad_bytes"] = held.tolist()
    if "reshard" in case:
        result.update(reshard(case, cfg, pcfg, pm, ref, batch, world))
    return result


def checkpoint_differs(pm, cfg, path: str) -> list[str]:
    """The parameters of which this rank's pieces are not bit for bit the checkpoint's at `path`
    (read whole here, on one process's terms), over every rank."""
    import torch.distributed.checkpoint as dcp

    whole = build(cfg, seed=7).state_dict()
    dcp.load(whole, checkpoint_id=path, no_dist=True)
    differs = [
        n
        for n, p in named_parameters(pm)
        if not torch.equal(local_piece(p.detach())[0], whole[n][local_piece(p)[1]])
    ]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, differs)
    return sorted({n for ns in every for n in ns})


def _ref_loss(ref, batch) -> float:
    ids, labels, kwargs = batch
    return (ce_sum(ref(ids, **kwargs), labels) / (labels != -100).sum()).item()


def reshard(case, cfg, pcfg, pm, ref, batch, world) -> dict:
    """Update the weights, save (DCP) under this layout, load under another and on one process:
    the loss on the batch must equal the single-process model's after the same update. Then the
    same the other way round."""
    import torch.distributed.checkpoint as dcp

    path = case["reshard"]["dir"]
    sgd_(pm.parameters())
    sgd_(ref.parameters())
    other = ParallelConfig(**case["reshard"]["parallel"])
    mesh2 = build_mesh(other, cfg)
    # The gradients the next update takes, as the other layout computes them (a MoE's router losses
    # per rank, and per pipeline microbatch).
    chunks = data_parallel_rank(mesh2)[1] * (other.num_microbatches if other.pipeline > 1 else 1)
    expected = ref_backward(ref, cfg, batch, chunks=chunks)
    dcp.save(model_state_dict(pm), checkpoint_id=f"{path}/a")
    pm2 = parallelize(build(cfg, seed=123), other, mesh2)
    state = model_state_dict(pm2)
    dcp.load(state, checkpoint_id=f"{path}/a")
    load_model_state_dict(pm2, state)
    differs = checkpoint_differs(pm, cfg, f"{path}/a") + checkpoint_differs(pm2, cfg, f"{path}/a")
    loaded = parallel_step(pm2, mesh2, batch)
    single = None
    dist.barrier()
    if dist.get_rank() == 0:  # the same checkpoint on one process, no process group involved
        one = build(cfg, seed=7)
        sd = one.state_dict()
        dcp.load(sd, checkpoint_id=f"{path}/a", no_dist=True)
        one.load_state_dict(sd)
        with torch.no_grad():
            single = _ref_loss(one, batch)
    dist.barrier()
    sgd_(pm2.parameters())  # pm2's gradients are those of the loaded weights
    sgd_(ref.parameters())
    expected_back = _ref_loss(ref, batch)
    dcp.save(model_state_dict(pm2), checkpoint_id=f"{path}/b")
    pm3 = parallelize(build(cfg, seed=99), pcfg, pm.mesh)
    state = model_state_dict(pm3)
    dcp.load(state, checkpoint_id=f"{path}/b")
    load_model_state_dict(pm3, state)
    differs += checkpoint_differs(pm2, cfg, f"{path}/b") + checkpoint_differs(pm3, cfg, f"{path}/b")
    back = parallel_step(pm3, pm.mesh, batch)
    return {
        "reshard_expected": expected,
        "reshard_loaded": loaded,
        "reshard_single": single,
        "reshard_back_expected": expected_back,
        "reshard_back_loaded": back,
        "reshard_differs": differs,
    }


def finish(code: int) -> None:
    # Ending with a barrier and os._exit avoids a rare gloo abort at interpreter exit
    # (TORCH-CPU-NOTES).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    torch.set_num_threads(1)
    mode, spec = sys.argv[1], json.loads(open(sys.argv[2]).read())
    world = init_world(timeout_minutes=float(os.environ.get("LMFORGE_TEST_TIMEOUT_MIN", "2")))
    if mode == "error":
        try:
            cfg = model_config(spec)
            pcfg = ParallelConfig(**spec["parallel"])
            mesh = build_mesh(pcfg, cfg)
            pm = parallelize(build(cfg, seed=0), pcfg, mesh)
            # a hung rank: the others must time out, not wait
            if spec.get("stall_on_rank") == world.rank:
                time.sleep(spec["stall_seconds"])
            # tensor-parallel collectives (sub-groups)
            parallel_step(pm, mesh, make_batch(cfg, seed=1))
            dist.barrier()
        except UserError as e:
            if world.rank == 0:
                print(f"error: {e}", file=sys.stderr)
            finish(1)
        except Exception as e:  # noqa: BLE001 - a crash of this rank or a peer
            print(
                f"rank {world.rank}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                file=sys.stderr,
            )
            finish(2)
        finish(0)
    results = {}
    for name, case in spec.items():
        results[name] = run_case(case, world.size)
    dist.barrier()
    if world.rank == 0:
        with open(sys.argv[3], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    finish(0)


if __name__ == "__main__":
    main()
