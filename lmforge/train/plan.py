"""`lmforge plan`: one training step of a run traced for N ranks on fake tensors, before paying for
them.

The step is the run's own code (lmforge.train.step.ParallelTraining: parallelize, the step's label
count reduced over the data ranks, forward and backward through the task's loss or the pipeline
schedule, global-norm clipping, the optimizer step) on fake tensors of the target device with a fake
process group (lmforge.parallel.fake): nothing is computed or allocated, and a 20B-parameter layout
over 128 ranks is traced on a laptop in seconds. The model is the run's as the trainer sets it up: a
LoRA run's adapters around a frozen base (bf16, or QLoRA's NF4 where torchao is importable), DPO's
frozen reference laid out like the policy (none under LoRA) and its forward of chosen and rejected
sequences after the reference's (lmforge.train.plan_sizing). What it tells:

- per rank, the bytes of parameters (and buffers; a task's reference model's too), gradients,
  optimizer state, activations (what the forward and backward hold beyond parameters and gradients
  at their peak: saved activations, temporaries, FSDP's gathered parameters) and the peak of all
  tensors alive at once, counted as the device's caching allocator would hand them out (no
  fragmentation, no CUDA context, no NCCL buffers: leave a few GiB of headroom). From the second
  step on the optimizer state lives through the forward and backward: the peak counts it there;
- that the step runs on the device: a tensor on the wrong device in an op or in a collective fails
  here as it would at step 1 on the cluster.

One rank per pipeline stage is traced (the data- and tensor-parallel ranks of a stage hold the same
shapes). A step's micro-batches beyond the first two repeat the first's memory (gradients accumulate
in place), so at most two are traced; under a pipeline the schedule runs with one microbatch per
stage (two under interleaved 1F1B): its steady state, where stage 0 holds the most in flight. GPipe
keeps every microbatch's activations, so its activations are scaled to the step's count. The stages
are built with static shapes (a fake process group carries no messages). Each trace runs in a forked
process of its own, several at once. A deep model is traced at two depths and each category
extrapolated; the peak as the most of its phases' peaks (forward before, in and after the blocks,
backward, optimizer step), each extrapolated alone (see _extrapolate).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import re
import time
from dataclasses import dataclass, field

import torch

from lmforge.errors import UserError
from lmforge.train.config import RunConfig, parallel_layout

log = logging.getLogger(__name__)

GiB = 1 << 30
# A model deeper than 2 x SHALLOW blocks per pipeline chunk is traced at SHALLOW and 2 x SHALLOW
# blocks and its bytes extrapolated (linear in the blocks): the step's cost no longer grows with the
# depth. From 3 blocks on every category is linear (pythia-12b under FSDP at 3, 4, 6 and 8 blocks:
# the peak grows 0.62 GiB a block); at 2 the peak can fall in another phase of the step (1.76 GiB
# from 2 to 3).
SHALLOW = 3
CATEGORIES = ("params", "grads", "optimizer", "activations", "peak")


@dataclass
class RankPlan:
    rank: int
    stage: int  # the pipeline rank
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    # bytes per collective kind in the step (TraceMode)
    collectives: dict[str, int] = field(default_factory=dict)
    # of `params`: a frozen model the task holds beside the run's (DPO's reference)
    reference: int = 0
    # the peak of each forward/backward/optimizer phase (`peak`: most)
    phases: list[int] = field(default_factory=list)

    def bytes(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in CATEGORIES}


@dataclass
class Plan:
    world_size: int
    device: str  # what was planned for ("cuda")
    traced_on: str  # the device the trace ran on ("cuda", or the stand-in "fakegpu")
    layout: dict
    microbatches: int  # per step and data-parallel rank
    traced_microbatches: int
    ranks: list[RankPlan]
    layers: int  # blocks per pipeline chunk (the whole model without a pipeline)
    traced_layers: list[int]  # the depths traced (two: extrapolated to `layers`)
    seconds: float
    device_memory: int | None = None
    # what the trace held: parameters, trainable, LoRA, DPO's reference
    sized: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # the same in words, a line each
    # parallel.context for device_memory (lmforge.train.plan_context.fit_context), where asked
    context_fit: dict | None = None

    def per_rank_bytes(self) -> dict[str, int]:
        """Each category's most over the ranks (the rank that sizes the job)."""
        return {k: max(getattr(r, k) for r in self.ranks) for k in CATEGORIES}

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "device": self.device,
            "per_rank_bytes": self.per_rank_bytes(),
            "ranks": [
                {
                    "rank": r.rank,
                    "stage": r.stage,
                    **r.bytes(),
                    "reference_bytes": r.reference,
                    "collective_bytes": r.collectives,
                }
                for r in self.ranks
            ],
            "sized": self.sized,
            "notes": self.notes,
            "layout": self.layout,
            "microbatches": self.microbatches,
            "traced_microbatches": self.traced_microbatches,
            "traced_on": self.traced_on,
            "layers_per_chunk": self.layers,
            "traced_layers_per_chunk": self.traced_layers,
            "device_memory": self.device_memory,
            "context_fit": self.context_fit,
            "seconds": round(self.seconds, 2),
        }


