"""The experiment recipes parse, validate and describe models that build."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.models import build, num_parameters
from lmforge.train.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "experiments").glob("*.yaml"))
SCRIPTS = "\n".join(p.read_text() for p in (ROOT / "scripts" / "experiments").glob("*.sh"))


def _available(value: str) -> bool:
    """A file, folder or Megatron prefix (PREFIX.idx) that exists, or one under runs/ that an
    experiment script makes (those exist only after the script ran)."""
    path = Path(value)
    if path.parts[:1] == ("runs",):
        return path.name in SCRIPTS
    return path.exists() or path.with_name(path.name + ".idx").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_experiment_recipe_is_valid(path, tmp_path, monkeypatch, shared_data):
    monkeypatch.setenv("LMFORGE_SHARED_DATA", str(shared_data))
    cfg = load_run_config(
        path, [f"model.init_from={tmp_path}"] if "init_from" in path.read_text() else []
    )
    t = cfg.trainer
    assert t.global_batch_size % t.micro_batch_size == 0
    for key in ("tokenizer", "train_file", "valid_file"):
        value = getattr(cfg.data, key)
        assert value is None or _available(value), (key, value)
    mcfg = cfg.model.config
    if mcfg is not None:
        assert cfg.data.seq_length <= mcfg.max_position_embeddings
        assert num_parameters(build(mcfg, device="meta")) > 0
    assert cfg.cost.usd_per_hour > 0


def test_gpt2_sst2_learning_rate_follows_the_linear_scaling_rule():
    cfg = load_run_config(Path(CONFIGS[0]).with_name("gpt2-sst2.yaml"))
    base_lr, base_batch = 5e-4, 16  # the base the doc names
    assert cfg.optim.lr == pytest.approx(base_lr * cfg.trainer.global_batch_size / base_batch)
