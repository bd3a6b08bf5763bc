"""`lmforge import-hf` of a Hugging Face folder without tokenizer files: one warning at import,
naming what generate, serve and finetune will need, rather than a silent success and an error at
the first `generate`."""

from __future__ import annotations

import logging
import shutil

import pytest

from lmforge.cli import main

pytest.importorskip("transformers")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_import_without_tokenizer_warns_once_and_generate_takes_one(
    hf_dirs, tmp_path, caplog, capsys
):
    from tests.inference.test_generate import _word_tokenizer

    src, out = hf_dirs["gpt_neox"], tmp_path / "lm"  # config.json + weights, no tokenizer
    with caplog.at_level(logging.INFO):
        assert main(["import-hf", str(src), str(out)]) == 0
    assert _warnings(caplog) == [
        f"'{out}' has no tokenizer (none in '{src}' that import-hf copies: tokenizer.json, vocab.json + merges.txt, "
        "tokenizer.model): `lmforge generate` and `lmforge serve` will need --tokenizer PATH and `lmforge finetune` "
        f"data.tokenizer=PATH, or copy the model's tokenizer files into '{out}'"
    ]
    assert "imported gpt_neox" in capsys.readouterr().out
    # What the warning says works: the imported folder generates with --tokenizer, and without it
    # says so.
    _word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert (
        main(
            [
                "generate",
                str(out),
                "--prompt",
                "t5 t17",
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
                "--tokenizer",
                str(tmp_path / "tokenizer.json"),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()
    assert main(["generate", str(out), "--prompt", "t5 t17"]) == 1
    assert "pass --tokenizer PATH" in capsys.readouterr().err


def test_an_import_with_its_tokenizer_warns_nothing(hf_dirs, tmp_path, caplog):
    from tests.inference.test_generate import _word_tokenizer

    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["gpt_neox"], src)
    _word_tokenizer().save(str(src / "tokenizer.json"))
    with caplog.at_level(logging.INFO):
        assert main(["import-hf", str(src), str(tmp_path / "lm")]) == 0
    assert _warnings(caplog) == [] and (tmp_path / "lm" / "tokenizer.json").is_file()