def parse_memory(text: str) -> int:
    """'80GB', '80 GiB', '79.6GiB', '8e10' (bytes) or a bare '80' (GiB) as bytes."""
    units = {
        "": GiB,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": GiB,
        "tib": 1 << 40,
    }
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in units:
        raise UserError(
            f"--device-memory {text!r}: expected a size such as 80GiB, 80GB or 80 (GiB)"
        )
    unit = units[m.group(2)] if m.group(2) or "e" not in m.group(1) else 1
    return int(float(m.group(1)) * unit)


def plan_run(
    cfg: RunConfig, world_size: int, device: str = "cuda", device_memory: int | None = None
) -> Plan:
    """Trace one training step of `cfg` over `world_size` ranks computing on `device`; a
    UserError if a rank's peak exceeds `device_memory` bytes."""
    from lmforge.parallel.fake import trace_device
    from lmforge.parallel.mesh import check_model
    from lmforge.train.lora import check_qlora
    from lmforge.train.plan_context import context_note, context_standin, context_step_bytes
    from lmforge.train.plan_sizing import nf4_as_traced, notes, sized
    from lmforge.train.plan_tasks import task_plan
    from lmforge.train.setup import check_fit
    from lmforge.train.step import check_pipeline_batch
    from lmforge.train.tasks import get_task

    started = time.perf_counter()
    try:
        device_type = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UserError(
            f"--device {device!r}: not a device torch knows: use cuda, cpu or another accelerator "
            "type"
        ) from None
    if world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {world_size}")
    task = get_task(cfg.data.task)
    mcfg = dataclasses.replace(cfg.model.resolve(), num_labels=task_plan(task).labels)
    # context parallelism: the run at seq_length / C whose data ranks fold the context ranks
    cfg, context = context_standin(cfg, mcfg, world_size)
    layout = parallel_layout(cfg, world_size)
    # the run's refusals: the trace below changes the depth, and would not see them
    check_model(layout, mcfg)
    t = cfg.trainer
    grad_accum = check_fit(cfg, mcfg, layout.data_parallel)
    layout = check_pipeline_batch(
        layout, grad_accum, t.micro_batch_size, t.global_batch_size, layout.data_parallel
    )
    # the run's refusals
    check_qlora(
        cfg.lora,
        torch.device(device_type),
        layout,
        cfg.model.init_from,
        need_torchao=False,
        need_source=False,
    )
    cfg, nf4_note = nf4_as_traced(cfg, layout)
    auto = None
    if cfg.trainer.precision == "auto":
        # The planned device's, not this machine's: a CUDA plan is for GPUs with bf16 tensor cores
        # (A100 on).
        resolved = (
            "bf16-mixed"
            if device_type == "cuda"
            else cfg.precision_for(torch.device(device_type)).name
        )
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, precision=resolved))
        auto = f"auto, planned as {resolved}" + (
            " (a GPU with bf16 tensor cores: A100 and later)" if device_type == "cuda" else ""
        )
    traced, _ = trace_device(device_type)
    what = sized(cfg, mcfg, task)
    if layout.pipeline > 1:
        # Enough microbatches for the schedule's steady state: 1F1B holds at most one per stage in
        # flight (stage 0: all of them); interleaved 1F1B warms up with up to (virtual - 1) x stages
        # + 2 x (stages - 1) chunks.
        n = min(
            grad_accum,
            layout.pipeline * (2 if layout.pipeline_schedule == "interleaved_1f1b" else 1),
        )
        traced_layout = dataclasses.replace(layout, microbatches=n)
    # FSDP keeps unsharded gradients between micro-batches: the second shows them; elsewhere
    # one repeats
    else:
        n, traced_layout = min(grad_accum, 2 if layout.data_shard > 1 else 1), layout
    chunks = layout.pipeline * layout.virtual_stages
    per_chunk = mcfg.num_layers // chunks
    depths = [per_chunk] if per_chunk <= 2 * SHALLOW else [SHALLOW, 2 * SHALLOW]
    per_stage = world_size // layout.pipeline
    ranks = []
    jobs = [
        (
            cfg,
            dataclasses.replace(mcfg, num_layers=d * chunks),
            task,
            traced_layout,
            n,
            traced,
            world_size,
            stage * per_stage,
            stage,
            context,
        )
        for stage in range(layout.pipeline)
        for d in depths
    ]
    traced_ranks = _trace_apart(jobs)
    for stage in range(layout.pipeline):
        traces = traced_ranks[stage * len(depths) : (stage + 1) * len(depths)]
        ranks.append(traces[0] if len(traces) == 1 else _extrapolate(traces, depths, per_chunk))
    if layout.pipeline > 1 and layout.pipeline_schedule == "gpipe" and grad_accum > n:
        for r in ranks:  # GPipe holds every microbatch's activations until the backward
            extra = r.activations * (grad_accum - n) // n
            r.activations += extra
            r.peak += extra
    result = Plan(
        world_size,
        device_type,
        traced.type,
        _layout_dict(layout),
        grad_accum,
        n,
        ranks,
        per_chunk,
        depths,
        time.perf_counter() - started,
        device_memory,
        what,
    )
    result.notes = notes(what, task, max(r.reference for r in ranks), nf4_note, cfg.precision, auto)
    if context is not None:
        sent = context_step_bytes(cfg, mcfg, context, layout, grad_accum)
        for r in ranks:
            r.collectives["context"] = sent
        result.layout.update(
            data_shard=context.data_shard,
            context=context.context,
            context_method=context.method,
        )
        result.notes.append(context_note(context, sent))
    if device_memory is not None:
        check_memory(result, device_memory, cfg.trainer)
    return result


