"""A second phase started from a first phase's checkpoint
(`model.init_from=RUN/checkpoints/step-N`, the README's way to change the batch or context): it
finds the tokenizer the first phase used (the copy in its checkpoint), and its exports carry what
the original Hugging Face folder carried (license files, generation settings), as the first
phase's do."""

from __future__ import annotations

import pytest

from lmforge.cli import main
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config

KEPT = ("tokenizer.json", "generation_config.json", "LICENSE", "USE_POLICY.md")


@pytest.mark.slow
def test_a_phase_from_a_checkpoint_keeps_the_tokenizer_license_and_generation_settings(
    tiny_llama, tiny_corpus, tmp_path
):
    from lmforge.models.source import model_origin, tokenizer_source

    one, two = tmp_path / "phase1", tmp_path / "phase2"
    common = (
        "trainer.max_steps=2",
        "trainer.val_check_interval=0",
        "checkpoint.convert_to_hf=true",
    )
    Trainer(run_config(tiny_corpus, one, f"model.init_from={tiny_llama}", *common)).fit()
    step = one / "checkpoints" / "step-00000002"
    two_cfg = run_config(tiny_corpus, two, f"model.init_from={step}", "data.seq_length=64", *common)
    trainer = Trainer(two_cfg)
    # The copy of phase 1's tokenizer its checkpoint holds (the same bytes as the original's).
    assert trainer.tokenizer is not None and trainer.tokenizer.files[0].parent == step
    assert (step / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()
    trainer.fit()
    for folder in (one / "hf", two / "hf"):
        assert all((folder / name).is_file() for name in KEPT), sorted(
            p.name for p in folder.iterdir()
        )
    later = two / "checkpoints" / "step-00000002"
    assert tokenizer_source(later) == later and model_origin(later) == tiny_llama
    # was "no single tokenizer file found"
    assert main(["export-hf", str(later), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in (two / "hf").iterdir()
    )


def test_a_data_tokenizer_other_than_the_models_is_said(tiny_llama, shared_data, tmp_path, caplog):
    """Continued pretraining with data.tokenizer set to another tokenizer than model.init_from's
    trained silently, the export carrying the new one: the embeddings' ids meant the old one's."""
    import logging
    import shutil

    from lmforge.train.setup import load_run_tokenizer

    copy = tmp_path / "same"
    copy.mkdir()
    shutil.copy(tiny_llama / "tokenizer.json", copy / "tokenizer.json")
    for other, said in (
        (copy, False),
        (tiny_llama, False),
        (shared_data / "tokenizers" / "gpt-neox-20b", True),
    ):
        caplog.clear()
        cfg = run_config(
            "c", tmp_path / "run", f"model.init_from={tiny_llama}", f"data.tokenizer={other}"
        )
        with caplog.at_level(logging.WARNING, logger="lmforge.train.setup"):
            load_run_tokenizer(cfg, needed=True)
        lines = [r.getMessage() for r in caplog.records if r.name == "lmforge.train.setup"]
        assert len(lines) == said and all(
            "is not the tokenizer of model.init_from" in line for line in lines
        ), other
