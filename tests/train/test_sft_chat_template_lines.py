"""What an SFT run says of its chat template: which one renders the examples, and one account of
a turn end that is text, not a token."""

from __future__ import annotations

import json
import shutil

import pytest

from lmforge.tokenizers import load_tokenizer
from lmforge.train.config import load_run_config
from lmforge.train.tasks.sft import SFT

CHAT = {
    "messages": [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5, said tersely."},
    ]
}
ALPACA = {"instruction": "Add 2 and 3.", "output": "5"}


def _build(tokenizer_folder, records, tmp_path, caplog, *overrides):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_run_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "model.preset=tiny-gpt2",
            "data.task=sft",
            "data.seq_length=64",
            f"data.train_file={train}",
            *overrides,
        ],
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="lmforge"):
        SFT().build_data(cfg, load_tokenizer(tokenizer_folder))
    return [r.getMessage() for r in caplog.records if r.name == "lmforge.train.tasks.sft"]


def test_the_run_says_which_chat_template_renders_its_examples(shared_data, tmp_path, caplog):
    """One line per run: the model folder's file (chat_template.jinja over tokenizer_config.json,
    as read_chat_template reads them), a named built-in, a file, or, with none in the folder, the
    built-in per kind."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(shared_data / "tokenizers" / "gpt2" / "tokenizer.json", folder)
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    )
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(template)

    def line(records=(CHAT,), *overrides):
        lines = [
            m
            for m in _build(folder, records, tmp_path, caplog, *overrides)
            if m.startswith("chat template")
        ]
        assert len(lines) == 1, lines
        return lines[0]

    assert line() == (
        f"chat template: {folder} has none (data.chat_template=auto), so the built-in lmforge renders "
        "the chat examples"
    )
    assert line([ALPACA, ALPACA, CHAT]) == (
        f"chat template: {folder} has none (data.chat_template=auto), so Stanford Alpaca's prompt renders the alpaca "
        "examples, the built-in lmforge the chat examples"
    )
    assert line((CHAT,), "data.chat_template=chatml") == (
        "chat template: the built-in chatml (data.chat_template=chatml) renders the examples"
    )
    assert line((CHAT,), f"data.chat_template={jinja}") == (
        f"chat template: file {jinja} (data.chat_template={jinja}) renders the examples"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"})
    )
    assert line() == (
        f"chat template: the model's, from {folder / 'tokenizer_config.json'} "
        "(data.chat_template=auto) renders the examples"
    )
    (folder / "chat_template.jinja").write_text(template)
    assert line((CHAT,), "data.chat_template=model") == (
        f"chat template: the model's, from {folder / 'chat_template.jinja'} (data.chat_template=model) renders the "
        "examples"
    )


@pytest.mark.parametrize("packing", ["false", "true"])
def test_a_text_turn_end_is_one_warning_not_two(shared_data, tmp_path, caplog, packing):
    """ChatML on Llama's tokenizer (no <|im_end|> token): the answers are trained to end in the
    text <|im_end|>, at which generation stops. That is said once; the warning that the model
    does not learn to stop contradicted it."""
    lines = _build(
        shared_data / "tokenizers" / "llama2",
        [CHAT] * 3,
        tmp_path,
        caplog,
        "data.chat_template=chatml",
        f"data.packing={packing}",
    )
    assert any("turn marker <|im_end|> is no token of this tokenizer" in m for m in lines), lines
    assert "learn to stop" not in caplog.text
    # the warning still comes where nothing ends a turn: a template writing no end at all
    endless = tmp_path / "endless.jinja"
    endless.write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{% endgeneration %}{% else %}{{ m['content'] + '\n' }}{% endif %}{% endfor %}"
    )
    _build(
        shared_data / "tokenizers" / "llama2",
        [CHAT],
        tmp_path,
        caplog,
        f"data.chat_template={endless}",
    )
    assert "no answer ends in an end-of-turn token" in caplog.text


def test_a_dpo_run_says_it_too(shared_data, tmp_path, caplog):
    """DPO renders its pairs as SFT renders a chat, and said nothing of which template did."""
    from lmforge.train.tasks.dpo import DPO

    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(shared_data / "tokenizers" / "gpt2" / "tokenizer.json", folder)
    pair = {"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"}
    train = tmp_path / "pairs.jsonl"
    train.write_text(json.dumps(pair) + "\n")
    cfg = load_run_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "model.preset=tiny-gpt2",
            "data.task=dpo",
            "data.seq_length=64",
            f"data.train_file={train}",
        ],
    )
    with caplog.at_level("INFO", logger="lmforge"):
        DPO().build_data(cfg, load_tokenizer(folder))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chat template")]
    assert lines == [
        f"chat template: {folder} has none (data.chat_template=auto), so the built-in plain renders the "
        "plain examples"
    ]
