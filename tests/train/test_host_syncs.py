"""A training step reads the device once, whatever the gradient accumulation: every read of a
device value on the host (`.item()`, `.tolist()`, `int(t)`, `bool(t)`, `.cpu()`, `nonzero`) waits
for the device to finish its queued work, and one per micro-batch leaves an accelerator idle
while the host catches up.

The step runs on fake CUDA tensors (lmforge.parallel.fake, as `lmforge plan` traces it: no GPU
needed), in a fresh process (the stand-in device it registers stays registered; a fork would
inherit an autograd engine started without it), and a dispatch mode records every op that hands a
device value to the host."""

from __future__ import annotations

import multiprocessing
import traceback
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.models import build
from lmforge.parallel.fake import TraceMode, fake_world, trace_device
from lmforge.parallel.load import materialize_empty
from lmforge.train.config import parallel_layout
from lmforge.train.loss import IGNORE_INDEX
from lmforge.train.plan_tasks import task_plan
from lmforge.train.step import ParallelTraining
from lmforge.train.tasks import get_task
from tests.train.conftest import run_config

aten = torch.ops.aten
# Ops whose result is a device value read on the host (the device must have computed it first).
READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.equal.default,
    aten.item.default,
}


class HostReads(TorchDispatchMode):
    """Records each sync point: a read of device data on the host (with the lmforge line that
    asked) after device work was queued. Reads with no device op between them are one wait
    (`.tolist()` reads element by element)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.queued = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_device = first is not None and first.device.type != "cpu"
        to_host = (
            func is aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        )
        copy_back = (
            func is aten.copy_.default
            and first is not None
            and first.device.type == "cpu"
            and args[1].device.type != "cpu"
        )
        if (on_device and (func in READS or to_host)) or copy_back:
            if self.queued:
                where = [
                    f"{f.filename.split('lmforge/')[-1]}:{f.lineno}"
                    for f in traceback.extract_stack()
                    if "/lmforge/" in f.filename and "/tests/" not in f.filename
                ]
                self.reads.append(f"{func} at {where[-1] if where else '?'}")
            self.queued = False
        elif on_device:
            self.queued = True
        return func(*args, **kwargs)


def _step_reads(task_name: str, accumulation: int, corpus, tmp_path) -> list[str]:
    """The host reads of one training step (global counts, forward, backward, clipping) of
    `accumulation` micro-batches, one process, on fake CUDA."""
    cfg = run_config(corpus, tmp_path, "trainer.grad_clip=1.0")
    task = get_task(task_name)
    mcfg = cfg.model.resolve()
    micro = []
    for _ in range(accumulation):  # host batches, as the data loader gives them
        batch = task_plan(task).example_batch(2, 32, mcfg.vocab_size, torch.device("cpu"))
        if "labels" in batch and task_name == "sft":
            batch["labels"][:, :5] = IGNORE_INDEX  # prompts: not scored
        micro.append(batch)
    device, _ = trace_device("cuda")
    layout = parallel_layout(cfg, 1)
    with fake_world(device, 1, 0):
        model = build(mcfg, device="meta").train()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake, TraceMode(device, fake):
            training = ParallelTraining(
                model,
                layout,
                None,
                task,
                cfg.optim,
                cfg.precision,
                0,
                32,
                device,
                fill=materialize_empty,
            )
            with HostReads() as reads:
                counts = training.global_counts(micro)
                training.step(micro, counts, cfg.trainer.grad_clip)
    return reads.reads


@pytest.mark.slow
@pytest.mark.parametrize("task_name", ["pretrain", "sft", "dpo"])
def test_one_host_sync_per_step_whatever_the_accumulation(task_name, tiny_corpus, tmp_path):
    for accumulation in (1, 4):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            reads = child.submit(
                _step_reads, task_name, accumulation, tiny_corpus, tmp_path
            ).result(timeout=600)
        assert len(reads) == 1, (accumulation, reads)
        # the step's one read: loss, statistics, norm and tokens together
        assert "train/step.py" in reads[0]


def test_a_batch_already_on_the_gpu_is_not_pinned(monkeypatch):
    """Pinned memory is for the host -> GPU copy alone: a batch that is on the GPU already
    (benchmarks/train.py hands the Trainer one) goes as it is. On an H200 `pin_memory()` of it
    raised "cannot pin 'torch.cuda.LongTensor' only dense CPU tensors can be pinned" at the first
    step. CPU: fake CUDA tensors, pin_memory forbidden."""
    from types import SimpleNamespace

    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda self, *a: pytest.fail(f"pinned a {self.device} tensor")
    )
    cuda = torch.device("cuda", 0)
    fake_self = SimpleNamespace(
        pm=SimpleNamespace(pipelined=False, device=cuda),
        seq_length=8,
        layout=SimpleNamespace(tensor=1, sequence_parallel=False),
        context=None,
        task=SimpleNamespace(inputs=lambda batch: (batch["input_ids"], batch["labels"])),
    )
    with FakeTensorMode(allow_non_fake_inputs=True):
        batch = {
            "input_ids": torch.zeros(2, 8, dtype=torch.long, device=cuda),
            "labels": torch.zeros(2, 8, dtype=torch.long, device=cuda),
        }
        out = ParallelTraining._inputs(fake_self, [batch])
    assert {t.device for t in out.values()} == {cuda}