def _extrapolate(traces: list[RankPlan], depths: list[int], layers: int) -> RankPlan:
    """The rank's bytes at `layers` blocks per stage from traces at two depths: every block holds
    the same tensors, so each category is a + b x blocks exactly."""
    (lo, hi), (d1, d2) = traces, depths

    def line(a: int, b: int) -> int:
        return a + (b - a) * (layers - d1) // (d2 - d1)

    def at(k: str) -> int:
        return line(getattr(lo, k), getattr(hi, k))

    def comm(k: str) -> int:  # a collective's bytes grow with the blocks alike
        return line(lo.collectives.get(k, 0), hi.collectives.get(k, 0))

    # The step's peak is the most of its phases' peaks, each linear in the blocks; which phase holds
    # it can change with the depth (Llama-70B LoRA under FSDP: the forward's start at 3 blocks, the
    # end of its last block at 80), so each phase is extrapolated alone: the straight line through
    # the two peaks would miss it (by half there).
    phases = (
        [line(a, b) for a, b in zip(lo.phases, hi.phases)]
        if len(lo.phases) == len(hi.phases)
        else []
    )
    plan = RankPlan(
        lo.rank,
        lo.stage,
        **{k: at(k) for k in CATEGORIES},
        collectives={k: comm(k) for k in {*lo.collectives, *hi.collectives}},
        reference=at("reference"),
        phases=phases,
    )
    plan.peak = max([plan.peak, *phases])
    return plan


