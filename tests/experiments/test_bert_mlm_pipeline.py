"""Experiment 3's recipe is the SageMaker write-up's layout (2 pipeline stages, interleaved, 12
microbatches, data parallelism on top), and the script's one-process reference is the same step
without the pipeline.

That the two train alike is tests/train/test_parallel_training.py's
test_bert_mlm_pipeline_interleaved_with_data_parallel_equals_one_process (4 processes, a few steps);
docs/experiments/bert-mlm-pipeline.md has the full run.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lmforge.models import build
from lmforge.parallel.mesh import check_model
from lmforge.parallel.pipeline import split_model
from lmforge.train.config import load_run_config, parallel_layout
from lmforge.train.setup import check_fit
from lmforge.train.step import check_pipeline_batch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "experiments" / "bert-mlm-pipeline.yaml"
SCRIPT = ROOT / "scripts" / "experiments" / "bert_mlm_pipeline.sh"


def _one_process_overrides() -> list[str]:
    """The parallel.* and trainer.* overrides the script gives its one-process run (its step 3)."""
    text = SCRIPT.read_text()
    return re.findall(
        r"\b((?:parallel|trainer)\.\w+=\S+)", text[text.index("# 3.") : text.index("# 4.")]
    )


def test_recipe_on_four_processes_is_the_write_ups_layout():
    cfg = load_run_config(RECIPE)
    mcfg = cfg.model.config
    layout = parallel_layout(cfg, 4)
    assert (layout.pipeline, layout.data_replicate, layout.data_shard, layout.tensor) == (
        2,
        2,
        1,
        1,
    )
    assert (layout.pipeline_schedule, layout.virtual_stages) == ("interleaved_1f1b", 2)
    t = cfg.trainer
    grad_accum = check_fit(cfg, mcfg, data_parallel=2)
    layout = check_pipeline_batch(layout, grad_accum, t.micro_batch_size, t.global_batch_size, 2)
    assert layout.num_microbatches == 12
    assert t.global_batch_size == t.micro_batch_size * 12 * 2 == 24
    check_model(layout, mcfg)

    # Megatron's interleaved assignment: pipeline rank r runs layer chunks r and r + 2; each chunk
    # is one layer.
    model = build(mcfg, device="meta")
    parts = {r: split_model(model, r, 2, 2) for r in (0, 1)}
    layer_ids = {
        r: [[int(i) for i, _ in p.layers.named_children()] for p in ps] for r, ps in parts.items()
    }
    assert layer_ids == {0: [[0], [2]], 1: [[1], [3]]}
    assert parts[0][0].is_first and parts[1][1].is_last
    assert not any(p.is_first or p.is_last for p in (parts[0][1], parts[1][0]))


def test_the_scripts_one_process_run_is_the_same_step_without_pipeline():
    overrides = _one_process_overrides()
    assert "trainer.micro_batch_size=24" in overrides and "parallel.pipeline=1" in overrides
    base, one = load_run_config(RECIPE), load_run_config(RECIPE, overrides)
    mcfg = one.model.config
    assert not parallel_layout(one, 1).shards_model
    assert check_fit(one, mcfg, data_parallel=1) == 1  # the global batch of 24 as one micro-batch
    # Nothing else changes: model, data, seed, optimizer, schedule, global batch.
    same = dataclasses.replace(
        one,
        parallel=base.parallel,
        trainer=dataclasses.replace(one.trainer, micro_batch_size=base.trainer.micro_batch_size),
    )
    assert same == base
