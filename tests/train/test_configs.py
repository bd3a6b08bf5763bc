"""Every shipped recipe parses, validates and describes a model that builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.models import build, num_parameters
from lmforge.train.config import load_run_config, model_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_is_valid(path, tmp_path):
    cfg = load_run_config(path, [f"model.init_from={tmp_path}"] if "init_from" in path.read_text() else [])
    t = cfg.trainer
    assert t.global_batch_size % t.micro_batch_size == 0
    mcfg, init_from = model_config(cfg.model)
    if mcfg is not None:
        assert cfg.data.seq_length <= mcfg.max_position_embeddings
        assert num_parameters(build(mcfg, device="meta")) > 0
    else:
        assert init_from == str(tmp_path)


def test_there_are_recipes_for_every_reference_model():
    names = {p.stem for p in CONFIGS}
    assert {"pythia-160m", "pythia-6.9b", "neox-20b", "llama2-7b-continued", "gpt2", "gpt-j-6b"} <= names