def check_memory(plan: Plan, device_memory: int, trainer) -> None:
    """A UserError where a rank's peak exceeds `device_memory`, its advice what the run
    (`trainer`, its TrainerConfig) does not do yet: a layout that shards the model or more ranks
    for one that does, a smaller frozen base, a smaller micro-batch, more activation
    checkpointing."""
    worst = max(plan.ranks, key=lambda r: r.peak)
    if worst.peak <= device_memory:
        return
    parts = ", ".join(f"{k} {getattr(worst, k) / GiB:.1f}" for k in CATEGORIES[:-1])
    base = (plan.sized.get("lora") or {}).get("base_dtype")
    layout = plan.layout
    # QLoRA shards with FSDP2 alone
    model_parallel = "" if base == "nf4" else ", parallel.tensor or parallel.pipeline"
    advice = [
        f"spread the model over more ranks (parallel.data_shard{model_parallel})"
        if layout["data_shard"] > 1 or layout["tensor"] > 1 or layout["pipeline"] > 1
        else f"shard the model (trainer.data_parallel=fsdp{model_parallel})"
    ]
    # A LoRA run's frozen base can shrink: bf16 halves an fp32 one, NF4 (QLoRA) quarters a bf16 one.
    advice += {
        "fp32": ["hold the frozen base in lora.base_dtype=bf16 (or nf4, QLoRA)"],
        "bf16": ["hold the frozen base in NF4 (lora.base_dtype=nf4, QLoRA)"],
    }.get(base, [])
    advice += ["lower trainer.micro_batch_size"] if trainer.micro_batch_size > 1 else []
    advice += {
        "none": ["set trainer.activation_checkpointing=selective (or full)"],
        "selective": ["set trainer.activation_checkpointing=full"],
    }.get(trainer.activation_checkpointing, [])
    raise UserError(
        f"rank {worst.rank} (pipeline stage {worst.stage}) needs {worst.peak / GiB:.1f} GiB at its peak "
        f"({parts} GiB), more than --device-memory {device_memory / GiB:.1f} GiB: "
        + (", ".join(advice[:-1]) + ", or " + advice[-1] if len(advice) > 1 else advice[0])
    )


def _layout_dict(layout) -> dict:
    return {
        "pipeline": layout.pipeline,
        "data_replicate": layout.data_replicate,
        "data_shard": layout.data_shard,
        "tensor": layout.tensor,
        "sequence_parallel": layout.sequence_parallel and layout.tensor > 1,
        "pipeline_schedule": layout.pipeline_schedule if layout.pipeline > 1 else None,
        "virtual_stages": layout.virtual_stages,
        "expert": layout.expert,
        "context": layout.context,
        "context_method": layout.context_method if layout.context > 1 else None,
    }


def _local_bytes(tensors) -> int:
    from lmforge.parallel.load import tensor_bytes

    seen = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(map(tensor_bytes, seen.values()))


def _trace_apart(jobs: list[tuple]) -> list[RankPlan]:
    """_trace_rank(*job) for each job, each in a forked process of its own, as many at once as there
    are cores.

    DTensor keeps sharding decisions beyond the fake world that made them (some in C++), keyed by
    meshes that compare equal across worlds; another rank's world (a pipeline's next stage, or the
    next plan in the same process) builds its process groups in another order and under other names,
    and would meet the previous world's groups. A forked child starts from the parent's imports,
    never from another trace's leftovers, and takes nothing back but the result.
    """
    import multiprocessing as mp
    import os

    if "fork" not in mp.get_all_start_methods():
        return [_trace_rank(*job) for job in jobs]
    context = mp.get_context("fork")

    def child(job, send):
        try:
            result = ("ok", _trace_rank(*job))
        except BaseException as e:  # noqa: BLE001 - carried to the parent as it is
            try:
                pickle.dumps(e)
                result = ("error", e)
            # an exception that does not pickle (FakeTensorDeviceMismatchError):
            # rebuilt there
            except Exception:
                result = ("unpicklable", (type(e).__module__, type(e).__qualname__, str(e)))
        send.send(result)

    results: list[tuple | None] = [None] * len(jobs)
    width = max(
        1,
        min(
            len(jobs),
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1),
        ),
    )
    pending = list(enumerate(jobs))
    running = []
    try:
        while pending or running:
            while pending and len(running) < width:
                index, job = pending.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=child, args=(job, send), daemon=True)
                process.start()
                send.close()
                running.append((index, job, process, receive))
            index, job, process, receive = running.pop(0)
            try:
                results[index] = receive.recv()
            except EOFError:  # killed (out of memory?) before it could answer
                results[index] = ("error", None)
            process.join()
            if results[index][1] is None:
                raise RuntimeError(
                    f"lmforge plan: the trace of rank {job[7]} died (exit code {process.exitcode})"
                )
            if results[index][0] == "error":
                raise results[index][1]
            if results[index][0] == "unpicklable":
                raise _rebuilt(*results[index][1])
    finally:
        for _, _, process, _ in running:
            process.kill()
            process.join()
    return [value for _, value in results]


def _rebuilt(module: str, qualname: str, message: str) -> BaseException:
    """An exception of the class named, holding only its message (its other fields stay in the
    child)."""
    import importlib

    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        error = cls.__new__(cls)
        BaseException.__init__(error, message)
        str(error)
        return error
    except Exception:  # noqa: BLE001 - any class that cannot be rebuilt this way
        return RuntimeError(f"{qualname}: {message}")


