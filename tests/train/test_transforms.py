"""lmforge.train.transforms: a run's model transforms in their one order, and what each leaves on
a tiny model."""

from __future__ import annotations

import functools

import pytest
import torch

from lmforge.models import build
from lmforge.parallel.load import init_sharded
from lmforge.parallel.mesh import ParallelConfig
from lmforge.train import transforms
from lmforge.train.config import load_run_config
from lmforge.train.tasks import get_task

PRESET = ["model.preset=tiny-llama", "data.seq_length=32", "trainer.seed=0"]
LORA = ["lora.rank=2", "lora.alpha=4", "lora.targets=all-linear", "lora.dropout=0"]


def _recorded(monkeypatch, calls: list[str], name: str, through: bool = True) -> None:
    """transforms.`name` records its call (and still runs, with `through`)."""
    real = getattr(transforms, name)

    def record(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs) if through else None

    monkeypatch.setattr(transforms, name, record)


def _lay_out(cfg, model, fill, task=None, tmp_path=None):
    layout = ParallelConfig().resolved(1)
    return transforms.lay_out_model(
        model,
        fill,
        cfg,
        layout,
        None,
        task or get_task(cfg.data.task),
        cfg.precision,
        torch.device("cpu"),
        tmp_path,
    )


def _recording(monkeypatch, calls, tmp_path):
    """Every step of lay_out_model recorded, Float8 and the NF4 read without running (no GPU, no
    folder), compile as the name of each block it is given (no Inductor)."""
    for name in ("apply_run_lora", "apply_activation_checkpointing", "ParallelTraining"):
        _recorded(monkeypatch, calls, name)
    _recorded(monkeypatch, calls, "convert_to_float8", through=False)
    _recorded(monkeypatch, calls, "read_nf4_base", through=False)
    # block_compiler points Inductor at the run's cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda block, **kw: calls.append("compile"))
    task = get_task("pretrain")
    monkeypatch.setattr(task, "prepare", lambda *a, **kw: calls.append("task.prepare"))
    return task


def test_a_sharded_run_fills_its_model_after_every_transform_and_the_layout(monkeypatch, tmp_path):
    """A meta-device model (a layout that shards it): LoRA, the task's preparation, Float8,
    activation checkpointing, then the parallel plans, each block compiled inside them, and only
    then the fill of its tensors."""
    calls: list[str] = []
    task = _recording(monkeypatch, calls, tmp_path)
    cfg = load_run_config(
        None, [*PRESET, *LORA, "trainer.float8=true", "trainer.compile=true", f"run_dir={tmp_path}"]
    )
    model = build(cfg.model.resolve(), device="meta")
    filled = []
    fill = functools.partial(init_sharded, seed=0)
    training = _lay_out(
        cfg, model, lambda pm: filled.append(list(calls)) or fill(pm), task, tmp_path
    )
    layers = len(model.layers)
    assert calls == [
        "apply_run_lora",
        "task.prepare",
        "convert_to_float8",
        "apply_activation_checkpointing",
        "ParallelTraining",
        *["compile"] * layers,
    ]
    assert filled == [calls]  # the fill ran last, once
    assert not any(p.is_meta for p in training.pm.parameters())


def test_qlora_from_a_folder_reads_its_nf4_base_before_the_task_and_a_whole_model_is_filled_then(
    monkeypatch, tmp_path
):
    """QLoRA's base comes from its folder right after the adapters wrap it; on one process (or
    DDP) the rest is filled then too, whole, and the layout has nothing left to fill."""
    calls: list[str] = []
    task = _recording(monkeypatch, calls, tmp_path)
    monkeypatch.setattr(transforms, "nf4_source", lambda cfg: "FOLDER")
    cfg = load_run_config(None, [*PRESET, *LORA, "lora.base_dtype=bf16", f"run_dir={tmp_path}"])
    model = build(cfg.model.resolve(), device="meta")
    fill = functools.partial(init_sharded, seed=0)
    _lay_out(cfg, model, lambda pm: calls.append("fill") or fill(pm), task, tmp_path)
    assert calls == [
        "apply_run_lora",
        "read_nf4_base",
        "fill",
        "task.prepare",
        "apply_activation_checkpointing",
        "ParallelTraining",
    ]


def test_the_transforms_leave_lora_adapters_in_checkpointed_blocks(tmp_path):
    """LoRA's adapters wrap every block linear, only they train, and each block's forward runs
    again in the backward (full checkpointing: torch.utils.checkpoint recomputes it)."""
    from lmforge.models.lora import LoRALinear

    cfg = load_run_config(
        None, [*PRESET, *LORA, "trainer.activation_checkpointing=full", f"run_dir={tmp_path}"]
    )
    model = build(cfg.model.resolve(), seed=0)
    training = _lay_out(cfg, model, None, tmp_path=tmp_path)
    laid = training.pm.parts[0]
    assert laid is model
    linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("layers.")
    ]
    assert linears and all(
        isinstance(model.get_submodule(n), LoRALinear) for n in linears if ".lora_" not in n
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    runs = []
    # (a block's own hooks sit outside the forward that checkpointing reruns)
    for block in model.layers:
        block.attn.register_forward_pre_hook(lambda *_: runs.append(1))
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    loss, count, _ = get_task("pretrain").loss(model, {"tokens": ids, "labels": ids})
    assert len(runs) == len(model.layers)
    (loss / count).backward()
    assert len(runs) == 2 * len(model.layers)


def test_float8_converts_the_block_linears_and_leaves_the_head(tmp_path):
    """trainer.float8: torchao's Float8Linear in every block, the head a plain Linear (lmforge's
    loss reads its weight), on a model laid out with activation checkpointing."""
    pytest.importorskip("torchao", reason="torchao is the optional lmforge[fp8] extra")
    from torchao.float8.float8_linear import Float8Linear

    cfg = load_run_config(
        None,
        [
            *PRESET,
            "trainer.float8=true",
            "trainer.activation_checkpointing=full",
            f"run_dir={tmp_path}",
        ],
    )
    model = build(cfg.model.resolve(), seed=0)
    _lay_out(cfg, model, None, tmp_path=tmp_path)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert isinstance(module, Float8Linear) == name.startswith("layers."), name
    assert type(model.lm_head) is torch.nn.Linear