def _trace_rank(
    cfg: RunConfig,
    mcfg,
    task,
    layout,
    n: int,
    device: torch.device,
    world_size: int,
    rank: int,
    stage: int,
    context=None,
) -> RankPlan:
    """One step of rank `rank` under the fake world (see the module docstring); `context`: a
    ContextSpec, whose attention the layers run (lmforge.train.plan_context.traced_attention)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lmforge.models import build
    from lmforge.parallel.data_parallel import unwrap
    from lmforge.parallel.fake import TraceMode, fake_world
    from lmforge.parallel.load import allocated_bytes, materialize_empty
    from lmforge.parallel.mesh import build_mesh
    from lmforge.train.plan_context import traced_attention
    from lmforge.train.plan_sizing import quantize_as_read, wrap_as_trained
    from lmforge.train.plan_tasks import as_traced, task_plan
    from lmforge.train.setup import apply_activation_checkpointing
    from lmforge.train.step import ParallelTraining

    t, precision, plan = cfg.trainer, cfg.precision, task_plan(task)

    def init_model(
        run_cfg: RunConfig, num_labels: int = 0, meta: bool = False, device=None, dtype=None
    ):
        """lmforge.train.setup.init_model as traced: the model at the traced depth on the meta
        device, filled with empty tensors on the traced device once laid out (whether the run
        builds it whole or shard by shard, a rank holds the same tensors)."""
        model = (
            build(dataclasses.replace(mcfg, num_labels=num_labels), device="meta").to(dtype).train()
        )
        return model, materialize_empty

    with fake_world(device, world_size, rank), as_traced(init_model), traced_attention(context):
        mesh = build_mesh(layout, mcfg, world_size=world_size, device_type=device.type)
        # The trainer's steps: the model, its adapters, the task's preparation (DPO's reference),
        # checkpointing.
        model, fill = init_model(cfg, mcfg.num_labels, meta=True, dtype=precision.param_dtype)
        if cfg.lora is not None:
            fill = wrap_as_trained(model, cfg, fill, layout.shards_model)
        task.prepare(model, cfg, layout, device)
        apply_activation_checkpointing(model, t.activation_checkpointing)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake, TraceMode(device, fake) as trace:
            if cfg.lora is not None and cfg.lora.base_dtype == "nf4":
                # before the layout, as the trainer reads it (FSDP2 shards NF4)
                quantize_as_read(model, device)
            training = ParallelTraining(
                model,
                layout,
                mesh,
                task,
                cfg.optim,
                precision,
                t.seed,
                cfg.data.seq_length,
                device,
                fill=fill,
                pipeline_rows=t.micro_batch_size * plan.rows_per_example,
            )
            del model
            # phases: before the blocks, the blocks, after them (see _extrapolate)
            for part in training.pm.parts:
                layers = list(unwrap(part).layers)
                layers[0].register_forward_pre_hook(lambda *_: trace.new_phase())
                layers[-1].register_forward_hook(lambda *_: trace.new_phase())
            reference = allocated_bytes(task.reference) if task.reference is not None else 0
            params = allocated_bytes(training.pm) + reference
            trace.reset_peak()
            trace.at_backward = None
            micro = [
                plan.example_batch(t.micro_batch_size, cfg.data.seq_length, mcfg.vocab_size, device)
                for _ in range(n)
            ]
            counts = training.global_counts(micro)
            training.step(micro, counts, t.grad_clip)
            step_peak, step_phases = trace.peak, list(trace.phase_peaks)
            grads = _local_bytes(p.grad for part in training.pm.parts for p in part.parameters())
            for o in training.optimizer.optimizers:
                o.first_chunk_only = True  # AdamWSR (see there); others have no chunks
            trace.new_phase()
            training.optimizer.step()
            optimizer = _local_bytes(
                v
                for o in training.optimizer.optimizers
                for state in o.state.values()
                for v in state.values()
            )
            optimizer_peak = trace.peak
            training.optimizer.zero_grad(set_to_none=True)
    activations = max(0, (trace.at_backward or params) - params)
    # From the second step on the optimizer state lives through the forward and backward.
    phases = [p + optimizer for p in step_phases] + [trace.phase_peaks[-1]]
    return RankPlan(
        rank,
        stage,
        params,
        grads,
        optimizer,
        activations,
        max(step_peak + optimizer, optimizer_peak),
        dict(trace.collective_bytes),
        reference,
        phases,
    )
